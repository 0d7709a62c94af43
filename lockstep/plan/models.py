"""The model a plan simulates, built as `lockstep train` builds it but on fake tensors (no storage),
with its loss and a batch of the shape one micro-batch has.

Today the built-in GPT (model.kind: gpt), the only kind lockstep shards with tensor and pipeline
parallelism. Its vocabulary is model.vocab_size as configured: a BPE tokenizer that `train` builds
from the corpus may raise it (lockstep.train.workload), which a plan cannot know without the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep.config import Config
from lockstep.errors import ConfigError
from lockstep.models.loss import Loss


@dataclass
class FakeModel:
    model: nn.Module
    loss: Loss
    batch: Callable[[int], Any]  # micro-batch size -> one fake micro-batch
    flops_per_token: float  # training FLOPs per token, forward and backward
    tokens_per_sample: int
    uses_all_parameters: bool


def build_fake_model(cfg: Config) -> FakeModel:
    """Under an active FakeTensorMode: cfg's model, its loss and its batches."""
    if cfg.model.kind != "gpt":
        raise ConfigError(
            f"lockstep plan simulates model.kind = 'gpt' today, not {cfg.model.kind!r}: Hugging "
            "Face and custom models are not built on fake tensors yet"
        )
    from lockstep.models.gpt import batch_loss, build_gpt

    m = cfg.model
    model = build_gpt(m)
    seq, vocab = m.max_seq_length, m.vocab_size

    def batch(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, vocab, (micro, seq)), torch.randint(0, vocab, (micro, seq))

    return FakeModel(
        model=model,
        loss=Loss(batch_loss),
        batch=batch,
        flops_per_token=model.flops_per_token(),
        tokens_per_sample=seq,
        uses_all_parameters=True,
    )
