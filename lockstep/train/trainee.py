"""The model as trained: model and wrapper, the workload's Loss, optimizer, schedule, scaler, autocast, hooks.

    trainee = build_trainee(cfg, rt, wl, layout, plan)  (lockstep.train.setup) the model on its device in
                                                         its parallel form; optimizer and schedule
    start = trainee.load_state(path, seed, log)          a checkpoint's weights, optimizer, schedule, RNG
    trainee.wrap_ddp(batches, parallel, start.compression, log)
                                                         plain DDP: the DDP check on the first steps'
                                                         micro-batches, DDP with what it chose, its hooks
    result = trainee.step(batches.next_step(), step)     one optimizer step (lockstep.train.step)
    trainee.evaluate(batches)                            the held-out loss

Every rank builds its Trainee in this order: several of these hold collectives. Nothing outside this
module sets its fields; its wrapper is chosen once, by wrap_ddp, before the first step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.checkpoint.plain import Checkpoint
from lockstep.config import ParallelConfig
from lockstep.data.batch import move_to_device
from lockstep.data.batches import Batches, StepBatches
from lockstep.data.sampler import Cursor
from lockstep.errors import GradientDivergence
from lockstep.parallel.buffers import convert_sync_batchnorm, differing_buffers, explain_buffers
from lockstep.parallel.compression import (
    Compression,
    apply_compression,
    load_compression_state,
    save_compression_state,
)
from lockstep.parallel.ddp import LossModule, UsageGuard, apply_ddp, syncs_buffers
from lockstep.parallel.ddp_check import (
    DDPChoice,
    check_gradients_agree,
    choose_ddp_options,
    find_unused_parameters,
    gather_usage,
)
from lockstep.parallel.mesh import BatchPlan, Layout
from lockstep.rng import seed_everything
from lockstep.runtime import Runtime
from lockstep.train.state import TrainingState, restore_plain, restore_sharded
from lockstep.train.step import evaluate, pipeline_step, train_step
from lockstep.train.step_clock import StepClock
from lockstep.train.workload import Workload


@dataclass
class StepResult:
    # the step's loss on this rank, on the device (its mean over the ranks is the step's)
    loss: torch.Tensor
    grad_norm: torch.Tensor  # before clipping
    lr: float  # the learning rate the step ran with
    skipped: bool = False  # fp16: its gradients overflowed and the GradScaler skipped it
    scale: float = 0.0  # fp16: the loss scale it ran with (0 without loss scaling)


@dataclass
class Trainee:
    """What trains, built once (build_trainee). `model` is the module the optimizer, clipping and checkpoints
    see (sharded as the layout says); `wrapped` is what the step calls, forward(batch[, divisor]) = the loss:
    the model with the workload's Loss, under DDP in plain data parallelism (wrap_ddp)."""

    workload: Workload
    model: nn.Module
    layout: Layout
    plan: BatchPlan
    rt: Runtime
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    autocast: contextlib.AbstractContextManager = field(default_factory=contextlib.nullcontext)
    scaler: torch.amp.GradScaler | None = None  # fp16 on CUDA only
    pipeline: Any = None  # this rank's pipeline stage and schedule (lockstep.parallel.pp), or None
    clip_norm: float = 0.0  # optim.gradient_clip_norm; 0 = no clipping
    check_grads: bool = False  # parallel.check_grads: gradient hashes compared after every step
    lr: float = 0.0  # the base learning rate, scaled to the global batch
    total_steps: int = 0  # the run's last step: where the schedule ends
    # of the whole model, before a pipeline cut it; None = no MFU
    flops_per_token: float | None = None
    peak_flops: float = 0.0  # of all ranks together, the MFU denominator
    wrapped: nn.Module | None = None
    ddp_choice: DDPChoice | None = None  # plain DDP only
    # parallel.grad_compression's hook bookkeeping (plain DDP only)
    compression: Compression | None = None
    guard: UsageGuard | None = None  # when DDP was told more than lockstep knows (see wrap_ddp)
    # parallel.check_grads: the buffers that differed between ranks, as last compared
    buffers_differ: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.wrapped is None:
            self.wrapped = LossModule(self.model, self.workload.loss)

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rt.rank)[1]

    def step(self, batches: StepBatches, step: int, clock: StepClock | None = None) -> StepResult:
        """Optimizer step `step` (1-based) on its micro-batches, then the schedule's step; `clock`
        is told where its phases end (lockstep.train.step_clock)."""
        lr = self.scheduler.get_last_lr()[0]
        # no wait: the last scaler.step synced already
        scale = self.scaler.get_scale() if self.scaler else 0.0
        if self.pipeline is not None:
            loss, grad_norm = pipeline_step(
                self.pipeline,
                self.optimizer,
                batches.micro_batches,
                self.rt.device,
                self.clip_norm,
                clock=clock,
            )
        else:
            checked = self.check_grads or self.compression is not None
            # a token-weighted loss is per target token of the whole step (all micro-batches, all ranks)
            loss, grad_norm = train_step(
                self.wrapped,
                self.model,
                self.optimizer,
                batches.micro_batches,
                self.rt,
                grad_accum=self.plan.grad_accum,
                autocast=self.autocast,
                clip_norm=self.clip_norm,
                loss=self.workload.loss,
                scaler=self.scaler,
                after_backward=functools.partial(self._after_reduce, step) if checked else None,
                before_reduce=functools.partial(self.guard, step=step) if self.guard else None,
                clock=clock,
            )
        self.scheduler.step()
        skipped = bool(self.scaler and self.scaler.get_scale() < scale)
        return StepResult(loss, grad_norm, lr, skipped, scale)

    def evaluate(self, batches: Batches) -> float:
        """Mean loss over the held-out set, each rank on its shard (per target token where the loss is
        token-weighted)."""
        pipeline = self.pipeline
        loss = self.workload.loss if pipeline is None else (lambda _, b: pipeline.evaluate(*b))
        return evaluate(self.model, batches.held_out(), self.rt, loss, self.autocast)

    def load_state(
        self, path: Path | Checkpoint | None, seed: int, log: logging.Logger
    ) -> TrainingState:
        """The checkpoint's state, its weights, optimizer, schedule and RNG loaded; or step 0 of a new
        run. `path`: a committed checkpoint's dir, or a memory snapshot read already (plain layouts)."""
        if path is None:
            # per-replica streams (dropout) from here on; tp peers share theirs
            seed_everything(seed + self.dp_rank)
            return TrainingState(step=0, cursor=Cursor())
        how = dict(rt=self.rt, seed=seed, seed_rank=self.dp_rank, plan=self.plan, log=log)
        if isinstance(path, Checkpoint):
            return restore_plain(
                path, self.workload, self.optimizer, self.scheduler, self.scaler, **how
            )
        if self.layout.sharded_checkpoints or _is_sharded(path):
            partial = self.pipeline is not None
            return restore_sharded(
                path, self.model, self.optimizer, self.scheduler, partial=partial, **how
            )
        return restore_plain(
            path, self.workload, self.optimizer, self.scheduler, self.scaler, **how
        )

    def wrap_ddp(
        self,
        batches: Batches,
        parallel: ParallelConfig,
        resumed_compression: dict | None,
        log: logging.Logger,
    ) -> None:
        """Plain DDP (replicas, no sharding): run the DDP check, then wrap the model with the options it
        chose and the gradient compression parallel.grad_compression names (its state from
        `resumed_compression`, a checkpoint's grad_compression.pt). Once, before the first step.

        The check runs on the first steps' real micro-batches, read ahead (batches.peek): training then
        uses them, so nothing is read twice. The built-in GPT needs no check: its forward uses every
        parameter, so its choice is known. Other layouts keep the model with its loss.
        """
        rt = self.rt
        assert self.ddp_choice is None, "wrap_ddp runs once"
        if not rt.distributed or self.layout.sharded_checkpoints:
            if parallel.grad_compression != "none" and rt.is_main:
                log.info(
                    "grad compression: %s has nothing to do on one process (no all-reduce)",
                    parallel.grad_compression,
                )
            return
        if parallel.sync_batchnorm:
            converted = convert_sync_batchnorm(self.model)
            log.log(
                logging.INFO if converted else logging.WARNING,
                "parallel.sync_batchnorm: %d BatchNorm layer(s) now compute their statistics over the "
                "global batch (SyncBatchNorm)%s",
                converted,
                "" if converted else "; this model has none",
            )
        wl, accum = self.workload, self.plan.grad_accum
        steps_left = batches.reading.last_step - batches.step
        check_steps = 0 if wl.uses_all_parameters else min(parallel.check_steps, steps_left)
        first = batches.peek(check_steps * accum)
        report = None
        if first:
            steps = [
                [move_to_device(b, rt.device) for b in first[i : i + accum]]
                for i in range(0, len(first), accum)
            ]
            unused, opaque = find_unused_parameters(self.model, steps, wl.loss, self.autocast)
            trainable = sum(p.requires_grad for p in self.model.parameters())
            report = gather_usage(rt, unused, trainable, opaque)
            log.info("DDP check: %s", report.format())
        choice = choose_ddp_options(report, parallel, accum, wl.uses_all_parameters)
        log.info(
            "DDP: find_unused_parameters=%s, static_graph=%s (%s)",
            choice.find_unused_parameters,
            choice.static_graph,
            choice.reason,
        )
        if choice.hint:
            log.info("DDP: %s", choice.hint)
        self.wrapped = apply_ddp(
            self.model,
            rt,
            wl.loss,
            find_unused_parameters=choice.find_unused_parameters,
            static_graph=choice.static_graph,
            bucket_cap_mb=parallel.bucket_cap_mb,
            gradient_as_bucket_view=parallel.gradient_as_bucket_view,
            broadcast_buffers=parallel.broadcast_buffers,
        )
        self.compression = apply_compression(
            self.wrapped, self.model, parallel, log if rt.is_main else None
        )
        if self.compression is not None and resumed_compression is not None:
            load_compression_state(self.compression, resumed_compression, rt, log)
        self.ddp_choice = choice
        if choice.guarded:
            self.guard = UsageGuard(rt, self.model, choice.static_graph, choice.reason, log)

    def compression_state(self) -> dict | None:
        """Every rank together: the gradient compression hook's state for a checkpoint (rank 0's; None
        elsewhere and where the hook keeps none)."""
        return save_compression_state(self.compression, self.rt)

    def _after_reduce(self, step: int) -> None:
        """After the step's backward (its gradients all-reduced): fp16 compression's overflow watch,
        parallel.check_grads. With fp16 autocast on CUDA the GradScaler owns overflow: it skips a step
        whose gradients came back inf and lowers its scale, so the watch stays out of its way."""
        if self.compression is not None and self.scaler is None:
            self.compression.check_step(step, self.rt)
        if self.check_grads:
            compare_gradients(self.rt, self.model, step, self.ddp_choice)
            differ = differing_buffers(self.rt, self.model)
            if differ and differ != self.buffers_differ and self.rt.is_main:
                why = explain_buffers(differ, syncs_buffers(self.wrapped))
                logging.getLogger("lockstep").warning("step %d: %s", step, why)
            self.buffers_differ = differ


def compare_gradients(rt: Runtime, model: nn.Module, step: int, choice: DDPChoice | None) -> None:
    """parallel.check_grads, after each backward: the gradient hashes of all ranks agree, or the run stops
    naming the DDP options it ran with (the usual suspect when replicas drift apart). Buffers may differ
    (the Trainee says which and why): each rank updates them from its own micro-batches."""
    try:
        check_gradients_agree(rt, model, step)
    except GradientDivergence as e:
        if choice is None:
            raise
        raise GradientDivergence(
            f"{e}. DDP ran with find_unused_parameters={choice.find_unused_parameters}, "
            f"static_graph={choice.static_graph} ({choice.reason})"
        ) from None


def _is_sharded(path: Path) -> bool:
    # DTensor imports only where a checkpoint needs them
    from lockstep.checkpoint.manifest import is_sharded

    return is_sharded(path)
