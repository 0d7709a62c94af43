"""What training runs on, built in a fixed order before the loop; lockstep.train.run calls these in it:

    build_layout_and_workload  the layout and its checks, the batch plan, the workload
    build_trainee              the model in its parallel form, optimizer, schedule (lockstep.train.trainee)
    Trainee.load_state         a checkpoint's weights, optimizer, RNG and data cursor (lockstep.train.state)
    log_plan                   the batch plan, the learning rate and the workload, once
    build_batches              this rank's micro-batches from the cursor on, and its held-out share
    Trainee.wrap_ddp           the DDP check on the first steps' micro-batches, then DDP and its hooks

Every rank runs all of them, in this order: several hold collectives (docs/architecture.md).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch
from torch import nn

from lockstep.collectives import all_reduce_sum
from lockstep.config import Config, ModelConfig, ParallelConfig, TrainConfig
from lockstep.data.batches import Batches, DataSource, Reading
from lockstep.data.sampler import Cursor, steps_per_epoch
from lockstep.errors import ConfigError, DataError
from lockstep.models.quantize import check_4bit_training
from lockstep.optim import build_optimizer, build_scheduler, scaled_learning_rate
from lockstep.parallel.apply import apply_parallelism
from lockstep.parallel.buffers import check_sync_batchnorm
from lockstep.parallel.compression import check_compression
from lockstep.parallel.mesh import BatchPlan, Layout, resolve_batch, resolve_layout
from lockstep.peak_flops import load_peak_flops
from lockstep.rng import seed_everything
from lockstep.runtime import Runtime, check_mixed_precision
from lockstep.runtime.cuda import describe_device
from lockstep.train.step import (
    AMP_DTYPES,
    build_autocast,
    build_grad_scaler,
    resolve_mixed_precision,
)
from lockstep.train.trainee import Trainee
from lockstep.train.workload import Workload, build_workload, unused_settings


def build_layout_and_workload(
    cfg: Config, rt: Runtime, log: logging.Logger
) -> tuple[Layout, BatchPlan, Workload]:
    """The layout of this world and its checks, the batch plan, and the workload (built from the seed)."""
    t = cfg.train
    t.mixed_precision, why = resolve_mixed_precision(t.mixed_precision, rt.device)  # 'auto' here
    layout = build_layout(cfg.parallel, cfg.model, t.mixed_precision, rt)
    plan = resolve_batch(t, layout.dp)
    log.info(
        "rank %d/%d on %s (pid %d), device %s, backend %s, launcher %s; layout %s; mixed precision "
        "%s (%s)",
        rt.rank,
        rt.world_size,
        rt.hostname,
        os.getpid(),
        describe_device(rt.device),
        rt.backend or "-",
        rt.launcher,
        layout.describe(),
        t.mixed_precision,
        why,
    )
    # identical initial weights on every rank (DDP also broadcasts rank 0's)
    seed_everything(t.seed)
    wl = build_workload(cfg, rt, Path(cfg.checkpoint.output_dir), log)
    if rt.is_main:
        for line in unused_settings(cfg):
            log.warning("%s", line)
        # resolve_layout: one replica shards nothing
        if cfg.parallel.data_parallel != layout.data_parallel:
            log.warning(
                "parallel.data_parallel = fsdp with %s: one data-parallel replica has nothing to "
                "shard, so this run trains the plain layout (checkpoints in safetensors)",
                layout.describe(),
            )
    return layout, plan, wl


def build_trainee(
    cfg: Config, rt: Runtime, wl: Workload, layout: Layout, plan: BatchPlan
) -> Trainee:
    """The workload's model on the device in its parallel form (FSDP / TP / this pipeline stage), compiled
    if train.compile, with its optimizer and the schedule to the run's last step."""
    t = cfg.train
    flops_per_token = wl.flops_per_token  # before a pipeline cuts the model to one stage
    # train mode whatever mode the builder left: transformers' from_pretrained leaves eval, where
    # its layers skip activation checkpointing and dropout (LoRA's too)
    model = wl.model.to(rt.device).train()
    total_steps = count_steps(t, len(wl.train_ds), plan)
    autocast = build_autocast(t.mixed_precision, rt.device)
    pipeline = apply_parallelism(
        model,
        layout,
        rt,
        cfg.parallel,
        mixed_precision=t.mixed_precision,
        autocast=autocast,
        grad_accum=plan.grad_accum,
        uses_all_parameters=wl.uses_all_parameters,
    )
    if t.compile:
        apply_compile(model, layout)
    lr = scaled_learning_rate(cfg.optim, plan.global_batch)
    optimizer = build_optimizer(model, cfg.optim, lr, rt.device.type)
    return Trainee(
        workload=wl,
        model=model,
        layout=layout,
        plan=plan,
        rt=rt,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.optim, total_steps),
        autocast=autocast,
        scaler=build_grad_scaler(t.mixed_precision, rt.device),
        pipeline=pipeline,
        clip_norm=cfg.optim.gradient_clip_norm,
        check_grads=cfg.parallel.check_grads,
        lr=lr,
        total_steps=total_steps,
        flops_per_token=flops_per_token,
        peak_flops=measure_peak_flops_total(rt, t, flops_per_token, cfg.data.cache_dir),
    )


