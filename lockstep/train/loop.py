"""The training loop: step, accumulate the log window, log, evaluate, save, stop.

`train_loop` is the whole loop, to be read top to bottom. What it runs on was built by lockstep.train.setup;
one optimizer step is lockstep.train.step. Logging, evaluation, checkpoints and the stop decision hold
collectives, so every rank makes the same decisions: they depend on the step and on all-reduced values only.
"""

from __future__ import annotations

import functools
import logging
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lockstep.collectives import all_reduce_max, all_reduce_sum
from lockstep.config import CheckpointConfig, Config, TrainConfig, config_to_dict
from lockstep.data.sampler import Cursor, cursor_after, steps_per_epoch
from lockstep.metrics import mfu, model_state_mb, peak_memory_mb
from lockstep.runtime import Runtime
from lockstep.train.comm_estimate import note_link
from lockstep.train.recorders import SampleRecorder, StepProfiler
from lockstep.train.setup import Setup, after_reduce
from lockstep.train.state import Checkpointer, TrainingState
from lockstep.train.step import evaluate, pipeline_step, train_step
from lockstep.train.trackers import Trackers, build_metrics_writer
from lockstep.train.trainjob_progress import build_trainjob_progress
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
    # rank 0 of a run that finished: what lockstep.tools.final builds the from_pretrained directory and the
    # sample from (its model is None when it was sharded: the weights then come from the last checkpoint)
    workload: Any = None
    trackers: Trackers | None = None  # rank 0 of a run that finished: still open; lockstep.tools.final closes them


class StopRequest:
    """SIGTERM or Ctrl-C sets a flag; the loop checks it at step boundaries on every rank.

    A signal that reaches only one rank still stops them all: the flag is all-reduced
    each step, then every rank commits the checkpoint together and exits.
    A second Ctrl-C aborts at once.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
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

    def agreed(self, rt: Runtime, save_failed: bool = False) -> tuple[int | None, bool]:
        """(the signal any rank got, the highest number if several, or None; whether a background save failed on any
        rank): the same answer on every rank, so a rank the signal did not reach still knows the run stops, and why.
        One all-reduce for both, the one the loop pays each step."""
        flags = torch.zeros(signal.NSIG + 1, dtype=torch.float64)  # [n]: ranks that got signal n; [-1]: failed saves
        if self.signum:
            flags[self.signum] = 1.0
        flags[-1] = float(save_failed)
        flags = all_reduce_sum(rt, flags)
        got = [sig for sig in range(1, signal.NSIG) if flags[sig]]
        return (got[-1] if got else None), bool(flags[-1])


@dataclass(frozen=True)
class Intervals:
    """When the loop logs, evaluates and saves: every N steps, and always at the run's last step."""

    log: int  # train.log_interval
    eval: int  # train.eval_interval; 0 = at the last step only
    save: int  # checkpoint.save_interval; 0 = at the last step only
    last: int  # the run's last step

    @classmethod
    def from_config(cls, train: TrainConfig, checkpoint: CheckpointConfig, last: int) -> Intervals:
        return cls(train.log_interval, train.eval_interval, checkpoint.save_interval, last)

    def should_log(self, step: int) -> bool:
        return step % self.log == 0 or step == self.last

    def should_eval(self, step: int) -> bool:
        return bool(self.eval and step % self.eval == 0) or step == self.last

    def should_save(self, step: int) -> bool:
        return bool(self.save and step % self.save == 0) or step == self.last


class LogWindow:
    """The steps since the last log line: loss and grad-norm sums, step and token counts, when it began, the
    time spent waiting for batches and the steps fp16's loss scaling skipped.

    Loss and grad norm stay on the device between logs: reading them every step would sync a GPU each step.
    """

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.grad_norm = torch.zeros((), device=device)
        self.reset()

    def reset(self) -> None:
        self.loss.zero_()
        self.grad_norm.zero_()
        self.steps, self.tokens, self.start = 0, 0, time.perf_counter()
        self.data_wait, self.skipped = 0.0, 0  # seconds blocked on the loader; steps the GradScaler skipped

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.loss += loss.detach().float()
        self.grad_norm += grad_norm.detach().float()
        self.steps += 1

    def summary(self, rt: Runtime) -> tuple[float, float, float, float]:
        """(mean loss, mean grad norm, tokens, seconds) over every rank's steps in the window; all ranks call it."""
        loss_sum, norm_sum, tokens = all_reduce_sum(rt, [float(self.loss), float(self.grad_norm),
                                                         self.tokens]).tolist()
        n = rt.world_size * self.steps
        return loss_sum / n, norm_sum / n, tokens, time.perf_counter() - self.start


