"""The training run: runtime -> data -> model -> DDP -> optimizer -> resume -> loop -> checkpoint.

`run_training(cfg)` is what `lockstep train` calls on every rank. Rank roles
(DESIGN.md): every rank computes and writes its own log; global rank 0 alone
writes checkpoints, metrics, the plot and draws the progress bar; metrics are
all-reduced means.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lockstep.checkpoint import CheckpointError, check_shapes, load_checkpoint, resolve_resume, save_checkpoint
from lockstep.collectives import all_reduce_sum, broadcast_object, failed_ranks, gather_objects
from lockstep.config import BatchPlan, Config, ConfigError, config_to_dict, parse_profile_steps, resolve_batch
from lockstep.data.sampler import (Cursor, GlobalCursorSampler, build_loader, cursor_after, eval_micro_batches,
                                   rank_micro_batches, step_indices, steps_per_epoch)
from lockstep.data.text import DataError, TokenCache, TokenWindows, load_token_cache, prepare_tokens
from lockstep.data.tokenizer import tokenizer_from_json
from lockstep.loop import StopRequest, build_autocast, build_grad_scaler, evaluate, train_step
from lockstep.metrics import MetricsWriter, init_rank_logging, measure_peak_flops, mfu, plot_loss
from lockstep.models.gpt import GPT, build_gpt
from lockstep.optim import build_optimizer, build_scheduler, scaled_learning_rate
from lockstep.parallel.ddp import apply_ddp
from lockstep.rng import capture_rng_state, restore_rng_state, seed_everything
from lockstep.runtime import Runtime, init_runtime, shutdown_runtime
from lockstep.sample import generate_text
from lockstep.watchdog import Watchdog


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
            result, model, tokenizer = _train(cfg, rt, log, stop)
    except (ConfigError, DataError, CheckpointError) as e:  # the user's to fix: the message is the report
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
        if cfg.train.sample_tokens and result.stop_signal is None:
            # after the group is gone: a slow or failing sample cannot hold the other ranks
            result.sample = generate_text(model, tokenizer, "def ", cfg.train.sample_tokens, seed=cfg.train.seed)
            log.info("sample from the trained model:\n%s", result.sample)
    return result


def _prepare_data(cfg: Config, rt: Runtime, seq_len: int) -> TokenCache:
    """The corpus is tokenized once per node (local rank 0); the others open the cached file."""
    cache, error = None, None
    if rt.local_rank == 0:
        try:
            cache = prepare_tokens(cfg.data, seq_len=seq_len)
        except Exception as e:  # reported on every rank below instead of leaving them waiting
            error = e
    bad = failed_ranks(rt, error is None)
    if error is not None:
        raise error
    if bad:
        raise DataError(f"preparing the corpus failed on rank(s) {bad}; their log files say why")
    return cache if cache is not None else load_token_cache(cfg.data, seq_len=seq_len)


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


def _resume_point(cfg: Config, rt: Runtime, run_dir: Path, log: logging.Logger) -> Path | None:
    """Global rank 0 picks the checkpoint (falling back past damaged ones); every rank loads the same one."""
    choice: tuple[str | None, str | None] = (None, None)
    if rt.is_main:
        try:
            path = resolve_resume(run_dir, cfg.checkpoint.resume, log=log.warning)
            choice = (str(path) if path else None, None)
        except CheckpointError as e:
            choice = (None, str(e))
    path, error = broadcast_object(rt, choice)
    if error:
        raise CheckpointError(error)
    return Path(path) if path else None


def _restore(path: Path, model: GPT, optimizer: torch.optim.Optimizer, scheduler, scaler, rt: Runtime, seed: int,
             plan: BatchPlan, log: logging.Logger) -> tuple[int, Cursor]:
    """Load weights, optimizer, schedule, loss scale and this rank's RNG; return the step and cursor to go on from."""
    ckpt = load_checkpoint(path)
    check_shapes(ckpt.tensors, model.state_dict(), path)
    model.load_state_dict(ckpt.tensors)
    optimizer.load_state_dict(ckpt.optimizer_state)
    scheduler.load_state_dict(ckpt.state["scheduler"])
    if scaler is not None and ckpt.state.get("grad_scaler"):
        scaler.load_state_dict(ckpt.state["grad_scaler"])
    step, cursor = ckpt.state["step"], Cursor.from_dict(ckpt.state["cursor"])
    saved_world = ckpt.state.get("world_size")
    if ckpt.rng_states and saved_world == rt.world_size:
        restore_rng_state(ckpt.rng_states[rt.rank])
    else:  # a new world size has new ranks: seed them reproducibly from the step
        seed_everything(seed + 1_000_003 * step + rt.rank)
    if ckpt.state.get("global_batch") not in (None, plan.global_batch):
        log.warning("checkpoint was trained with global batch %s, now %d: the sample order from here differs",
                    ckpt.state.get("global_batch"), plan.global_batch)
    log.info("resumed from %s at step %d (epoch %d, sample %d of the epoch; saved on %s rank(s), now %d)",
             path, step, cursor.epoch, cursor.offset, saved_world, rt.world_size)
    return step, cursor