def apply_compile(model: nn.Module, layout: Layout) -> None:
    """train.compile: torch.compile the model in place, after FSDP / TP and before DDP wraps it (DDP's own
    optimizer then splits the graph at its buckets). In place, the parameters and state_dict keys stay the
    module's own: checkpoints of compiled and plain runs are interchangeable."""
    if layout.pp > 1:
        raise ConfigError(
            f"train.compile with {layout.describe()}: lockstep does not compile pipeline stages; "
            "drop --compile, or use parallel.pipeline_parallel=1"
        )
    model.compile()


def build_layout(
    parallel: ParallelConfig, model: ModelConfig, mixed_precision: str, rt: Runtime
) -> Layout:
    """The dp x tp x pp layout of this world, and the settings it rules out."""
    layout = resolve_layout(parallel, model, rt.world_size)
    if parallel.check_grads and layout.sharded_checkpoints:
        raise ConfigError(
            f"parallel.check_grads compares whole gradients across data-parallel replicas; with "
            f"{layout.describe()} they are sharded: use it with data_parallel: ddp, tp 1, pp 1"
        )
    # fp16 on a CPU would train silently without loss scaling
    check_mixed_precision(mixed_precision, rt.device)
    # QLoRA: CUDA, DDP or one GPU, bitsandbytes
    check_4bit_training(model, parallel.data_parallel, rt.device)
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


def measure_peak_flops_total(
    rt: Runtime, train: TrainConfig, flops_per_token: float | None, cache_dir: str | None = None
) -> float:
    """Every rank's peak FLOP/s summed (the MFU denominator); 0 when the workload reports no FLOPs per token.

    Measured once per machine and then read from `cache_dir` (data.cache_dir, default ~/.cache/lockstep).
    A measurement's random matrices come from a generator of its own: the training RNG is the same wherever
    it runs.
    """
    cache = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "lockstep"
    dtype = AMP_DTYPES.get(train.mixed_precision, torch.float32)
    peak = (
        (train.peak_flops or load_peak_flops(rt.device, dtype, cache)) if flops_per_token else 0.0
    )
    return float(all_reduce_sum(rt, [peak])[0])


def log_plan(cfg: Config, trainee: Trainee, start_step: int, log: logging.Logger) -> None:
    """Rank 0, once: the batch plan with each number's source, the lr schedule, and the settings that
    surprise (lockstep.train.startup_notes); every rank: the workload and its steps."""
    from lockstep.train.startup_notes import describe_batch, describe_lr, startup_warnings

    rt, plan, last, wl = trainee.rt, trainee.plan, trainee.total_steps, trainee.workload
    if rt.is_main:
        log.info("%s", describe_batch(plan, trainee.layout, cfg.train, cfg.sources, rt.launcher))
        log.info("%s", describe_lr(cfg.optim, trainee.lr, plan.global_batch, last, cfg.sources))
        warnings = startup_warnings(
            cfg.train,
            cfg.optim,
            plan,
            last,
            num_samples=len(wl.train_ds),
            lr=trainee.lr,
            set_keys=cfg.set_keys,
            sources=cfg.sources,
        )
        for line in warnings:
            log.warning("%s", line)
    log.info("%s; steps %d -> %d", wl.describe, start_step, last)
    if start_step >= last:
        log.info(
            "checkpoint is at step %d, the run's last step is %d: nothing left to train",
            start_step,
            last,
        )
    if trainee.check_grads:
        log.info("parallel.check_grads: gradient hashes are compared across ranks after every step")


def build_batches(cfg: Config, trainee: Trainee, start: Cursor, start_step: int) -> Batches:
    """This rank's micro-batches from `start` (the cursor at `start_step`) to the run's last step, and its
    share of the held-out set."""
    rt, wl = trainee.rt, trainee.workload
    source = DataSource(
        train=wl.train_ds,
        collate=wl.collate,
        eval=wl.eval_ds,
        lengths=wl.lengths,
        count_tokens=wl.count_tokens,
    )
    reading = Reading(
        plan=trainee.plan,
        dp_rank=trainee.dp_rank,
        dp=trainee.layout.dp,
        seed=cfg.train.seed,
        start=start,
        start_step=start_step,
        last_step=trainee.total_steps,
        num_workers=cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor,
        pin_memory=rt.device.type == "cuda",
        local_world_size=rt.local_world_size,
        eval_batches=cfg.train.eval_batches,
    )
    batches = Batches(source, reading)
    if rt.is_main:
        log = logging.getLogger("lockstep")
        log.info("data: %s", batches.workers_note)
    return batches