def train_loop(cfg: Config, s: Setup, start: TrainingState, resumed_from: Path | None, stop: StopRequest,
               log: logging.Logger, trackers: Trackers | None = None) -> TrainResult:
    """Train from `start` to the last step, or until a stop request; every rank runs this together."""
    t, rt = cfg.train, s.rt
    every = Intervals.from_config(t, cfg.checkpoint, s.total_steps)
    # TrainJob progress: reports only inside a Kubeflow TrainJob, on rank 0
    progress = build_trainjob_progress(rt.is_main, s.total_steps, log)
    metrics = build_metrics_writer(t, s.run_dir, rt.is_main, s.total_steps, start.step, trackers,
                                   progress)
    epochs = _epochs_total(t, s)
    result = TrainResult(s.run_dir, start.step, resumed_from)
    profiler = StepProfiler(t.profile_steps, s.run_dir / "profile", rt, log)
    recorder = (SampleRecorder(s.run_dir, rt.rank, len(s.wl.train_ds), t.seed, start.cursor, s.plan, s.wl.lengths,
                               s.dp_rank) if t.record_samples else None)
    check_grads = cfg.parallel.check_grads
    if check_grads:
        log.info("parallel.check_grads: gradient hashes are compared across ranks after every step")
    window = LogWindow(rt.device)
    # DDP across nodes: the link's share of a step is measured once, at the second log (the first holds warm-up)
    logs_to_link_note = 2 if rt.world_size > rt.local_world_size and s.ddp_choice is not None else 0
    step = start.step
    if step >= s.total_steps:
        log.info("checkpoint is at step %d, the run's last step is %d: nothing left to train", step, s.total_steps)
    # hang_seconds = 0 turns the watchdog off: beats then only set a field, and no thread runs. Both stop when the
    # block ends (the checkpointer waits for a save still writing in the background), before the process group goes.
    with (Watchdog(rt, s.run_dir, cfg.distributed.hang_seconds or math.inf, log=log) as watchdog,
          Checkpointer(s, cfg.checkpoint, resumed_from, log) as checkpointer, progress):
        while step < s.total_steps:
            watchdog.beat(step + 1, "train")  # forward, backward with its all-reduce, optimizer
            profiler.before_step(step)
            lr = s.scheduler.get_last_lr()[0]
            micro_batches = _micro_batches(s, window)
            scale = s.scaler.get_scale() if s.scaler else 0.0  # no wait: the last scaler.step synced already
            if s.pipeline is not None:
                loss, grad_norm = pipeline_step(s.pipeline, s.optimizer, micro_batches, rt.device,
                                                cfg.optim.gradient_clip_norm)
            else:
                after_backward = (functools.partial(after_reduce, s, step + 1, check_grads)
                                  if check_grads or s.compression else None)
                before_reduce = functools.partial(s.guard, step=step + 1) if s.guard else None
                # a token-weighted loss is per target token of the whole step (all micro-batches, all ranks)
                loss, grad_norm = train_step(s.ddp_model, s.model, s.optimizer, micro_batches, rt,
                                             grad_accum=s.plan.grad_accum, autocast=s.autocast,
                                             clip_norm=cfg.optim.gradient_clip_norm, loss=s.wl.loss,
                                             scaler=s.scaler, after_backward=after_backward,
                                             before_reduce=before_reduce)
            s.scheduler.step()
            step += 1
            window.add(loss, grad_norm)
            if s.scaler and s.scaler.get_scale() < scale:  # fp16 overflowed: the scaler skipped the step
                window.skipped += 1
                log.warning("step %d skipped: its gradients overflowed (inf/nan) at fp16 loss scale %g; the "
                            "weights are unchanged and the scale is now %g", step, scale, s.scaler.get_scale())
            profiler.after_step(step)
            if recorder:
                recorder.record(step)

            watchdog.beat(step, "metrics")
            # a signal on any rank: every rank logs, saves and leaves after this step; a save that failed in the
            # background on any rank: every rank stops with its error, the checkpoint before it untouched
            stopping, save_failed = stop.agreed(rt, checkpointer.failed())
            if save_failed:
                checkpointer.stop_on_failure(step)
            if every.should_log(step) or stopping:
                progress.note_checkpoint(checkpointer.committed)
                values = _train_metrics(s, window, lr, _epochs_done(s, start, step, t.seed), epochs)
                metrics.log(step, values)
                result.train_loss = values["loss"]
                window.reset()
                logs_to_link_note -= 1
                if logs_to_link_note == 0:
                    note_link(rt, s.model, cfg.parallel, s.plan.global_batch / values["samples_per_s"], log)
            if s.eval_batches and every.should_eval(step):
                watchdog.beat(step, "eval")
                result.eval_loss = _evaluate(s)
                metrics.log(step, {"loss": result.eval_loss, "perplexity": math.exp(min(result.eval_loss, 50))}, "eval")
            if every.should_save(step) or stopping:
                watchdog.beat(step, "checkpoint")
                checkpointer.save(_state_at(cfg, s, start, step))
            metrics.advance(step)
            if stopping:
                result.stop_signal = stopping
                break
        watchdog.beat(step, "checkpoint")
        checkpointer.finish()  # a save still writing in the background commits before the run ends or stops
        progress.note_checkpoint(checkpointer.committed)
        progress.finish(step, finished=step >= s.total_steps and not result.stop_signal)
    result.checkpoint = checkpointer.committed
    if result.stop_signal:
        log.warning("stop requested (signal %d%s): checkpoint committed at step %d, exiting", result.stop_signal,
                    "" if stop.signum else ", received by another rank", step)
    if check_grads and step > start.step:
        log.info("parallel.check_grads: gradients were identical on all %d ranks after each of %d steps",
                 rt.world_size, step - start.step)
    result.step = step
    metrics.close()
    return result


