"""A model whose branch only some batches use, and a frozen layer: what the DDP tests train."""

from __future__ import annotations

import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.branch, self.frozen = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.frozen(self.trunk(x))
        return (self.branch(h) if use_branch else h).square().mean()


def _forward(model, batch):
    x, use = batch
    return model(x, use)
