"""One optimizer step, one evaluation, and the stop request: the inner pieces of the training loop."""

from __future__ import annotations

import contextlib
import math
import signal
from typing import Iterable, Iterator

import torch
from torch import nn

from lockstep.collectives import all_reduce_max, all_reduce_sum
from lockstep.runtime import Runtime

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_autocast(mixed_precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast instead of hand casts: matmuls run in bf16/fp16, reductions and the loss stay fp32."""
    if mixed_precision == "no":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[mixed_precision])


def build_grad_scaler(mixed_precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling (its range underflows small gradients); bf16 has fp32's range and does not."""
    if mixed_precision == "fp16" and device.type == "cuda":
        return torch.amp.GradScaler("cuda")
    return None


def train_step(
    ddp_model: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    grad_accum: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
    clip_norm: float,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward+backward over `grad_accum` micro-batches, then one optimizer step.

    Micro-steps before the last run forward *and* backward under no_sync(): DDP
    registers its all-reduce during forward, so wrapping only backward still syncs.
    Exactly one gradient all-reduce happens per optimizer step.
    Returns (mean loss over the micro-batches, grad norm before clipping), as tensors
    so nothing waits on the device here.
    """
    no_sync = getattr(ddp_model, "no_sync", contextlib.nullcontext)
    loss_sum = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro_batches):
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        sync_ctx = no_sync() if i < grad_accum - 1 else contextlib.nullcontext()
        with sync_ctx:
            with autocast:
                _, loss = ddp_model(x, y)
            # each micro-batch holds the same number of tokens, so mean-of-means is the global mean
            scaled = loss / grad_accum
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.detach()
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm if clip_norm > 0 else math.inf)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / grad_accum, grad_norm


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    rt: Runtime,
    autocast: contextlib.AbstractContextManager,
) -> float:
    """Mean loss over every rank's shard of the held-out windows (sum and count all-reduced)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        with autocast:
            _, loss = model(x.to(rt.device), y.to(rt.device))
        total += float(loss) * y.numel()
        count += y.numel()
    model.train(was_training)
    total, count = all_reduce_sum(rt, [total, count]).tolist()
    return total / max(count, 1)


class StopRequest:
    """SIGTERM or Ctrl-C sets a flag; the loop checks it at step boundaries on every rank.

    A signal that reaches only one rank still stops them all: the flag is all-reduced
    (max) each step, then every rank commits the checkpoint together and exits.
    A second Ctrl-C aborts at once.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def agreed(self, rt: Runtime) -> bool:
        return all_reduce_max(rt, 1.0 if self.signum is not None else 0.0) > 0
