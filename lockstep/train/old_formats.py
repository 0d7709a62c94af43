"""The checkpoint loaders a run resumes with: lockstep.checkpoint's, given the models' upgrades of old formats.

lockstep.checkpoint knows no model; a model whose tensor layout changed since a checkpoint format was
written gives the conversion (lockstep.models.gpt.upgrade_format_1: the built-in GPT's qkv rows, format 1),
and this passes it, so a run resumes from a checkpoint an older lockstep wrote. The upgrade leaves other
model kinds' tensors as they are.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lockstep.checkpoint.open import load_checkpoint as _load_checkpoint
from lockstep.checkpoint.plain import Checkpoint
from lockstep.models.gpt import upgrade_format_1


def load_checkpoint(path: Path, map_location="cpu") -> Checkpoint:
    """lockstep.checkpoint.open.load_checkpoint, old formats upgraded."""
    return _load_checkpoint(path, map_location, upgrade=upgrade_format_1)


def load_sharded_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    partial: bool = False,
) -> dict:
    """lockstep.checkpoint.sharded_load.load_sharded_checkpoint, a plain checkpoint's old format upgraded."""
    # DCP: for sharded layouts only
    from lockstep.checkpoint.sharded_load import load_sharded_checkpoint as load

    return load(path, model, optimizer, partial, upgrade=upgrade_format_1)
