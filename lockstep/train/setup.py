"""What the training loop needs, built before it runs: layout, workload, parallel model, optimizer, data, DDP.

The order is fixed (DESIGN.md, "Data flow"), and lockstep.train.run calls these in it:

    build_setup          layout and its checks, batch plan, workload, parallelism, optimizer and schedule
    (resume)             lockstep.train.state: the checkpoint's weights, optimizer, RNG and data cursor
    measure_peak_flops_total, log_plan
    build_batches        this rank's micro-batches from the cursor on, and its share of the held-out set
    apply_checked_ddp    the DDP check on the first steps' micro-batches, then DDP with what it chose, and its
                         gradient compression hook (its state from the checkpoint)

Every rank runs all of them, in this order: several hold collectives.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.collectives import all_reduce_sum
from lockstep.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from lockstep.data.batch import move_to_device
from lockstep.data.sampler import (Cursor, GlobalCursorSampler, available_cores, build_loader,
                                   eval_micro_batches, resolve_num_workers, steps_per_epoch)
from lockstep.errors import ConfigError, DataError, GradientDivergence
from lockstep.peak_flops import load_peak_flops
from lockstep.models.quantize import check_4bit_training
from lockstep.optim import build_optimizer, build_scheduler, scaled_learning_rate
from lockstep.parallel.apply import apply_parallelism
from lockstep.parallel.buffers import (
    check_sync_batchnorm, convert_sync_batchnorm, differing_buffers, explain_buffers,
)
from lockstep.parallel.compression import Compression, apply_compression, check_compression
from lockstep.parallel.ddp import LossModule, UsageGuard, apply_ddp, syncs_buffers
from lockstep.parallel.ddp_check import (
    DDPChoice, check_gradients_agree, choose_ddp_options, find_unused_parameters, gather_usage,
)
from lockstep.parallel.mesh import BatchPlan, Layout, resolve_batch, resolve_layout
from lockstep.rng import seed_everything
from lockstep.runtime import Runtime, check_mixed_precision
from lockstep.runtime.cuda import describe_device
from lockstep.train.step import resolve_mixed_precision, AMP_DTYPES, build_autocast, build_grad_scaler
from lockstep.train.workload import Workload, build_workload, unused_settings


@dataclass
class Setup:
    """What setup built, handed to the loop in one piece."""

    rt: Runtime
    run_dir: Path
    layout: Layout
    plan: BatchPlan
    dp_rank: int  # the data is split by data-parallel rank: tp / pp peers read the same samples
    wl: Workload
    model: nn.Module  # on the device, sharded as the layout says (FSDP / TP / this pipeline stage)
    pipeline: Any  # this rank's pipeline stage and schedule (lockstep.parallel.pp), or None
    autocast: contextlib.AbstractContextManager
    scaler: torch.amp.GradScaler | None  # fp16 on CUDA only
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    lr: float  # the base learning rate, scaled to the global batch
    total_steps: int  # the run's last step
    flops_per_token: float | None  # of the whole model, before a pipeline cuts it to one stage; None = no MFU
    # what training calls, forward(batch[, divisor]) = the loss: the model with the workload's Loss, under DDP
    # in plain data parallelism (apply_checked_ddp); FSDP / TP reduce inside the model's own hooks and DTensors
    ddp_model: nn.Module
    ddp_choice: DDPChoice | None = None  # plain DDP only
    compression: Compression | None = None  # parallel.grad_compression's hook bookkeeping (plain DDP only)
    guard: UsageGuard | None = None  # when DDP was told more than lockstep knows (see apply_checked_ddp)
    buffers_differ: list[str] = field(default_factory=list)  # parallel.check_grads: as last compared
    peak_flops: float = 0.0  # of all ranks together, the MFU denominator (measure_peak_flops_total)
    save_group: Any = None  # checkpoint.async_save of a sharded layout: the background saves' gloo group (build_save_group)
    # from the resume cursor on (build_batches)
    batches: Iterator[Any] = field(default_factory=lambda: iter(()))  # this rank's training micro-batches
    eval_batches: list = field(default_factory=list)  # this rank's held-out index batches; empty = no eval


def build_setup(cfg: Config, rt: Runtime, log: logging.Logger) -> Setup:
    """Everything before the resume: the layout, the workload on the device in its parallel form, the optimizer."""
    t, run_dir = cfg.train, Path(cfg.checkpoint.output_dir)
    t.mixed_precision, why = resolve_mixed_precision(t.mixed_precision, rt.device)  # 'auto' on this device
    layout = build_layout(cfg.parallel, cfg.model, t.mixed_precision, rt)
    _, dp_rank, _ = layout.coords(rt.rank)
    plan = resolve_batch(t, layout.dp)
    log.info("rank %d/%d on %s (pid %d), device %s, backend %s, launcher %s; layout %s; mixed precision %s (%s)",
             rt.rank, rt.world_size, rt.hostname, os.getpid(), describe_device(rt.device), rt.backend or "-", rt.launcher,
             layout.describe(), t.mixed_precision, why)

    seed_everything(t.seed)  # identical initial weights on every rank (DDP also broadcasts rank 0's)
    wl = build_workload(cfg, rt, run_dir, log)
    if rt.is_main:
        for line in unused_settings(cfg):
            log.warning("%s", line)
        if cfg.parallel.data_parallel != layout.data_parallel:  # resolve_layout: one replica shards nothing
            log.warning("parallel.data_parallel = fsdp with %s: one data-parallel replica has nothing to shard, "
                        "so this run trains the plain layout (checkpoints in safetensors)", layout.describe())
    flops_per_token = wl.flops_per_token  # before a pipeline cuts the model to one stage
    model = wl.model.to(rt.device)
    total_steps = count_steps(t, len(wl.train_ds), plan)
    autocast = build_autocast(t.mixed_precision, rt.device)
    scaler = build_grad_scaler(t.mixed_precision, rt.device)
    pipeline = apply_parallelism(model, layout, rt, cfg.parallel, t.mixed_precision, autocast, plan.grad_accum,
                                 wl.uses_all_parameters)
    if t.compile:
        apply_compile(model, layout)
    lr = scaled_learning_rate(cfg.optim, plan.global_batch)
    optimizer = build_optimizer(model, cfg.optim, lr, rt.device.type)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    return Setup(rt=rt, run_dir=run_dir, layout=layout, plan=plan, dp_rank=dp_rank, wl=wl, model=model,
                 pipeline=pipeline, autocast=autocast, scaler=scaler, optimizer=optimizer, scheduler=scheduler, lr=lr,
                 total_steps=total_steps, flops_per_token=flops_per_token, ddp_model=LossModule(model, wl.loss),
                 save_group=build_save_group(cfg, layout, rt))


def apply_compile(model: nn.Module, layout: Layout) -> None:
    """train.compile: torch.compile the model in place, after FSDP / TP and before DDP wraps it (DDP's own
    optimizer then splits the graph at its buckets). In place, the parameters and state_dict keys stay the
    module's own: checkpoints of compiled and plain runs are interchangeable."""
    if layout.pp > 1:
        raise ConfigError(f"train.compile with {layout.describe()}: lockstep does not compile pipeline stages; "
                          "drop --compile, or use parallel.pipeline_parallel=1")
    model.compile()