def _micro_batches(s: Setup, window: LogWindow) -> Iterator[Any]:
    """One step's grad_accum micro-batches from the loader; their tokens are counted into the window."""
    for _ in range(s.plan.grad_accum):
        start = time.perf_counter()
        batch = next(s.batches)
        window.data_wait += time.perf_counter() - start  # blocked on the loader (workers behind, or none)
        if s.wl.count_tokens:
            window.tokens += s.wl.count_tokens(batch)  # on the CPU copy: no device sync
        yield batch


def _train_metrics(s: Setup, window: LogWindow, lr: float, epoch: float,
                   epochs: float | None) -> dict[str, float]:
    """The window's train metrics: means over all ranks and steps, rates, memory, epochs done (of
    `epochs` in an epoch-bound run)."""
    rt = s.rt
    loss, grad_norm, tokens, elapsed = window.summary(rt)
    values = {"loss": loss, "lr": lr, "grad_norm": grad_norm,
              "samples_per_s": window.steps * s.plan.global_batch / elapsed, "epoch": epoch}
    if epochs is not None:
        values["epochs"] = epochs
    if s.wl.count_tokens:  # tp and pp peers read the same tokens: count each sample once
        values["tokens_per_s"] = tokens / (s.layout.tp * s.layout.pp) / elapsed
        if s.flops_per_token:
            values["mfu"] = mfu(values["tokens_per_s"], s.flops_per_token, s.peak_flops)
    values["data_wait_ms"] = all_reduce_max(rt, 1000 * window.data_wait / window.steps)  # the slowest rank's
    if s.scaler:  # fp16: every rank skips the same steps (their gradients are all-reduced before the check)
        values["skipped_steps"], values["loss_scale"] = float(window.skipped), s.scaler.get_scale()
    values["peak_mem_mb"] = all_reduce_max(rt, peak_memory_mb(rt.device))  # the fullest rank
    values["state_mb"] = all_reduce_max(rt, model_state_mb(s.model, s.optimizer))
    return values


def _evaluate(s: Setup) -> float:
    """Mean loss over the held-out set, each rank on its shard (per target token where the workload counts them)."""
    wl, pipeline = s.wl, s.pipeline
    eval_loss = wl.loss if pipeline is None else (lambda _, batch: pipeline.evaluate(*batch))
    batches = (wl.collate([wl.eval_ds[i] for i in b]) for b in s.eval_batches)
    return evaluate(s.model, batches, s.rt, eval_loss, s.autocast)


def _cursor_at(s: Setup, start: TrainingState, step: int, seed: int) -> Cursor:
    """The data cursor after `step`, by arithmetic from the one the run started at."""
    return cursor_after(len(s.wl.train_ds), seed, start.cursor, s.plan.global_batch, step - start.step)


def epochs_done(cursor: Cursor, num_samples: int, global_batch: int) -> float:
    """Passes over the data done at `cursor`, as HF's float epoch: whole epochs plus the share of
    this one's steps done (an epoch is its steps_per_epoch batches; a tail short of a batch is
    dropped, and a cursor too close to the end for another batch has finished its epoch)."""
    per_epoch = steps_per_epoch(num_samples, global_batch) * global_batch  # samples an epoch uses
    return cursor.epoch + min(1.0, cursor.offset / per_epoch)


def _epochs_done(s: Setup, start: TrainingState, step: int, seed: int) -> float:
    return epochs_done(_cursor_at(s, start, step, seed), len(s.wl.train_ds), s.plan.global_batch)


def _epochs_total(train: TrainConfig, s: Setup) -> float | None:
    """train.epochs where it decides the last step (an epoch-bound run); None in a step-bound one,
    where the progress line shows epochs done alone."""
    per_epoch = steps_per_epoch(len(s.wl.train_ds), s.plan.global_batch)
    bound = train.epochs and math.ceil(train.epochs * per_epoch) == s.total_steps
    return train.epochs if bound else None


def _state_at(cfg: Config, s: Setup, start: TrainingState, step: int) -> TrainingState:
    """What the checkpoint of `step` records in its state.json."""
    tokens_per_step = s.plan.global_batch * cfg.model.max_seq_length if cfg.model.kind == "gpt" else None
    return TrainingState(
        step=step, cursor=_cursor_at(s, start, step, cfg.train.seed), scheduler=s.scheduler.state_dict(),
        config=config_to_dict(cfg), world_size=s.rt.world_size, global_batch=s.plan.global_batch,
        tokens_seen=step * tokens_per_step if tokens_per_step else None,
        grad_scaler=s.scaler.state_dict() if s.scaler else None, layout=s.layout.describe(),
    )
