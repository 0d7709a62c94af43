"""The training loop: step, accumulate the log window, log, evaluate, save, stop.

`train_loop` is the whole loop, to be read top to bottom. It talks to three components, built by
lockstep.train.setup: the Trainee (lockstep.train.trainee: one optimizer step, the evaluation), its
Batches (lockstep.data.batches) and the Checkpointer (lockstep.train.checkpointer). Logging,
evaluation, checkpoints and the stop decision hold collectives, so every rank makes the same
decisions: they depend on the step and on all-reduced values only.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lockstep.collectives import all_reduce_max_each, all_reduce_sum
from lockstep.config import CheckpointConfig, Config, ParallelConfig, TrainConfig
from lockstep.data.batches import Batches, StepBatches
from lockstep.metrics import mfu, model_state_mb, peak_memory_mb
from lockstep.runtime import Runtime
from lockstep.runtime.watchdog import Watchdog
from lockstep.train.checkpointer import Checkpointer
from lockstep.train.comm_estimate import note_link
from lockstep.train.recorders import SampleRecorder, StepProfiler
from lockstep.train.snapshots import MemorySnapshots
from lockstep.train.step_clock import StepClock
from lockstep.train.stragglers import StragglerWatch
from lockstep.train.trackers import Trackers, build_metrics_writer
from lockstep.train.trainee import Trainee
from lockstep.train.trainjob_progress import build_trainjob_progress


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
    # rank 0 of a run that finished: still open; lockstep.tools.final closes them
    trackers: Trackers | None = None


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
        # [n]: ranks that got signal n; [-1]: failed saves
        flags = torch.zeros(signal.NSIG + 1, dtype=torch.float64)
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
        # seconds blocked on the loader; steps the GradScaler skipped
        self.data_wait, self.skipped = (0.0, 0)

    def add_data(self, batches: StepBatches) -> None:
        self.tokens += batches.tokens
        self.data_wait += batches.wait

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.loss += loss.detach().float()
        self.grad_norm += grad_norm.detach().float()
        self.steps += 1

    def summary(self, rt: Runtime) -> tuple[float, float, float, float]:
        """(mean loss, mean grad norm, tokens, seconds) over every rank's steps in the window; all ranks call it."""
        loss_sum, norm_sum, tokens = all_reduce_sum(
            rt, [float(self.loss), float(self.grad_norm), self.tokens]
        ).tolist()
        n = rt.world_size * self.steps
        return loss_sum / n, norm_sum / n, tokens, time.perf_counter() - self.start


def train_loop(
    cfg: Config,
    trainee: Trainee,
    batches: Batches,
    stop: StopRequest,
    log: logging.Logger,
    *,
    resumed_from: Path | None = None,
    trackers: Trackers | None = None,
    snapshots: MemorySnapshots | None = None,
) -> TrainResult:
    """Train from where `batches` starts to the last step, or until a stop request; every rank runs this."""
    t, rt, last = cfg.train, trainee.rt, trainee.total_steps
    run_dir = Path(cfg.checkpoint.output_dir)
    every = Intervals.from_config(t, cfg.checkpoint, last)
    # TrainJob progress: reports only inside a Kubeflow TrainJob, on rank 0
    progress = build_trainjob_progress(rt.is_main, last, log)
    step = batches.step
    metrics = build_metrics_writer(
        t, run_dir, rt.is_main, last, step, trackers=trackers, progress=progress
    )
    epochs = _epochs_total(t, batches, last)
    result = TrainResult(run_dir, step, resumed_from)
    profiler = StepProfiler(t.profile_steps, run_dir / "profile", rt, log)
    recorder = SampleRecorder(run_dir, rt.rank, batches) if t.record_samples else None
    window = LogWindow(rt.device)
    stragglers = StragglerWatch(t.straggler_margin, t.straggler_windows, log, t.probe_links)
    link = LinkNote(trainee, cfg.parallel, log)
    # hang_seconds = 0 turns the watchdog off: beats then only set a field, and no thread runs. Both
    # stop when the block ends (the checkpointer waits for a save still writing in the background),
    # before the process group goes.
    with (
        Watchdog(rt, run_dir, cfg.distributed.hang_seconds or math.inf, log=log) as watchdog,
        Checkpointer(trainee, batches, cfg, resumed_from, log, snapshots=snapshots) as checkpointer,
        # every rank's step time by phase, compared at each log (lockstep.train.step_clock and
        # stragglers): under DDP the exposed all-reduce apart from compute, else collectives' waits
        StepClock(rt.device, trainee.model.parameters() if trainee.ddp_choice else ()) as clock,
        progress,
    ):
        while step < last:
            watchdog.beat(step + 1, "train")  # forward, backward with its all-reduce, optimizer
            profiler.before_step(step)
            clock.lap("other")
            micro_batches = batches.next_step()
            clock.lap("data")
            window.add_data(micro_batches)
            done = trainee.step(micro_batches, step + 1, clock)
            clock.step_done()
            step += 1
            window.add(done.loss, done.grad_norm)
            if done.skipped:  # fp16 overflowed: the scaler skipped the step
                window.skipped += 1
                _warn_skipped(step, done.scale, trainee.scaler.get_scale(), log)
            profiler.after_step(step)
            if recorder:
                recorder.record(step)

            watchdog.beat(step, "metrics")
            # a signal on any rank: every rank logs, saves and leaves after this step; a save that failed in the
            # background on any rank: every rank stops with its error, the checkpoint before it untouched
            checkpointer.hold_snapshot()  # the step before it is held in memory before it is logged
            clock.lap("checkpoint")
            stopping, save_failed = stop.agreed(rt, checkpointer.failed())
            clock.lap("comm")  # waiting there for the others is not this rank's own time
            if save_failed:
                checkpointer.stop_on_failure(step)
            if every.should_log(step) or stopping:
                progress.note_checkpoint(checkpointer.committed)
                values = _train_metrics(trainee, window, done.lr, batches.epochs_done(step), epochs)
                metrics.log(step, values, ranks=stragglers.compare(rt, clock))
                clock.skip()  # rank 0's writing of the line is no step's time
                result.train_loss = values["loss"]
                window.reset()
                link.after_log(values["samples_per_s"])
            if batches.eval_indices and every.should_eval(step):
                watchdog.beat(step, "eval")
                result.eval_loss = _evaluate(trainee, batches, metrics, step)
                clock.skip()  # not a training step's time
            if every.should_save(step) or stopping:
                watchdog.beat(step, "checkpoint")
                checkpointer.save(step)
                clock.lap("checkpoint" if checkpointer.writes_here else "comm")
            # in memory too, for a restart (lockstep.train.recovery): faster to read than the disk
            if checkpointer.snapshot_due(step) and not stopping:
                watchdog.beat(step, "snapshot")
                checkpointer.snapshot(step)
                clock.lap("checkpoint")
            metrics.advance(step)
            if stopping:
                result.stop_signal = stopping
                break
        watchdog.beat(step, "checkpoint")
        checkpointer.finish()  # a save still writing in the background commits before the run ends or stops
        progress.note_checkpoint(checkpointer.committed)
        progress.finish(step, finished=step >= last and not result.stop_signal)
    result.checkpoint = checkpointer.committed
    _say_how_it_ended(result, step, stop, trainee, log)
    result.step = step
    metrics.close()
    return result