def build_save_group(cfg: Config, layout: Layout, rt: Runtime) -> Any:
    """checkpoint.async_save of a sharded layout: a gloo group of its own, made once per run (every rank joins), for
    the collectives of the saves written in the background (DCP's planning, the shard reports, the commit's outcome).
    On the training thread's group they would interleave with its own collectives. None where none is needed."""
    if not (cfg.checkpoint.async_save and layout.sharded_checkpoints and rt.distributed):
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.distributed.timeout_seconds))


def build_layout(parallel: ParallelConfig, model: ModelConfig, mixed_precision: str, rt: Runtime) -> Layout:
    """The dp x tp x pp layout of this world, and the settings it rules out."""
    layout = resolve_layout(parallel, model, rt.world_size)
    if parallel.check_grads and layout.sharded_checkpoints:
        raise ConfigError(f"parallel.check_grads compares whole gradients across data-parallel replicas; with "
                          f"{layout.describe()} they are sharded: use it with data_parallel: ddp, tp 1, pp 1")
    check_mixed_precision(mixed_precision, rt.device)  # fp16 on a CPU would train silently without loss scaling
    check_4bit_training(model, parallel.data_parallel, rt.device)  # QLoRA: CUDA, DDP or one GPU, bitsandbytes
    check_compression(parallel, layout.describe(), layout.data_parallel, layout.tp, layout.pp)
    check_sync_batchnorm(parallel.sync_batchnorm, layout.data_parallel, rt.device, rt.world_size)
    return layout


def count_steps(train: TrainConfig, num_samples: int, plan: BatchPlan) -> int:
    """The run's last step: train.max_steps or train.epochs over the data, whichever comes first."""
    per_epoch = steps_per_epoch(num_samples, plan.global_batch)
    if per_epoch == 0:
        raise DataError(
            f"the corpus has {num_samples} training windows, fewer than one global batch of {plan.global_batch}; "
            "use more data, a smaller train.batch_size or a shorter model.max_seq_length"
        )
    steps = [train.max_steps] if train.max_steps else []
    if train.epochs:
        steps.append(math.ceil(train.epochs * per_epoch))
    return min(steps)


