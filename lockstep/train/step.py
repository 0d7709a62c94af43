"""One optimizer step and one evaluation: the inner pieces of the training loop (lockstep.train.loop)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lockstep.collectives import all_reduce_sum
from lockstep.data.batch import move_to_device
from lockstep.models.loss import Loss
from lockstep.parallel.ddp import ForwardLoss
from lockstep.parallel.fsdp import clip_grad_norm
from lockstep.parallel.fsdp import no_sync as fsdp_no_sync
from lockstep.runtime import Runtime
from lockstep.runtime.cuda import cuda_facts
from lockstep.train.step_clock import StepClock

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_mixed_precision(
    mixed_precision: str, device: torch.device, gpu: dict | None = None
) -> tuple[str, str]:
    """(what train.mixed_precision = 'auto' means on `device`, why); other values are returned as they are.

    bf16 autocast pays only where the device has bf16 kernels: CUDA devices that support it, and CPUs with
    AVX-512 (oneDNN's bf16 path; fastest with AVX512-BF16 or AMX). `gpu`: the device's cuda_facts (read
    from the device when not given).
    """
    if mixed_precision != "auto":
        return mixed_precision, "as set"
    if device.type == "cuda":
        gpu = gpu or cuda_facts(device)
        if gpu["bf16"]:
            return "bf16", f"{gpu['name']} (compute capability {gpu['capability']}) computes bf16"
        return "no", f"{gpu['name']} has no bf16 (fp16 needs train.mixed_precision=fp16)"
    if device.type == "cpu":
        # oneDNN's own test: bf16 kernels on AVX-512 cores (native with AVX512-BF16 / AMX); on AVX2-only CPUs bf16
        # autocast converts around fp32 work and runs slower than fp32
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            native = [
                name
                for name, probe in (
                    ("AMX", "_is_amx_tile_supported"),
                    ("AVX512-BF16", "_is_avx512_bf16_supported"),
                )
                if getattr(torch.cpu, probe, lambda: False)()
            ]
            return "bf16", f"this CPU runs oneDNN's bf16 kernels ({', '.join(native) or 'AVX-512'})"
        return "no", "this CPU has no AVX-512: bf16 autocast would be emulated, slower than fp32"
    return (
        "no",
        f"no bf16 autocast chosen for {device.type} devices; set train.mixed_precision=bf16 to try it",
    )


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


def _grads_in_buckets(wrapped: nn.Module) -> bool:
    """DDP with gradient_as_bucket_view (lockstep.parallel.ddp), once it has rebuilt its buckets:
    the gradients are views of them. Zeroed in place they stay views, and the next step's no_sync
    micro-batches add into the buckets; set to None, those micro-batches make fresh gradients
    beside the buckets: one gradient's worth more at every accumulating step's peak (GPT-2 124M on
    2 gloo ranks: 2,981 MiB against 2,508, BENCHMARKS.md "`lockstep plan` against real runs").
    Before the rebuild (DDP's second forward, torch's private flag) they are set to None: the old
    buckets' views would hold them while the new buckets are made (2,784 MiB that step)."""
    buckets = getattr(wrapped, "gradient_as_bucket_view", False)
    return bool(buckets and getattr(wrapped, "_has_rebuilt_buckets", False))


def train_step(
    wrapped: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Iterable[Any],
    rt: Runtime,
    *,
    grad_accum: int = 1,
    autocast: contextlib.AbstractContextManager | None = None,
    clip_norm: float = 0.0,
    loss: Loss | None = None,
    scaler: torch.amp.GradScaler | None = None,
    after_backward: Callable[[], None] | None = None,
    before_reduce: Callable[[torch.Tensor], None] | None = None,
    clock: StepClock | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward+backward over `grad_accum` micro-batches, then one optimizer step.

    `wrapped` is the model with its loss (lockstep.parallel.ddp.LossModule, under DDP in plain data
    parallelism): wrapped(batch[, divisor]) is the loss; `model` is what the optimizer and clipping see.
    Micro-steps before the last run forward *and* backward under no_sync(): DDP registers its all-reduce
    during forward, so wrapping only backward still syncs. Exactly one gradient all-reduce happens per
    optimizer step. `before_reduce(loss)` runs on the last micro-batch's loss before its backward, which
    all-reduces (lockstep.parallel.ddp.UsageGuard); `after_backward` once the gradients are final.
    `clock` (lockstep.train.step_clock) is told where forward+backward and the optimizer end.

    `loss` is the workload's Loss: with its mean rule (or None) each micro-batch's loss weighs
    1 / grad_accum. Token-weighted, the targets of every micro-batch on every rank are counted on the CPU
    and summed over rt's ranks (one small all-reduce), each batch's loss is its per-target sum over that
    count N, multiplied by world_size because DDP and FSDP average gradients over the ranks.
    Returns (the step's loss on this rank, grad norm before clipping), as tensors so nothing waits on the
    device here; the loss's mean over the ranks is the step's mean loss (per target token when weighted).
    """
    no_sync = getattr(wrapped, "no_sync", None) or functools.partial(fsdp_no_sync, model)
    autocast = autocast or contextlib.nullcontext()
    divisor = None
    if loss is not None and loss.token_weighted:
        micro_batches = list(micro_batches)  # every count is needed before the first forward
        divisor = _count_step_targets(rt, micro_batches, loss.count_targets)
    loss_sum = torch.zeros((), device=rt.device)
    for i, batch in enumerate(micro_batches):
        batch = move_to_device(batch, rt.device)
        last = i == grad_accum - 1
        with contextlib.nullcontext() if last else no_sync():
            with autocast:
                value = wrapped(batch) if divisor is None else wrapped(batch, divisor)
            if last and before_reduce is not None:
                before_reduce(value)
            scaled = value * rt.world_size if divisor is not None else value / grad_accum
            (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += value.detach()
    if clock is not None:
        clock.lap_backward()
    if scaler:
        scaler.unscale_(optimizer)
    if after_backward is not None:
        after_backward()
    # DTensor-aware
    grad_norm = clip_grad_norm(model.parameters(), clip_norm if clip_norm > 0 else math.inf)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=not _grads_in_buckets(wrapped))
    if clock is not None:
        clock.lap("optimizer")
    # per target token: sum / N x world, whose mean over the ranks (the loop's log) is the global token mean
    return (loss_sum * rt.world_size if divisor is not None else loss_sum / grad_accum), grad_norm


def _count_step_targets(
    rt: Runtime, micro_batches: list[Any], count_targets: Callable[[Any], int]
) -> int:
    """The targets of one optimizer step on every rank, at least 1 (a step without any then has loss 0, not NaN).

    Summed over all of rt's ranks: for the workloads that count (Hugging Face models) they are the data-parallel
    ranks; ranks that read the same samples (tensor-parallel peers) would multiply N and world_size alike.
    """
    local = sum(count_targets(b) for b in micro_batches)  # on the CPU copies: no device sync
    return max(int(all_reduce_sum(rt, [local])[0]), 1)


def pipeline_step(
    pipeline,
    optimizer: torch.optim.Optimizer,
    micro_batches: Iterable[Any],
    device: torch.device,
    clip_norm: float,
    clock: StepClock | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of a pipeline stage: the step's micro-batches go through the schedule together.

    Every stage gets the same (x, y) micro-batches; the schedule splits their concatenation back into
    them, so pipeline micro-batches are exactly the accumulation micro-batches of the other layouts.
    `clock` is told where compute, the bubble, the tied gradients' exchange and the optimizer end.
    """
    batches = [move_to_device(b, device) for b in micro_batches]
    # (accum * micro, T) each
    x, y = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    optimizer.zero_grad(set_to_none=True)  # the schedule scales every .grad, leftovers included
    lap = clock.lap if clock is not None else None
    if lap is not None:
        lap("compute")  # the batches onto the device
    loss = pipeline.step(x, y, lap)
    grad_norm = pipeline.clip_grad_norm_(clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if lap is not None:
        lap("optimizer")
    return loss, grad_norm


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterator[Any],
    rt: Runtime,
    loss: ForwardLoss,
    autocast: contextlib.AbstractContextManager | None = None,
) -> float:
    """Mean loss over every rank's shard of the held-out samples (sum and count all-reduced).

    Each micro-batch weighs the same (every rank gets equally many, equally sized ones), matching training;
    with a token-weighted Loss each target token does: a batch adds its count and its loss summed over its
    tokens (its per-target sum over that count, times the count).
    """
    counts = loss.count_targets if isinstance(loss, Loss) else None
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        n = counts(batch) if counts is not None else None  # on the CPU copy
        batch = move_to_device(batch, rt.device)
        with autocast or contextlib.nullcontext():
            # no targets: adds 0
            value = loss(model, batch) if n is None else loss(model, batch, max(n, 1))
        total += float(value) * (1 if n is None else max(n, 1))
        count += 1 if n is None else n
    model.train(was_training)
    total, count = all_reduce_sum(rt, [total, count]).tolist()
    return total / max(count, 1)
