"""The training run: runtime -> workload (model + data) -> optimizer -> resume -> DDP check -> DDP -> loop.

`run_training(cfg)` is what `lockstep train` calls on every rank. Rank roles
(DESIGN.md): every rank computes and writes its own log; global rank 0 alone
writes checkpoints, metrics, the plot and draws the progress bar; metrics are
all-reduced means.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lockstep.errors import CheckpointError
from lockstep.collectives import all_reduce_max, all_reduce_sum
from lockstep.parallel.mesh import BatchPlan, resolve_batch
from lockstep.config import Config, config_to_dict
from lockstep.errors import ConfigError
from lockstep.train.workload import unused_settings
from lockstep.data.sampler import (Cursor, GlobalCursorSampler, build_loader, cursor_after, eval_micro_batches,
                                   steps_per_epoch)
from lockstep.errors import DataError
from lockstep.train.step import (
    AMP_DTYPES, StopRequest, build_autocast, build_grad_scaler, evaluate, pipeline_step, train_step,
)
from lockstep.metrics import (MetricsWriter, init_rank_logging, measure_peak_flops, mfu, model_state_mb, peak_memory_mb,
                              plot_loss)
from lockstep.data.batch import move_to_device
from lockstep.optim import build_optimizer, build_scheduler, scaled_learning_rate
from lockstep.parallel.apply import apply_parallelism
from lockstep.parallel.ddp import UsageGuard, apply_ddp, loss_through
from lockstep.parallel.ddp_check import (
    DDPChoice, check_gradients_agree, choose_ddp_options, find_unused_parameters, gather_usage,
)
from lockstep.errors import GradientDivergence
from lockstep.parallel.mesh import resolve_layout
from lockstep.train.recorders import SampleRecorder, StepProfiler
from lockstep.rng import seed_everything
from lockstep.train.state import pick_resume_point, restore_plain, restore_sharded, save_plain, save_sharded
from lockstep.runtime import Runtime, check_mixed_precision, init_runtime, shutdown_runtime
from lockstep.watchdog import Watchdog
from lockstep.train.workload import build_workload


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # optimizer steps completed
    checkpoint: Path | None  # the last committed checkpoint
    train_loss: float | None = None
    eval_loss: float | None = None
    stop_signal: int | None = None  # SIGTERM / SIGINT that stopped the run early
    sample: str | None = None


def run_training(cfg: Config) -> TrainResult:
    """Train on this process's share of the job; every rank of the job calls this."""
    rt = init_runtime(cfg.distributed)
    run_dir = Path(cfg.checkpoint.output_dir)
    log = init_rank_logging(run_dir, rt.rank, rt.is_main)
    try:
        with StopRequest() as stop:
            result, wl = _train(cfg, rt, log, stop)
    except (ConfigError, DataError, CheckpointError, GradientDivergence) as e:  # the user's to fix: message = report
        log.error("rank %d (%s): %s", rt.rank, rt.hostname, e)
        e.logged = True  # type: ignore[attr-defined]  # the CLI need not print it again
        raise
    except BaseException:
        log.exception("training stopped with an error on rank %d (%s)", rt.rank, rt.hostname)
        raise
    finally:
        shutdown_runtime(rt)
    if rt.is_main:
        png = plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
        if png:
            log.info("loss curve: %s", png)
        # after the group is gone: slow or failing final writes cannot hold the other ranks
        if result.stop_signal is None and result.checkpoint is not None:
            _final_outputs(cfg, wl, result, run_dir, log)
    return result


def _final_outputs(cfg: Config, wl, result: TrainResult, run_dir: Path, log: logging.Logger) -> None:
    """Rank 0, after the group is gone: the from_pretrained directory (hf) and a sample (gpt).

    A sharded model's parameters are DTensors of a process group that no longer exists: the
    full weights come from the checkpoint just committed instead (the same weights, gathered).
    """
    sharded = wl.model is None
    if wl.finalize is not None:
        if sharded:
            from lockstep.tools.export import export_checkpoint

            out = export_checkpoint(result.checkpoint, run_dir / "final")
        else:
            out = wl.finalize(wl.model.cpu(), run_dir / "final")
        log.info("trained model written for from_pretrained: %s", out)
    if cfg.model.kind == "gpt" and cfg.train.sample_tokens:
        from lockstep.tools.sample import generate_text, load_model_from_checkpoint

        model = load_model_from_checkpoint(result.checkpoint)[0] if sharded else wl.model.cpu()
        result.sample = generate_text(model, wl.tokenizer, "def ", cfg.train.sample_tokens, seed=cfg.train.seed)
        log.info("sample from the trained model:\n%s", result.sample)