class LinkNote:
    """DDP across nodes: the link's share of a step, measured once, at the second log line (the
    first is warm-up; lockstep.train.comm_estimate.note_link). Every rank calls after_log."""

    def __init__(self, trainee: Trainee, parallel: ParallelConfig, log: logging.Logger) -> None:
        rt = trainee.rt
        self.trainee, self.parallel, self.log = trainee, parallel, log
        across_nodes = rt.world_size > rt.local_world_size and trainee.ddp_choice is not None
        self.logs_left = 2 if across_nodes else 0

    def after_log(self, samples_per_s: float) -> None:
        self.logs_left -= 1
        if self.logs_left == 0:
            t = self.trainee
            note_link(t.rt, t.model, self.parallel, t.plan.global_batch / samples_per_s, self.log)


def _evaluate(trainee: Trainee, batches: Batches, metrics, step: int) -> float:
    """The held-out loss, logged with its perplexity."""
    loss = trainee.evaluate(batches)
    metrics.log(step, {"loss": loss, "perplexity": math.exp(min(loss, 50))}, "eval")
    return loss


def _warn_skipped(step: int, scale: float, now: float, log: logging.Logger) -> None:
    log.warning(
        "step %d skipped: its gradients overflowed (inf/nan) at fp16 loss scale %g; the weights are "
        "unchanged and the scale is now %g",
        step,
        scale,
        now,
    )


def _say_how_it_ended(
    result: TrainResult, step: int, stop: StopRequest, trainee: Trainee, log: logging.Logger
) -> None:
    """The stop that ended the run early, and what parallel.check_grads found, once the loop is left."""
    if result.stop_signal:
        by = "" if stop.signum else ", received by another rank"
        log.warning(
            "stop requested (signal %d%s): checkpoint committed at step %d, exiting",
            result.stop_signal,
            by,
            step,
        )
    if trainee.check_grads and step > result.step:
        log.info(
            "parallel.check_grads: gradients were identical on all %d ranks after each of %d steps",
            trainee.rt.world_size,
            step - result.step,
        )


def _train_metrics(
    trainee: Trainee, window: LogWindow, lr: float, epoch: float, epochs: float | None
) -> dict[str, float]:
    """The window's train metrics: means over all ranks and steps, rates, memory, epochs done (of
    `epochs` in an epoch-bound run)."""
    rt, layout = trainee.rt, trainee.layout
    loss, grad_norm, tokens, elapsed = window.summary(rt)
    values = {
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "samples_per_s": window.steps * trainee.plan.global_batch / elapsed,
        "epoch": epoch,
    }
    if epochs is not None:
        values["epochs"] = epochs
    # tp and pp peers read the same tokens: count each sample once
    if trainee.workload.count_tokens:
        values["tokens_per_s"] = tokens / (layout.tp * layout.pp) / elapsed
        if trainee.flops_per_token:
            values["mfu"] = mfu(values["tokens_per_s"], trainee.flops_per_token, trainee.peak_flops)
    # fp16: every rank skips the same steps (their gradients are all-reduced before the check)
    if trainee.scaler:
        values["skipped_steps"], values["loss_scale"] = (
            float(window.skipped),
            trainee.scaler.get_scale(),
        )
    # the slowest rank's data wait, the fullest rank's memory and state, in one collective
    values["data_wait_ms"], values["peak_mem_mb"], values["state_mb"] = all_reduce_max_each(
        rt,
        [
            1000 * window.data_wait / window.steps,
            peak_memory_mb(rt.device),
            model_state_mb(trainee.model, trainee.optimizer),
        ],
    )
    return values


def _epochs_total(train: TrainConfig, batches: Batches, last: int) -> float | None:
    """train.epochs where it decides the last step (an epoch-bound run); None in a step-bound one,
    where the progress line shows epochs done alone."""
    bound = train.epochs and math.ceil(train.epochs * batches.steps_per_epoch()) == last
    return train.epochs if bound else None