def measure_peak_flops_total(rt: Runtime, train: TrainConfig, flops_per_token: float | None,
                             cache_dir: str | None = None) -> float:
    """Every rank's peak FLOP/s summed (the MFU denominator); 0 when the workload reports no FLOPs per token.

    Measured once per machine and then read from `cache_dir` (data.cache_dir, default ~/.cache/lockstep).
    A measurement's random matrices come from a generator of its own: the training RNG is the same wherever
    it runs.
    """
    cache = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "lockstep"
    dtype = AMP_DTYPES.get(train.mixed_precision, torch.float32)
    peak = (train.peak_flops or load_peak_flops(rt.device, dtype, cache)) if flops_per_token else 0.0
    return float(all_reduce_sum(rt, [peak])[0])


def log_plan(s: Setup, cfg: Config, start_step: int, log: logging.Logger) -> None:
    """Rank 0, once: the batch plan with each number's source, the lr schedule, and the settings that surprise
    (lockstep.train.startup_notes); every rank: the workload and its steps."""
    from lockstep.train.startup_notes import describe_batch, describe_lr, startup_warnings

    if s.rt.is_main:
        log.info("%s", describe_batch(s.plan, s.layout, cfg.train, cfg.sources, s.rt.launcher))
        log.info("%s", describe_lr(cfg.optim, s.lr, s.plan.global_batch, s.total_steps, cfg.sources))
        for line in startup_warnings(cfg.train, cfg.optim, s.plan, s.total_steps, len(s.wl.train_ds), s.lr,
                                     cfg.set_keys, cfg.sources):
            log.warning("%s", line)
    log.info("%s; steps %d -> %d", s.wl.describe, start_step, s.total_steps)


def build_batches(s: Setup, cursor: Cursor, start_step: int, data: DataConfig,
                  train: TrainConfig) -> tuple[Iterator[Any], list]:
    """(this rank's training micro-batches from `cursor` on, its held-out index batches)."""
    wl = s.wl
    sampler = GlobalCursorSampler(len(wl.train_ds), s.plan, s.dp_rank, train.seed, cursor,
                                  max(0, s.total_steps - start_step), wl.lengths)
    workers, why = resolve_num_workers(data.num_workers, s.rt.local_world_size, available_cores())
    if s.rt.is_main:
        logging.getLogger("lockstep").info("data: %s", why)
    loader = build_loader(wl.train_ds, sampler, workers, data.prefetch_factor,
                          pin_memory=s.rt.device.type == "cuda", collate_fn=wl.collate)
    eval_batches = (eval_micro_batches(len(wl.eval_ds), s.plan.micro_batch, s.dp_rank, s.layout.dp,
                                       train.eval_batches)
                    if wl.eval_ds is not None else [])
    return iter(loader), eval_batches


def apply_checked_ddp(s: Setup, parallel: ParallelConfig, start_step: int, log: logging.Logger,
                      resumed_compression: dict | None = None) -> None:
    """Plain DDP (replicas, no sharding): run the DDP check, then wrap `s.model` with the options it chose and the
    gradient compression parallel.grad_compression names (its state from `resumed_compression`, grad_compression.pt).

    The check runs on the first steps' real micro-batches, read ahead from `s.batches` and put back in front:
    training then uses them, so nothing is read twice. The built-in GPT needs no check: its forward uses
    every parameter, so its choice is known. Other layouts keep `s.ddp_model`: the model with its loss.
    """
    if not s.rt.distributed or s.layout.sharded_checkpoints:
        if parallel.grad_compression != "none" and s.rt.is_main:
            log.info("grad compression: %s has nothing to do on one process (no all-reduce)", parallel.grad_compression)
        return
    if parallel.sync_batchnorm:
        converted = convert_sync_batchnorm(s.model)
        log.log(logging.INFO if converted else logging.WARNING,
                "parallel.sync_batchnorm: %d BatchNorm layer(s) now compute their statistics over the global "
                "batch (SyncBatchNorm)%s", converted, "" if converted else "; this model has none")
    grad_accum = s.plan.grad_accum
    check_steps = 0 if s.wl.uses_all_parameters else min(parallel.check_steps, s.total_steps - start_step)
    first = [next(s.batches) for _ in range(check_steps * grad_accum)]
    s.batches = itertools.chain(first, s.batches)
    report = None
    if first:
        steps = [[move_to_device(b, s.rt.device) for b in first[i:i + grad_accum]]
                 for i in range(0, len(first), grad_accum)]
        unused, opaque = find_unused_parameters(s.model, steps, s.wl.loss, s.autocast)
        report = gather_usage(s.rt, unused, sum(p.requires_grad for p in s.model.parameters()), opaque)
        log.info("DDP check: %s", report.format())
    choice = choose_ddp_options(report, parallel, grad_accum, s.wl.uses_all_parameters)
    log.info("DDP: find_unused_parameters=%s, static_graph=%s (%s)", choice.find_unused_parameters,
             choice.static_graph, choice.reason)
    if choice.hint:
        log.info("DDP: %s", choice.hint)
    s.ddp_model = apply_ddp(s.model, s.rt, s.wl.loss, choice.find_unused_parameters, choice.static_graph,
                            parallel.bucket_cap_mb, parallel.gradient_as_bucket_view,
                            broadcast_buffers=parallel.broadcast_buffers)
    s.compression = apply_compression(s.ddp_model, s.model, parallel, log if s.rt.is_main else None)
    if s.compression is not None and resumed_compression is not None:
        load_compression_state(s.compression, resumed_compression, s.rt, log)
    s.ddp_choice = choice
    s.guard = UsageGuard(s.rt, s.model, choice.static_graph, choice.reason, log) if choice.guarded else None