def _is_sharded(path: Path) -> bool:
    from lockstep.checkpoint.sharded import is_sharded

    return is_sharded(path)


def _total_steps(cfg: Config, num_windows: int, plan: BatchPlan) -> int:
    per_epoch = steps_per_epoch(num_windows, plan.global_batch)
    if per_epoch == 0:
        raise DataError(
            f"the corpus has {num_windows} training windows, fewer than one global batch of {plan.global_batch}; "
            "use more data, a smaller train.batch_size or a shorter model.max_seq_length"
        )
    steps = [cfg.train.max_steps] if cfg.train.max_steps else []
    if cfg.train.epochs:
        steps.append(math.ceil(cfg.train.epochs * per_epoch))
    return min(steps)


def _apply_checked_ddp(cfg: Config, rt: Runtime, model: torch.nn.Module, wl, first: list, grad_accum: int,
                       autocast, log: logging.Logger) -> tuple[torch.nn.Module, DDPChoice, UsageGuard | None]:
    """The DDP check on the first steps' micro-batches (`first`, grad_accum per step), the choice, DDP applied,
    and the guard when DDP was told more than lockstep knows."""
    report = None
    if first:
        steps = [[move_to_device(b, rt.device) for b in first[i:i + grad_accum]]
                 for i in range(0, len(first), grad_accum)]
        unused, opaque = find_unused_parameters(model, steps, wl.forward_loss, autocast)
        report = gather_usage(rt, unused, sum(p.requires_grad for p in model.parameters()), opaque)
        log.info("DDP check: %s", report.format())
    choice = choose_ddp_options(report, cfg.parallel, grad_accum, wl.uses_all_parameters)
    log.info("DDP: find_unused_parameters=%s, static_graph=%s (%s)", choice.find_unused_parameters,
             choice.static_graph, choice.reason)
    if choice.hint:
        log.info("DDP: %s", choice.hint)
    ddp_model = apply_ddp(model, rt, wl.forward_loss, choice.find_unused_parameters, choice.static_graph)
    guard = UsageGuard(rt, model, choice.static_graph, choice.reason, log) if choice.guarded else None
    return ddp_model, choice, guard


