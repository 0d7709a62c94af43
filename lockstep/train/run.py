"""The training run: runtime -> setup -> resume -> DDP check -> loop -> the loss plot.

`run_training(cfg)` is what `lockstep train` calls on every rank. Rank roles
(DESIGN.md): every rank computes and writes its own log; global rank 0 alone
writes checkpoints, metrics, the plot and draws the progress bar; metrics are
all-reduced means.

    lockstep.train.setup     layout, workload, parallelism, optimizer, data, the DDP check
    lockstep.train.state     resume from a checkpoint, commit new ones
    lockstep.train.loop      the loop: step, log, evaluate, save, stop
    lockstep.train.step      one optimizer step, one evaluation
    lockstep.train.membership who trains this attempt, and who left or joined since the last
    lockstep.train.trackers  MLflow and W&B (train.report_to), opened here on rank 0 before setup
    lockstep.train.trainjob_progress  progress to Kubeflow Trainer inside a TrainJob (the loop's)

What a finished run leaves besides its checkpoints (the from_pretrained directory, a sample) is written by
lockstep.tools.final, which `lockstep train` calls on rank 0 once the process group is gone.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from lockstep.config import Config
from lockstep.data.sampler import Cursor
from lockstep.errors import CheckpointError, ConfigError, DataError, GradientDivergence, GradientOverflow
from lockstep.metrics import init_rank_logging, plot_loss
from lockstep.rng import seed_everything
from lockstep.runtime import Runtime, init_runtime, shutdown_runtime
from lockstep.train.loop import StopRequest, TrainResult, train_loop
from lockstep.train.membership import note_members
from lockstep.train.recorders import drop_abandoned_records
from lockstep.train.setup import (Setup, apply_checked_ddp, build_batches, build_setup, log_plan,
                                  measure_peak_flops_total)
from lockstep.train.state import TrainingState, pick_resume_point, restore_plain, restore_sharded
from lockstep.train.trackers import Trackers, open_trackers
from lockstep.train.workload import Workload

__all__ = ["TrainResult", "run_training"]


def run_training(cfg: Config) -> TrainResult:
    """Train on this process's share of the job; every rank of the job calls this."""
    run_dir = Path(cfg.checkpoint.output_dir)
    rt = init_runtime(cfg.distributed, trace_dir=run_dir / "hang")  # NCCL's dumps beside the watchdog's stacks
    log = init_rank_logging(run_dir, rt.rank, rt.is_main)
    trackers = Trackers([], log)
    try:
        # before setup: a tracker store that cannot be opened stops the run before any model is built
        trackers = open_trackers(cfg, run_dir, rt.is_main, log)
        with StopRequest() as stop:  # entered before setup: a signal during it stops the run at the first step
            result, wl = _train(cfg, rt, log, stop, trackers)
    except (ConfigError, DataError, CheckpointError, GradientDivergence, GradientOverflow) as e:  # the user's to fix
        log.error("rank %d (%s): %s", rt.rank, rt.hostname, e)
        e.logged = True  # type: ignore[attr-defined]  # the CLI need not print it again
        trackers.close("FAILED")
        raise
    except BaseException as e:
        log.exception("training stopped with an error on rank %d (%s)", rt.rank, rt.hostname)
        with contextlib.suppress(AttributeError):  # an exception type without attributes of its own
            e.traceback_logged = True  # type: ignore[attr-defined]  # shown with its traceback above
        trackers.close("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        shutdown_runtime(rt)
    if rt.is_main:
        png = plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
        if png:
            log.info("loss curve: %s", png)
            trackers.log_file(png)
        if result.stop_signal is None and result.checkpoint is not None:
            result.workload = wl  # lockstep.tools.final writes the run's final outputs from it
            result.trackers = trackers  # ... adds the final model's path to them and closes them
        else:
            trackers.close("KILLED" if result.stop_signal else "FINISHED")
    return result


def _train(cfg: Config, rt: Runtime, log: logging.Logger, stop: StopRequest,
           trackers: Trackers | None = None) -> tuple[TrainResult, Workload]:
    s = build_setup(cfg, rt, log)
    resumed_from = pick_resume_point(cfg.checkpoint, rt, s.run_dir, log)
    start = _resume(resumed_from, s, cfg.train.seed, log)
    s.peak_flops = measure_peak_flops_total(rt, cfg.train, s.flops_per_token, cfg.data.cache_dir)
    log_plan(s, cfg, start.step, log)
    note_members(rt, s.run_dir, start.step, s.plan, log)  # an elastic restart: who left or joined, the new plan
    if cfg.train.record_samples and rt.is_main:
        drop_abandoned_records(s.run_dir, start.step)
    s.batches, s.eval_batches = build_batches(s, start.cursor, start.step, cfg.data, cfg.train)
    apply_checked_ddp(s, cfg.parallel, start.step, log, start.compression)
    result = train_loop(cfg, s, start, resumed_from, stop, log, trackers)
    if s.layout.sharded_checkpoints:
        s.wl.model = None  # sharded: the final outputs are built from the last checkpoint (lockstep.tools.final)
    return result, s.wl


def _resume(path: Path | None, s: Setup, seed: int, log: logging.Logger) -> TrainingState:
    """The checkpoint's state, its weights, optimizer and RNG loaded; or step 0 of a new run."""
    if path is None:
        seed_everything(seed + s.dp_rank)  # per-replica streams (dropout) from here on; tp peers share theirs
        return TrainingState(step=0, cursor=Cursor())
    if s.layout.sharded_checkpoints or _is_sharded(path):
        return restore_sharded(path, s.model, s.optimizer, s.scheduler, s.rt, seed, s.dp_rank, s.plan,
                               s.pipeline is not None, log)
    return restore_plain(path, s.wl, s.optimizer, s.scheduler, s.scaler, s.rt, seed, s.dp_rank, s.plan, log)


def _is_sharded(path: Path) -> bool:
    from lockstep.checkpoint.sharded import is_sharded  # DTensor imports only when a checkpoint may need them

    return is_sharded(path)
