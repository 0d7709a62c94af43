"""The training run: runtime -> layout and workload -> trainee -> resume -> batches -> DDP -> loop -> plot.

`run_training(cfg)` is what `lockstep train` calls on every rank. Rank roles
(docs/architecture.md): every rank computes and writes its own log; global rank 0 alone
writes checkpoints, metrics, the plot and draws the progress bar; metrics are
all-reduced means.

    lockstep.train.setup     what the loop runs on, built in order: layout, workload, Trainee, Batches
    lockstep.train.trainee   the model as trained: one optimizer step, the evaluation, DDP and its check
    lockstep.train.state     state.json, the checkpoint to resume and the restore
    lockstep.train.checkpointer  commits new checkpoints, synchronously or in the background
    lockstep.train.loop      the loop: step, log, evaluate, save, stop
    lockstep.train.step      one optimizer step and one evaluation, as functions
    lockstep.train.membership who trains this attempt, and who left or joined since the last
    lockstep.train.trackers  MLflow and W&B (train.report_to), opened here on rank 0 before setup
    lockstep.train.trainjob_progress  progress to Kubeflow Trainer inside a TrainJob (the loop's)

What a finished run leaves besides its checkpoints (the from_pretrained directory, a sample) is written by
lockstep.tools.final, which `lockstep train` calls on rank 0 once the process group is gone.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from lockstep.collectives import broadcast_object
from lockstep.config import Config
from lockstep.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    GradientDivergence,
    GradientOverflow,
)
from lockstep.metrics import plot_loss
from lockstep.rank_logs import init_rank_logging
from lockstep.runtime import Runtime, init_runtime, shutdown_runtime
from lockstep.runtime.failures import record_failure
from lockstep.train.loop import StopRequest, TrainResult, train_loop
from lockstep.train.membership import note_members
from lockstep.train.recorders import drop_abandoned_records
from lockstep.train.recovery import open_snapshots, start_point
from lockstep.train.setup import build_batches, build_layout_and_workload, build_trainee, log_plan
from lockstep.train.step_report import plot as plot_step_times
from lockstep.train.trackers import Trackers, open_trackers
from lockstep.train.workload import Workload

__all__ = ["Preflight", "TrainResult", "run_training"]


@dataclass
class Preflight:
    """What global rank 0 found before the process group existed (lockstep.plan.check, under a
    launcher lockstep did not start); the other ranks hold an empty one and learn rank 0's."""

    warning: str | None = None
    refusal: str | None = None


def run_training(cfg: Config, preflight: Preflight | None = None) -> TrainResult:
    """Train on this process's share of the job; every rank of the job calls this. `preflight`:
    said on every rank as soon as the group is up, so a refusal stops all of them at once."""
    run_dir = Path(cfg.checkpoint.output_dir)
    # NCCL's dumps beside the watchdog's stacks
    rt = init_runtime(cfg.distributed, trace_dir=run_dir / "hang")
    log = init_rank_logging(run_dir, rt.rank, rt.is_main)
    trackers = Trackers([], log)
    try:
        if preflight is not None:
            said = broadcast_object(rt, preflight)
            if said.warning and rt.is_main:
                log.warning("%s", said.warning)
            if said.refusal:
                raise ConfigError(said.refusal)
        # before setup: a tracker store that cannot be opened stops the run before any model is built
        trackers = open_trackers(cfg, run_dir, rt.is_main, log)
        # entered before setup: a signal during it stops the run at the first step
        with StopRequest() as stop:
            result, wl = _train(cfg, rt, log, stop, trackers)
    # the user's to fix
    except (ConfigError, DataError, CheckpointError, GradientDivergence, GradientOverflow) as e:
        record_failure(e)  # first, while the group is whole: a peer this breaks fails after it
        log.error("rank %d (%s): %s", rt.rank, rt.hostname, e)
        e.logged = True  # type: ignore[attr-defined]  # the CLI need not print it again
        trackers.close("FAILED")
        raise
    except BaseException as e:
        # the launcher names the rank that failed first (lockstep.runtime.failures)
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            record_failure(e)
        log.exception("training stopped with an error on rank %d (%s)", rt.rank, rt.hostname)
        with contextlib.suppress(AttributeError):  # an exception type without attributes of its own
            e.traceback_logged = True  # type: ignore[attr-defined]  # shown with its traceback above
        trackers.close("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        shutdown_runtime(rt)
    if rt.is_main:
        if cfg.train.plots:
            margin = cfg.train.straggler_margin
            _draw_pictures(run_dir, rt.distributed, log, trackers, margin=margin)
        if result.stop_signal is None and result.checkpoint is not None:
            result.workload = wl  # lockstep.tools.final writes the run's final outputs from it
            result.trackers = trackers  # ... adds the final model's path to them and closes them
        else:
            trackers.close("KILLED" if result.stop_signal else "FINISHED")
    return result


def _draw_pictures(
    run_dir: Path, distributed: bool, log: logging.Logger, trackers: Trackers, *, margin: float
) -> None:
    """RUN/loss.png, and RUN/step_times.png where the run had several ranks (the ranks behind by
    `margin` named), given to the trackers."""
    png = plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    if png:
        log.info("loss curve: %s", png)
        trackers.log_file(png)
    times = _step_times_picture(run_dir, margin, log) if distributed else None
    if times:
        log.info("step time by rank and cause: %s (`lockstep report %s`)", times, run_dir)
        trackers.log_file(times)


def _step_times_picture(run_dir: Path, margin: float, log: logging.Logger) -> Path | None:
    """RUN/step_times.png (lockstep.train.step_report); a picture that cannot be drawn is a warning,
    never a failed run."""
    try:
        return plot_step_times(run_dir / "metrics.jsonl", run_dir / "step_times.png", margin)
    except Exception as e:  # the run's work is done and committed
        log.warning("step time picture not drawn (%s: %s)", type(e).__name__, e)
        return None


def _train(
    cfg: Config,
    rt: Runtime,
    log: logging.Logger,
    stop: StopRequest,
    trackers: Trackers | None = None,
) -> tuple[TrainResult, Workload]:
    run_dir = Path(cfg.checkpoint.output_dir)
    layout, plan, wl = build_layout_and_workload(cfg, rt, log)
    trainee = build_trainee(cfg, rt, wl, layout, plan)
    # in memory when the nodes' snapshots are as new as the disk (lockstep.train.recovery)
    snapshots = open_snapshots(cfg, trainee, log)
    snapshot, resumed_from = start_point(snapshots, cfg.checkpoint, rt, log)
    start = trainee.load_state(snapshot or resumed_from, cfg.train.seed, log)
    log_plan(cfg, trainee, start.step, log)
    # an elastic restart: who left or joined, the new plan
    note_members(rt, run_dir, start.step, plan, log)
    if cfg.train.record_samples and rt.is_main:
        drop_abandoned_records(run_dir, start.step)
    batches = build_batches(cfg, trainee, start.cursor, start.step)
    trainee.wrap_ddp(batches, cfg.parallel, start.compression, log)
    result = train_loop(
        cfg,
        trainee,
        batches,
        stop,
        log,
        resumed_from=resumed_from,
        trackers=trackers,
        snapshots=snapshots,
    )
    if layout.sharded_checkpoints:
        wl.model = None  # sharded: the final outputs are built from the last checkpoint (lockstep.tools.final)
    return result, wl