def _train(cfg: Config, rt: Runtime, log: logging.Logger, stop: StopRequest):
    t, run_dir = cfg.train, Path(cfg.checkpoint.output_dir)
    layout = resolve_layout(cfg.parallel, cfg.model, rt.world_size)
    if cfg.parallel.check_grads and layout.sharded_checkpoints:
        raise ConfigError(f"parallel.check_grads compares whole gradients across data-parallel replicas; with "
                          f"{layout.describe()} they are sharded: use it with data_parallel: ddp, tp 1, pp 1")
    check_mixed_precision(t.mixed_precision, rt.device)  # fp16 on a CPU would train silently without loss scaling
    _, dp_rank, _ = layout.coords(rt.rank)  # the data is split by data-parallel rank: tp / pp peers read the same
    plan = resolve_batch(t, layout.dp)
    log.info("rank %d/%d on %s (pid %d), device %s, backend %s, launcher %s; layout %s", rt.rank, rt.world_size,
             rt.hostname, os.getpid(), rt.device, rt.backend or "-", rt.launcher, layout.describe())

    seed_everything(t.seed)  # identical initial weights on every rank (DDP also broadcasts rank 0's)
    wl = build_workload(cfg, rt, run_dir, log)
    if rt.is_main:
        for line in unused_settings(cfg):
            log.warning("%s", line)
    flops_per_token = wl.flops_per_token  # of the whole model, before a pipeline cuts it to one stage
    model = wl.model.to(rt.device)
    total_steps = _total_steps(cfg, len(wl.train_ds), plan)
    autocast = build_autocast(t.mixed_precision, rt.device)
    scaler = build_grad_scaler(t.mixed_precision, rt.device)
    pipeline = apply_parallelism(model, layout, rt, cfg.parallel, t.mixed_precision, autocast, plan.grad_accum,
                                 wl.uses_all_parameters)
    lr = scaled_learning_rate(cfg.optim, plan.global_batch)
    optimizer = build_optimizer(model, cfg.optim, lr, rt.device.type)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)

    ckpt_path = pick_resume_point(cfg, rt, run_dir, log)
    if ckpt_path is None:
        start_step, cursor = 0, Cursor()
        seed_everything(t.seed + dp_rank)  # per-replica streams (dropout) from here on; tp peers share theirs
    elif layout.sharded_checkpoints or _is_sharded(ckpt_path):
        start_step, cursor = restore_sharded(ckpt_path, model, optimizer, scheduler, rt, t.seed, dp_rank, plan,
                                             pipeline is not None, log)
    else:
        start_step, cursor = restore_plain(ckpt_path, wl, optimizer, scheduler, scaler, rt, t.seed, dp_rank, plan,
                                           log)

    peak = (t.peak_flops or measure_peak_flops(rt.device, AMP_DTYPES.get(t.mixed_precision, torch.float32))
            if flops_per_token else 0.0)
    peak_total = float(all_reduce_sum(rt, [peak])[0])
    log.info("global batch %d = %s %d x micro_batch %d x grad_accum %d; lr %.3g", plan.global_batch,
             "world_size" if layout.dp == rt.world_size else "data_parallel", plan.world_size, plan.micro_batch,
             plan.grad_accum, lr)
    log.info("%s; steps %d -> %d", wl.describe, start_step, total_steps)

    sampler = GlobalCursorSampler(len(wl.train_ds), plan, dp_rank, t.seed, cursor, max(0, total_steps - start_step),
                                  wl.lengths)
    loader = build_loader(wl.train_ds, sampler, cfg.data.num_workers, cfg.data.prefetch_factor,
                          pin_memory=rt.device.type == "cuda", collate_fn=wl.collate)
    eval_batches = (eval_micro_batches(len(wl.eval_ds), plan.micro_batch, dp_rank, layout.dp, t.eval_batches)
                    if wl.eval_ds is not None else [])
    batches = iter(loader)

    # the DDP check runs on the first steps' real micro-batches, which training then uses: no extra reads.
    # The built-in GPT needs none: its forward uses every parameter, so its choice is known.
    plain_ddp = rt.distributed and not layout.sharded_checkpoints
    checked = plain_ddp and not wl.uses_all_parameters
    check_steps = min(cfg.parallel.check_steps, total_steps - start_step) if checked else 0
    first = [next(batches) for _ in range(check_steps * plan.grad_accum)]
    batches = itertools.chain(first, batches)
    choice, guard = None, None
    if plain_ddp:
        ddp_model, choice, guard = _apply_checked_ddp(cfg, rt, model, wl, first, plan.grad_accum, autocast, log)
        forward_loss = loss_through  # the DDP-wrapped module's forward is the loss
    else:
        ddp_model, forward_loss = model, wl.forward_loss  # FSDP / TP reduce inside the model's own hooks and DTensors
    eval_loss = wl.forward_loss if pipeline is None else (lambda _, batch: pipeline.evaluate(*batch))

    def run_eval() -> float:
        return evaluate(model, (wl.collate([wl.eval_ds[i] for i in b]) for b in eval_batches), rt, autocast, eval_loss)

    fixed_tokens = plan.global_batch * cfg.model.max_seq_length if cfg.model.kind == "gpt" else None

    def save(step: int) -> Path:
        state = {"step": step, "cursor": cursor_after(len(wl.train_ds), t.seed, cursor, plan.global_batch,
                                                       step - start_step).to_dict(),
                 "scheduler": scheduler.state_dict(), "config": config_to_dict(cfg), "world_size": rt.world_size,
                 "global_batch": plan.global_batch, "tokens_seen": step * fixed_tokens if fixed_tokens else None,
                 "grad_scaler": scaler.state_dict() if scaler else None}
        state["layout"] = layout.describe()
        if layout.sharded_checkpoints:
            return save_sharded(rt, run_dir, step, model, optimizer, state, wl.extra_files, cfg.checkpoint.keep_last,
                                log)
        return save_plain(rt, run_dir, step, wl.checkpoint_tensors(), optimizer, state, wl.extra_files,
                          cfg.checkpoint.keep_last, log)

    metrics = MetricsWriter(run_dir, rt.is_main, total_steps, start_step)
    result = TrainResult(run_dir, start_step, ckpt_path)
    profiler = StepProfiler(t.profile_steps, run_dir / "profile", rt, log)
    recorder = (SampleRecorder(run_dir, rt.rank, len(wl.train_ds), t.seed, cursor, plan, wl.lengths, dp_rank)
                if t.record_samples else None)
    def compare_gradients() -> None:
        try:
            check_gradients_agree(rt, model, step + 1)
        except GradientDivergence as e:
            if choice is None:
                raise
            raise GradientDivergence(f"{e}. DDP ran with find_unused_parameters={choice.find_unused_parameters}, "
                                     f"static_graph={choice.static_graph} ({choice.reason})") from None

    check_grads = compare_gradients if cfg.parallel.check_grads else None
    if check_grads:
        log.info("parallel.check_grads: gradient hashes are compared across ranks after every step")
    # loss and grad norm stay on the device between logs: reading them every step would sync a GPU each step
    window_loss, window_norm = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
    window_steps, window_tokens, window_start = 0, 0, time.perf_counter()

    def micro_batches():
        nonlocal window_tokens
        for _ in range(plan.grad_accum):
            batch = next(batches)
            if wl.count_tokens:
                window_tokens += wl.count_tokens(batch)  # on the CPU copy: no device sync
            yield batch

    step = start_step
    if start_step >= total_steps:
        log.info("checkpoint is at step %d, the run's last step is %d: nothing left to train", start_step, total_steps)
    # hang_seconds = 0 turns the watchdog off: beats then only set a field, and no thread runs
    watchdog = Watchdog(rt, run_dir, cfg.distributed.hang_seconds or math.inf, log=log)
    if cfg.distributed.hang_seconds:
        watchdog.start()
    try:
        while step < total_steps:
            watchdog.beat(step + 1, "train")  # forward, backward with its all-reduce, optimizer
            profiler.before_step(step)
            lr_now = scheduler.get_last_lr()[0]
            if pipeline is not None:
                loss, grad_norm = pipeline_step(pipeline, optimizer, micro_batches(), rt.device,
                                                cfg.optim.gradient_clip_norm)
            else:
                loss, grad_norm = train_step(ddp_model, model, optimizer, micro_batches(), plan.grad_accum, rt.device,
                                             autocast, cfg.optim.gradient_clip_norm, forward_loss, scaler, check_grads,
                                             functools.partial(guard, step=step + 1) if guard else None)
            scheduler.step()
            step += 1
            window_loss += loss.detach().float()
            window_norm += grad_norm.detach().float()
            window_steps += 1
            profiler.after_step(step)
            if recorder:
                recorder.record(step)
            watchdog.beat(step, "metrics")
            stopping = stop.agreed(rt)
            if step % t.log_interval == 0 or step == total_steps or stopping:
                loss_sum, norm_sum, tokens = all_reduce_sum(rt, [float(window_loss), float(window_norm),
                                                                 window_tokens]).tolist()
                elapsed = time.perf_counter() - window_start
                epoch = cursor_after(len(wl.train_ds), t.seed, cursor, plan.global_batch, step - start_step).epoch
                values = {"loss": loss_sum / (rt.world_size * window_steps), "lr": lr_now,
                          "grad_norm": norm_sum / (rt.world_size * window_steps),
                          "samples_per_s": window_steps * plan.global_batch / elapsed, "epoch": epoch}
                if wl.count_tokens:  # tp and pp peers read the same tokens: count each sample once
                    values["tokens_per_s"] = tokens / (layout.tp * layout.pp) / elapsed
                    if flops_per_token:
                        values["mfu"] = mfu(values["tokens_per_s"], flops_per_token, peak_total)
                values["peak_mem_mb"] = all_reduce_max(rt, peak_memory_mb(rt.device))  # the fullest rank
                values["state_mb"] = all_reduce_max(rt, model_state_mb(model, optimizer))
                metrics.log(step, values)
                result.train_loss = values["loss"]
                window_loss.zero_(), window_norm.zero_()
                window_steps, window_tokens, window_start = 0, 0, time.perf_counter()
            if eval_batches and ((t.eval_interval and step % t.eval_interval == 0) or step == total_steps):
                watchdog.beat(step, "eval")
                result.eval_loss = run_eval()
                metrics.log(step, {"loss": result.eval_loss, "perplexity": math.exp(min(result.eval_loss, 50))}, "eval")
            save_every = cfg.checkpoint.save_interval
            if stopping or step == total_steps or (save_every and step % save_every == 0):
                watchdog.beat(step, "checkpoint")
                result.checkpoint = save(step)
            metrics.advance(step)
            if stopping:
                log.warning("stop requested (signal %d%s): checkpoint committed at step %d, exiting", stopping,
                            "" if stop.signum else ", received by another rank", step)
                result.stop_signal = stopping
                break
    finally:
        watchdog.stop()  # before the process group goes
    if check_grads and step > start_step:
        log.info("parallel.check_grads: gradients were identical on all %d ranks after each of %d steps",
                 rt.world_size, step - start_step)
    result.step = step
    metrics.close()
    if layout.sharded_checkpoints:
        wl.model = None  # sharded: the final outputs are built from the last checkpoint (see _final_outputs)
    return result, wl