def load_compression_state(comp: Compression, saved: dict, rt: Runtime, log: logging.Logger) -> None:
    """A checkpoint's grad_compression.pt into this run's hook: PowerSGD's step count and Q matrices always, its error
    feedback (each rank's own) only at the world size that saved it."""
    if saved.get("kind") != comp.kind:
        if rt.is_main:
            log.info("grad compression: the checkpoint's %s state does not apply to %s; starting it afresh",
                     saved.get("kind"), comp.kind)
        return
    same_ranks = saved["world_size"] == rt.world_size
    if not same_ranks and rt.is_main:
        log.warning("grad compression: the checkpoint's PowerSGD error feedback is per rank, saved by %d ranks; with "
                    "%d it starts from zero (its Q matrices and step count carry over), so this resume is not exact",
                    saved["world_size"], rt.world_size)
    comp.load_state_dict({"iter": saved["iter"], "q": saved["q"],
                          "error": saved["errors"][rt.rank] if same_ranks else {}}, same_ranks)


def save_compression_state(s: Setup) -> dict | None:
    """Every rank together: the hook's state for grad_compression.pt, gathered on rank 0 (None elsewhere, and when the
    hook keeps none). Error feedback is per rank, Q and the step count the same on all; rank 0's are kept."""
    from lockstep.collectives import gather_to_main

    local = s.compression.state_dict() if s.compression is not None else None
    if local is None:
        return None
    every = gather_to_main(s.rt, local["error"])
    if every is None:
        return None
    return {"format": local["format"], "kind": s.compression.kind, "world_size": s.rt.world_size,
            "iter": local["iter"], "q": local["q"], "errors": every}


def after_reduce(s: Setup, step: int, check_grads: bool) -> None:
    """After the step's backward (its gradients all-reduced): fp16 compression's overflow watch, parallel.check_grads.
    With fp16 autocast on CUDA the GradScaler owns overflow: it skips a step whose gradients came back inf and lowers
    its scale, so the watch stays out of its way."""
    if s.compression is not None and s.scaler is None:
        s.compression.check_step(step, s.rt)
    if check_grads:
        compare_gradients(s.rt, s.model, step, s.ddp_choice)
        differ = differing_buffers(s.rt, s.model)
        if differ and differ != s.buffers_differ and s.rt.is_main:
            log = logging.getLogger("lockstep")
            log.warning("step %d: %s", step, explain_buffers(differ, syncs_buffers(s.ddp_model)))
        s.buffers_differ = differ


def compare_gradients(rt: Runtime, model: nn.Module, step: int, choice: DDPChoice | None) -> None:
    """parallel.check_grads, after each backward: the gradient hashes of all ranks agree, or the run stops
    naming the DDP options it ran with (the usual suspect when replicas drift apart). Buffers may differ
    (after_reduce says which and why): each rank updates them from its own micro-batches."""
    try:
        check_gradients_agree(rt, model, step)
    except GradientDivergence as e:
        if choice is None:
            raise
        raise GradientDivergence(f"{e}. DDP ran with find_unused_parameters={choice.find_unused_parameters}, "
                                 f"static_graph={choice.static_graph} ({choice.reason})") from None
