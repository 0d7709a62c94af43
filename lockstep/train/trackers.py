"""Experiment trackers (`train.report_to`): MLflow and Weights & Biases beside metrics.jsonl, TensorBoard and loss.png.
This module opens them, fans every call out to them (Trackers) and holds the W&B run; the MLflow
run and the checks of its store are lockstep.train.mlflow_tracker's.

Global rank 0 alone opens them (docs/architecture.md, "Rank roles"), through the libraries' own APIs: `mlflow.MlflowClient`
(no fluent global run, so two runs in one process don't meet) and the run object `wandb.init` returns.
TensorBoard stays where it was, inside lockstep.metrics.MetricsWriter; `report_to: none` leaves metrics.jsonl
and loss.png only.

Lifecycle: run_training opens them before setup (a store that cannot be opened fails the run before any model is
built); the loop's MetricsWriter hands them every record it writes to metrics.jsonl, named `split/key` as in
TensorBoard (`train/loss`, `eval/loss`) with the step; run_training adds loss.png, and lockstep.tools.final the
final model's path, then closes them. A run that stopped early or failed is closed by run_training.

Resume: RUN/trackers.json holds each tracker's run id, so a resumed run continues the same MLflow run and W&B
run. Steps a crashed attempt logged after the checkpoint the run resumed from are logged again: MLflow keeps
both values of such a step (its history is append-only; the later timestamp is the resumed attempt's, the one
metrics.jsonl's reader and TensorBoard keep) and the run is tagged `lockstep.resumed_at`; W&B plots both
against `step`.

A tracker that fails mid-run (its server went away, its store's filesystem filled up) is
dropped with one warning: training goes on and metrics.jsonl, written first, has every value.
The console shows that one line; the traceback, and what MLflow's own loggers say, go to the
rank log (lockstep.rank_logs.route_library_logs). What a real `mlflow server` killed mid-run
cost: lockstep.train.mlflow_tracker.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from lockstep.config import Config, TrainConfig, check_trackers, config_to_dict
from lockstep.config.overrides import flatten
from lockstep.errors import ConfigError
from lockstep.metrics import MetricsSink, MetricsWriter
from lockstep.rank_logs import TRACEBACK_IN_RANK_LOG
from lockstep.train.mlflow_tracker import TRACKERS_FILE, MlflowTracker, short_error


class WandbTracker:
    """One W&B run (offline by default: RUN/wandb/offline-run-*/, `wandb sync` uploads it later)."""

    name = "wandb"

    def __init__(
        self,
        train: TrainConfig,
        run_dir: Path,
        run_name: str,
        saved: dict,
        params: dict[str, Any],
        log: logging.Logger,
    ):
        import wandb

        # console off: lockstep's own log lines are in RUN/logs; create_new: no process-global run to collide with
        settings = wandb.Settings(console="off", silent=True, reinit="create_new", init_timeout=30)
        run_id = saved.get("id") if saved.get("project") == train.project else None
        try:
            self.run = wandb.init(
                mode=train.wandb_mode,
                dir=str(run_dir),
                project=train.project,
                name=run_name,
                config=params,
                id=run_id,
                resume="allow",
                settings=settings,
            )
        # wandb raises its own error types (login, network): the fix is the same
        except Exception as e:
            raise ConfigError(
                f"wandb.init (train.wandb_mode = {train.wandb_mode!r}) failed: "
                f"{short_error(e)}; run `wandb login` for online mode, or set "
                "train.wandb_mode=offline"
            ) from None
        self.project, self.log = train.project, log
        # our step, not W&B's own counter: a resumed run logs steps it may have logged before, which W&B's step drops
        self.run.define_metric("step")
        for split in ("train", "eval"):
            self.run.define_metric(f"{split}/*", step_metric="step")

    def note_start(self, start_step: int) -> None:
        if start_step > 0:
            self.run.summary["resumed_at"] = start_step

    def log_values(self, step: int, values: dict[str, float], split: str) -> None:
        self.run.log({"step": step, **{f"{split}/{k}": v for k, v in values.items()}})

    def log_file(self, path: Path) -> None:
        # a copy in the run's own files: `wandb sync` later uploads this attempt's file, whatever RUN holds by then
        copy = Path(self.run.dir) / Path(path).name
        shutil.copyfile(path, copy)
        self.run.save(str(copy), base_path=self.run.dir, policy="now")

    def log_final_model(self, path: Path, manifest: dict) -> None:
        self.run.summary["final_model"] = str(path)
        self.run.summary["final_model_bytes"] = manifest["bytes"]

    def close(self, status: str) -> None:
        offline = self.run.settings.mode == "offline"
        folder = Path(self.run.dir).parent  # silent above: say here what wandb would have said
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        self.log.info(
            "W&B run %s (%s) in %s%s",
            self.run.id,
            status,
            folder,
            f"; upload with: wandb sync {folder}" if offline else "",
        )

    def saved(self) -> dict:
        return {"id": self.run.id, "project": self.project}


class Trackers:
    """The open trackers of rank 0 (none elsewhere). A call that fails drops that tracker with one warning."""

    def __init__(self, items: list, log: logging.Logger):
        self.items, self.logger = list(items), log

    def __bool__(self) -> bool:
        return bool(self.items)

    def _each(self, what: str, call) -> None:
        for tracker in list(self.items):
            try:
                call(tracker)
            # a tracker must never stop training: metrics.jsonl has the values
            except Exception as e:
                self.items.remove(tracker)
                # one line on the console; the traceback in the rank log
                self.logger.warning(
                    "%s stopped working while %s (%s); training goes on without it, and "
                    "metrics.jsonl has every value",
                    tracker.name,
                    what,
                    short_error(e),
                    exc_info=True,
                    extra=TRACEBACK_IN_RANK_LOG,
                )

    def note_start(self, start_step: int) -> None:
        self._each(f"noting the start at step {start_step}", lambda t: t.note_start(start_step))

    def log(self, step: int, values: dict[str, float], split: str = "train") -> None:
        """A MetricsWriter sink: the values it wrote to metrics.jsonl."""
        self._each(f"logging {split} step {step}", lambda t: t.log_values(step, values, split))

    def log_file(self, path: Path) -> None:
        self._each(f"logging {path}", lambda t: t.log_file(Path(path)))

    def log_final_model(self, path: Path) -> None:
        # a reference, not a copy: the final model can be GBs, which an artifact store would duplicate (and a
        # remote one upload while rank 0 holds the job open); the manifest says what the directory held
        path = Path(path).resolve()
        files = {
            str(p.relative_to(path)): p.stat().st_size
            for p in sorted(path.rglob("*"))
            if p.is_file()
        }
        manifest = {"path": str(path), "files": files, "bytes": sum(files.values())}
        self._each(f"logging the final model {path}", lambda t: t.log_final_model(path, manifest))

    def close(self, status: str = "FINISHED") -> None:
        """Ends every run: FINISHED, FAILED or KILLED (a signal stopped it)."""
        self._each("closing the run", lambda t: t.close(status))
        self.items = []


def open_trackers(cfg: Config, run_dir: Path, is_main: bool, log: logging.Logger) -> Trackers:
    """The trackers train.report_to names besides TensorBoard, open on rank 0; their ids saved for a resume."""
    names = [n for n in check_trackers(cfg.train.report_to) if n != "tensorboard"]
    if not is_main or not names:
        return Trackers([], log)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    saved_path = run_dir / TRACKERS_FILE
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    params = flatten(config_to_dict(cfg), "config")  # dotted keys: train.batch_size
    items = []
    for name in names:
        kind = MlflowTracker if name == "mlflow" else WandbTracker
        try:
            items.append(
                kind(
                    cfg.train,
                    run_dir,
                    run_dir.resolve().name,
                    saved=saved.get(name, {}),
                    params=params,
                    log=log,
                )
            )
        except ConfigError:
            raise
        # the store could not be opened: the run has not started, so it stops here
        except Exception as e:
            raise ConfigError(
                f"train.report_to: {name} could not start ({short_error(e)}); check "
                f"train.tracking_uri = {cfg.train.tracking_uri!r}, or drop {name} from "
                "train.report_to"
            ) from None
    saved.update({t.name: t.saved() for t in items})
    saved_path.write_text(json.dumps(saved, indent=2) + "\n")
    log.info("trackers: %s", ", ".join(f"{t.name} {t.saved()}" for t in items))
    return Trackers(items, log)


def build_metrics_writer(
    train: TrainConfig,
    run_dir: Path,
    is_main: bool,
    total_steps: int,
    start_step: int,
    trackers: Trackers | None,
    progress: MetricsSink | None = None,
) -> MetricsWriter:
    """The loop's MetricsWriter: metrics.jsonl, TensorBoard if train.report_to names it, the
    trackers, and TrainJob progress inside a Kubeflow TrainJob (lockstep.train.trainjob_progress,
    which the loop builds and finishes)."""
    if trackers:
        trackers.note_start(start_step)
    # an empty Trackers, or a reporter outside a TrainJob, is falsy
    sinks = [sink for sink in (trackers, progress) if sink]
    return MetricsWriter(
        run_dir,
        is_main,
        total_steps,
        start_step,
        tensorboard="tensorboard" in check_trackers(train.report_to),
        sinks=sinks,
    )
