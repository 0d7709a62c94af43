"""A workload's loss: how a batch becomes the number training minimizes, and how batches weigh in a step.

Every workload (lockstep.train.workload) builds one `Loss` when it is built; the step, the evaluation,
the DDP check and DDP's wrapper call it and nothing else. Its rule is one of two:

- **mean**: `count_targets` is None. loss(model, batch) is the model's loss of the batch, whatever it
  averages over; a step of `grad_accum` micro-batches weighs each 1 / grad_accum, and the ranks'
  gradients are averaged. That equals one big batch when every micro-batch holds as many targets (the
  built-in GPT's packed windows, fixed-size samples).
- **token-weighted**: `count_targets(batch)` counts the target tokens of a batch (on its CPU copy).
  The step counts every micro-batch's on every rank (one all-reduce, lockstep.train.step), N = max(that,
  1), and loss(model, batch, N) is the batch's *sum* of per-target losses divided by N. Accumulation
  and any world size then equal one batch of all the step's samples for a per-token loss, however
  unevenly padding spreads the targets (ChatML, speech transcripts, audio codes). Without N (the DDP
  check, a batch alone) the batch's own count divides: its per-target mean.

How a model produces the sum is the workload's business (`forward`); lockstep.models.hf decides it once
per model class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Loss:
    """forward(model, batch) -> the batch's loss (mean rule), or forward(model, batch, n) -> its sum of
    per-target losses / n (token-weighted: `count_targets` given)."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        count_targets: Callable[[Any], int] | None = None,
    ) -> None:
        self.forward = forward
        self.count_targets = count_targets

    @property
    def token_weighted(self) -> bool:
        return self.count_targets is not None

    def __call__(self, model: nn.Module, batch: Any, divisor: int | None = None) -> torch.Tensor:
        if self.count_targets is None:
            return self.forward(model, batch)
        if divisor is None:  # one batch on its own: its mean per target
            divisor = max(self.count_targets(batch), 1)
        return self.forward(model, batch, divisor)