def _train(cfg: Config, rt: Runtime, log: logging.Logger, stop: StopRequest):
    t, run_dir = cfg.train, Path(cfg.checkpoint.output_dir)
    plan = resolve_batch(t, rt.world_size)
    log.info("rank %d/%d on %s (pid %d), device %s, backend %s, launcher %s", rt.rank, rt.world_size, rt.hostname,
             os.getpid(), rt.device, rt.backend or "-", rt.launcher)

    seq = cfg.model.max_seq_length
    cache = _prepare_data(cfg, rt, seq)
    tokenizer = tokenizer_from_json(cache.tokenizer_json)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        log.info("model.vocab_size raised from %d to the tokenizer's %d", cfg.model.vocab_size, tokenizer.vocab_size)
        cfg.model.vocab_size = tokenizer.vocab_size
    train_ds = TokenWindows(cache, seq, "train", cfg.data.eval_fraction)
    eval_ds = TokenWindows(cache, seq, "eval", cfg.data.eval_fraction)
    total_steps = _total_steps(cfg, len(train_ds), plan)

    seed_everything(t.seed)  # identical initial weights on every rank (DDP also broadcasts rank 0's)
    model: GPT = build_gpt(cfg.model).to(rt.device)
    lr = scaled_learning_rate(cfg.optim, plan.global_batch)
    optimizer = build_optimizer(model, cfg.optim, lr, rt.device.type)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)

    autocast = build_autocast(t.mixed_precision, rt.device)
    scaler = build_grad_scaler(t.mixed_precision, rt.device)
    ckpt_path = _resume_point(cfg, rt, run_dir, log)
    if ckpt_path is not None:
        start_step, cursor = _restore(ckpt_path, model, optimizer, scheduler, scaler, rt, t.seed, plan, log)
    else:
        start_step, cursor = 0, Cursor()
        seed_everything(t.seed + rt.rank)  # per-rank streams (dropout) from here on

    ddp_model = apply_ddp(model, rt)
    flops_per_token = model.flops_per_token()
    peak = t.peak_flops or measure_peak_flops(rt.device, torch.bfloat16 if t.mixed_precision == "bf16" else
                                              torch.float16 if t.mixed_precision == "fp16" else torch.float32)
    peak_total = float(all_reduce_sum(rt, [peak])[0])
    tokens_per_step = plan.global_batch * seq
    log.info("global batch %d = world_size %d x micro_batch %d x grad_accum %d (%d tokens/step); lr %.3g",
             plan.global_batch, plan.world_size, plan.micro_batch, plan.grad_accum, tokens_per_step, lr)
    log.info("model %.2fM params, %.3g FLOPs/token; data %d tokens: %d train / %d eval windows of %d; "
             "steps %d -> %d; MFU peak %.3g FLOP/s in all (%s)", model.num_params() / 1e6, flops_per_token,
             cache.num_tokens, len(train_ds), len(eval_ds), seq, start_step, total_steps, peak_total,
             "set" if t.peak_flops else "measured")

    sampler = GlobalCursorSampler(len(train_ds), plan, rt.rank, t.seed, cursor, max(0, total_steps - start_step))
    loader = build_loader(train_ds, sampler, cfg.data.num_workers, cfg.data.prefetch_factor,
                          pin_memory=rt.device.type == "cuda")
    eval_batches = eval_micro_batches(len(eval_ds), plan.micro_batch, rt.rank, rt.world_size, t.eval_batches)

    def run_eval() -> float:
        batches = ((torch.stack([eval_ds[i][0] for i in b]), torch.stack([eval_ds[i][1] for i in b]))
                   for b in eval_batches)
        return evaluate(model, batches, rt, autocast)

    def save(step: int) -> Path:
        state = {"step": step, "cursor": cursor_after(len(train_ds), t.seed, cursor, plan.global_batch,
                                                       step - start_step).to_dict(),
                 "scheduler": scheduler.state_dict(), "config": config_to_dict(cfg), "world_size": rt.world_size,
                 "global_batch": plan.global_batch, "tokens_seen": step * tokens_per_step,
                 "grad_scaler": scaler.state_dict() if scaler else None}
        return _save_checkpoint(rt, run_dir, step, model, optimizer, state, cache, cfg.checkpoint.keep_last, log)

    metrics = MetricsWriter(run_dir, rt.is_main, total_steps, start_step)
    result = TrainResult(run_dir, start_step, ckpt_path)
    profiler = StepProfiler(t.profile_steps, run_dir / "profile", rt, log)
    recorder = SampleRecorder(run_dir, rt.rank, len(train_ds), t.seed, cursor, plan) if t.record_samples else None
    batches = iter(loader)
    # loss and grad norm stay on the device between logs: reading them every step would sync a GPU each step
    window_loss, window_norm = torch.zeros((), device=rt.device), torch.zeros((), device=rt.device)
    window_steps, window_start = 0, time.perf_counter()
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
            loss, grad_norm = train_step(ddp_model, model, optimizer, (next(batches) for _ in range(plan.grad_accum)),
                                         plan.grad_accum, rt.device, autocast, cfg.optim.gradient_clip_norm, scaler)
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
                loss_mean, norm_mean = (all_reduce_sum(rt, [float(window_loss), float(window_norm)])
                                        / (rt.world_size * window_steps)).tolist()
                tok_s = window_steps * tokens_per_step / (time.perf_counter() - window_start)
                epoch = cursor_after(len(train_ds), t.seed, cursor, plan.global_batch, step - start_step).epoch
                values = {"loss": loss_mean, "lr": lr_now, "grad_norm": norm_mean, "tokens_per_s": tok_s,
                          "mfu": mfu(tok_s, flops_per_token, peak_total), "epoch": epoch}
                metrics.log(step, values)
                result.train_loss = loss_mean
                window_loss.zero_(), window_norm.zero_()
                window_steps, window_start = 0, time.perf_counter()
            if (t.eval_interval and step % t.eval_interval == 0) or step == total_steps:
                watchdog.beat(step, "eval")
                result.eval_loss = run_eval()
                metrics.log(step, {"loss": result.eval_loss, "perplexity": math.exp(min(result.eval_loss, 50))}, "eval")
            if stopping or step == total_steps or (cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0):
                watchdog.beat(step, "checkpoint")
                result.checkpoint = save(step)
            metrics.advance(step)
            if stopping:
                log.warning("stop requested (signal %s): checkpoint committed at step %d, exiting", stop.signum, step)
                result.stop_signal = stop.signum
                break
    finally:
        watchdog.stop()  # before the process group goes
    result.step = step
    metrics.close()
    return result, model.cpu(), tokenizer


