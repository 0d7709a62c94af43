"""One optimizer step on fake tensors as lockstep's trainer runs it, its memory tracked: the rank's
bytes by part at the step's peak (lockstep.plan.simulate builds the rank and calls this).

    step_memory(cfg, layout, plan, rt, built, pipeline, fake) -> {part: bytes}, ORDER's parts

lockstep.train.step's train_step runs a data-parallel or tensor-parallel rank's micro-batches; a
pipeline stage's are run by hand as its schedule holds them (_stage_step says why). torch's own
trackers (MemTracker; FSDPMemTracker under FSDP, lockstep.plan.trackers) sort every tensor the
step makes into PARTS; DDP's buckets are added by hand (lockstep.plan.simulate's docstring).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from lockstep.optim import build_optimizer

# the trackers' categories (MemTracker's and FSDPMemTracker's names) -> the plan's parts
PARTS = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Buffer": "buffers",
    "Unsharded Param": "gathered parameters",
    "All Gather": "gathered parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporary",
    "Other": "temporary",
}
ORDER = (
    "parameters",
    "buffers",
    "gradients",
    "ddp buckets",
    "optimizer",
    "gathered parameters",
    "activations",
    "temporary",
)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def autocast_for(mixed_precision: str) -> contextlib.AbstractContextManager:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


def step_memory(cfg, layout, plan, rt, built, pipeline, fake) -> dict[str, int]:
    """Bytes per part at the peak of an optimizer step, AdamW's state made first.

    AdamW is fused as the run's (lockstep.optim), but on DTensor parameters (FSDP, TP), where it
    runs one tensor at a time (_adamw). The tracker is the inner mode: it sees each op before the
    fake mode computes it."""
    from lockstep.plan.trackers import step_tracker

    model = built.model
    with fake:
        if layout.tp > 1:
            _warm_sharding_cache(cfg, plan, rt, built, pipeline)
        optimizer = _adamw(cfg, model)
        tracker = step_tracker(model, optimizer, fsdp=layout.data_parallel == "fsdp")
        with tracker:
            _first_adamw_step(model, optimizer)
            if pipeline is not None:
                _stage_step(cfg, plan, built, pipeline, optimizer, tracker)
            else:
                _data_parallel_step(cfg, plan, rt, built, optimizer, tracker)
        peak = tracker.get_tracker_snapshot("peak")
    parts = dict.fromkeys(ORDER, 0)
    for snap in peak.values():
        for kind, size in snap.items():
            if kind != "Total":
                parts[PARTS[str(getattr(kind, "value", kind))]] += size
    grads = sum(
        local_tensor(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad
    )
    if layout.dp > 1 and layout.pp > 1:
        # a stage's replicas average their gradients through one flat copy of them after the
        # backward (lockstep.parallel.pp): a moment of its own, counted where it is the peak
        after = sum(parts[k] for k in ("parameters", "buffers", "optimizer")) + 2 * grads
        parts["temporary"] += max(0, after - sum(parts.values()))
    elif layout.dp > 1 and layout.data_parallel == "ddp":
        # gradient_as_bucket_view: the gradients are views of buckets DDP holds from its start
        parts["ddp buckets"] = grads
        parts["gradients"] = 0
    return parts


_WARMED: set[tuple] = set()  # the steps whose ops this process has run once (_warm_sharding_cache)


def _warm_sharding_cache(cfg, plan, rt, built, pipeline) -> None:
    """The tracked step's ops once before it, untracked, with a spare AdamW. DTensor's sharding
    propagation runs each op once on fake tensors of its global shape and then reads a cache:
    tracked, that first time counts as memory no real step holds (GPT-2 124M on TP 2, micro 2:
    1,831 MiB in a process's first simulation, 1,720 in every later one; the real ranks 1,758).
    Once per shape of step in a process: another rank of the stage, or the twin with activation
    checkpointing flipped (the same ops, recomputed), finds the cache warm."""
    model_shape = dataclasses.replace(cfg.model, gradient_checkpointing=False)
    stage = pipeline.stage.stage_index if pipeline is not None else 0
    key = (repr(model_shape), cfg.train.mixed_precision, plan.micro_batch, min(plan.grad_accum, 2))
    key += (rt.world_size, cfg.parallel.data_parallel, cfg.parallel.tensor_parallel, stage)
    if key in _WARMED:
        return
    _WARMED.add(key)
    model = built.model
    spare = _adamw(cfg, model)
    _first_adamw_step(model, spare)
    if pipeline is not None:
        _stage_step(cfg, plan, built, pipeline, spare, _Untracked())
    else:
        _data_parallel_step(cfg, plan, rt, built, spare, _Untracked())
    spare.zero_grad(set_to_none=True)


class _Untracked:
    def reset_mod_stats(self) -> None:
        pass


def _adamw(cfg, model: nn.Module):
    """The run's AdamW: fused, as lockstep.optim makes it (it updates each element in place: no
    temporaries). On DTensor parameters one tensor at a time instead (a denominator of the
    tensor's size at a time: up to twice its largest shard over fused), as the fused CPU kernel on
    fake DTensors was tracked at 1.9 GiB of state for a GPT-2 124M shard of 15 MiB (fake tensors
    only: on real ones fused and foreach both held 59 MiB, FSDP over 16 ranks)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return build_optimizer(model, cfg.optim, 1e-4, "cpu")
    optimizer = build_optimizer(model, cfg.optim, 1e-4, "fake")
    for group in optimizer.param_groups:
        group["foreach"] = False
    return optimizer


def _first_adamw_step(model: nn.Module, optimizer) -> None:
    """AdamW's state as a first step makes it (and a step's moment of gradients, state and
    parameters together), without that step's forward and backward."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _data_parallel_step(cfg, plan, rt, built, optimizer, tracker) -> None:
    """lockstep.train.step.train_step as the trainer runs it, with two micro-batches where the run
    accumulates: the second's backward runs beside the first's whole gradients (FSDP's unsharded
    ones too), which is the peak of an accumulating step (one micro-batch alone read GPT-2 124M's
    real peak 13% low, bench/bench_plan.py). The trackers take one forward of a module per step:
    each micro-batch starts their module stats afresh (the peak stays)."""
    from lockstep.parallel.ddp import LossModule
    from lockstep.train.step import train_step

    loss_module = LossModule(built.model, built.loss)

    # a function, so no no_sync: train_step uses FSDP's, as for a LossModule
    def each_micro_batch(batch, divisor=None):
        tracker.reset_mod_stats()
        return loss_module(batch, divisor)

    micro = min(plan.grad_accum, 2)
    train_step(
        each_micro_batch,
        built.model,
        optimizer,
        [built.batch(plan.micro_batch) for _ in range(micro)],
        rt,
        grad_accum=micro,
        autocast=autocast_for(cfg.train.mixed_precision),
        clip_norm=cfg.optim.gradient_clip_norm,
        loss=built.loss,
    )


def _stage_step(cfg, plan, built, pipeline, optimizer, tracker) -> None:
    """A pipeline stage's step as its schedule holds memory: GPipe runs every micro-batch's forward
    before the backwards, 1F1B at most (stages - stage index) at once (torch's Schedule1F1B
    warm-up). Run by hand on the stage torch.distributed.pipelining would run: the schedule's
    P2P shape exchange would receive a fake group's garbage. One micro-batch at a time, as the
    schedule runs them (one forward of all of them held each op's temporaries for all: GPT-2 124M's
    stages read 7-11% over the real ones, bench/bench_plan.py); each starts the trackers' module
    stats afresh (they take one forward of a module per step; the peak stays)."""
    from lockstep.models.gpt import lm_loss

    stage, module = pipeline.stage, pipeline.stage.submod
    if cfg.parallel.pipeline_schedule == "gpipe":
        in_flight = plan.grad_accum
    else:
        in_flight = min(plan.grad_accum, stage.num_stages - stage.stage_index)
    held = []
    for _ in range(in_flight):
        tracker.reset_mod_stats()
        x, y = built.batch(plan.micro_batch)
        if not stage.is_first:
            x = torch.empty((*x.shape, cfg.model.hidden_size), requires_grad=True)
        held.append((module(x), y))
    while held:  # each micro-batch's output let go after its backward, as the schedule does
        out, y = held.pop(0)
        if stage.is_last:
            lm_loss(out, y).backward()
        else:
            out.backward(torch.empty_like(out))
        del out, y
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