class SampleRecorder:
    """`train.record_samples`: this rank's micro-batch indices of every step, to RUN/samples/rank{r}.jsonl.

    Recomputed from the cursor (not taken from the loader), which is what resume relies on too;
    tests compare these files across world sizes.
    """

    def __init__(self, run_dir: Path, rank: int, num_samples: int, seed: int, cursor: Cursor, plan: BatchPlan):
        self.path = run_dir / "samples" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.num_samples, self.seed, self.cursor, self.plan = rank, num_samples, seed, cursor, plan

    def record(self, step: int) -> None:
        indices, self.cursor = step_indices(self.num_samples, self.seed, self.cursor, self.plan.global_batch)
        mine = [m.tolist() for m in rank_micro_batches(indices, self.plan, self.rank)]
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "rank": self.rank, "micro_batches": mine}) + "\n")


class StepProfiler:
    """`train.profile_steps = "A:B"`: a torch.profiler trace of steps A..B-1, one file per rank."""

    def __init__(self, spec: str | None, out_dir: Path, rt: Runtime, log: logging.Logger):
        self.window = parse_profile_steps(spec) if spec else None
        self.out_dir, self.rank, self.log = out_dir, rt.rank, log
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if rt.device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler: torch.profiler.profile | None = None

    def before_step(self, step: int) -> None:
        if self.window and step == self.window[0]:
            self.profiler = torch.profiler.profile(activities=self.activities, record_shapes=True)
            self.profiler.start()

    def after_step(self, step: int) -> None:
        if self.profiler is not None and step == self.window[1]:
            self.profiler.stop()
            trace = self.out_dir / f"rank{self.rank}.steps{self.window[0]}-{self.window[1]}.pt.trace.json"
            trace.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(trace))
            self.log.info("profiler trace: %s (open in Perfetto or TensorBoard)", trace)
            self.profiler = None


def _save_checkpoint(rt: Runtime, run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     state: dict, cache: TokenCache, keep_last: int, log: logging.Logger) -> Path:
    """All ranks enter together (their RNG states are gathered); rank 0 alone writes; all learn the outcome."""
    rng_states = gather_objects(rt, capture_rng_state())
    outcome: tuple[str | None, str | None] = (None, None)
    if rt.is_main:
        try:
            extra = {"tokenizer.json": cache.tokenizer_json.encode()} if cache.tokenizer_json else {}
            path = save_checkpoint(run_dir, step, model.state_dict(), optimizer.state_dict(), rng_states, state,
                                   extra, keep_last=keep_last)
            outcome = (str(path), None)
            log.info("checkpoint committed: %s", path)
        except Exception as e:  # the commit protocol leaves the previous checkpoint intact
            outcome = (None, f"{type(e).__name__}: {e}")
    path, error = broadcast_object(rt, outcome)
    if error:
        raise CheckpointError(f"saving the checkpoint of step {step} failed on rank 0 ({error}); "
                              "the previous checkpoint is untouched")
    return Path(path)
