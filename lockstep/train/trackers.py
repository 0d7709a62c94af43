"""Experiment trackers (`train.report_to`): MLflow and Weights & Biases beside metrics.jsonl, TensorBoard and loss.png.

Global rank 0 alone opens them (DESIGN.md rank roles), through the libraries' own APIs: `mlflow.MlflowClient`
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

A tracker that fails mid-run (its server went away) is dropped with one warning: training goes on and
metrics.jsonl, written first, has every value. Seen with a real `mlflow server` killed at step 38 of 300: one
warning, the failing call cost rank 0 3.4 s (RUN_HTTP below), the run finished with all 300 steps in metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lockstep.config import Config, TrainConfig, check_trackers, config_to_dict
from lockstep.config.overrides import flatten
from lockstep.errors import ConfigError
from lockstep.metrics import MetricsWriter

TRACKERS_FILE = "trackers.json"  # in the run directory: each tracker's run id, for a resumed run to continue
# MLflow's HTTP knobs while probing a server: one try, a short timeout (its defaults, 7 retries with exponential
# backoff and 120 s per request, take minutes to say that a server is down)
PROBE_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
PROBE_SECONDS = 15.0  # a name that does not resolve is outside requests' timeout: the probe thread is bounded too
# during the run, unless the user set them: a server that goes away costs rank 0 seconds once (refused: ~3 s; a
# silent host: 3 tries x 10 s), then the tracker is dropped, instead of minutes per call while the other ranks wait
RUN_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
PARAMS_PER_BATCH = 100  # MLflow's limit on params in one log_batch


def resolve_tracking_uri(train: TrainConfig, run_dir: Path) -> str:
    """train.tracking_uri as given, or a sqlite file in the run directory (its artifacts in RUN/mlartifacts)."""
    return train.tracking_uri or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


def check_tracking_uri(train: TrainConfig) -> None:
    """An MLflow tracking server that does not answer fails here within seconds, before any worker starts."""
    uri = train.tracking_uri
    if not uri or "mlflow" not in check_trackers(train.report_to) or not uri.startswith(("http://", "https://")):
        return  # the default sqlite file, or a local store: opened (and its errors reported) at start
    outcome: list[BaseException | None] = []

    def probe() -> None:
        from mlflow import MlflowClient

        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
            outcome.append(None)
        except Exception as e:  # any failure means rank 0 could not log there: the message says which
            outcome.append(e)

    with _mlflow_http(PROBE_HTTP, override=True):
        thread = threading.Thread(target=probe, name="lockstep-mlflow-probe", daemon=True)
        thread.start()
        thread.join(PROBE_SECONDS)
    if outcome == [None]:
        return
    reason = _short(outcome[0]) if outcome else f"no answer within {PROBE_SECONDS:.0f} s"
    raise ConfigError(f"train.tracking_uri = {uri!r} does not answer ({reason}); the MLflow tracking server must be "
                      "reachable from global rank 0 when training starts. Start it (mlflow server --host 0.0.0.0 "
                      "--port 5000), fix the URI, or leave train.tracking_uri unset to log into RUN/mlflow.db "
                      "(or drop mlflow from train.report_to)")


class MlflowTracker:
    """One MLflow run: created in the experiment `train.project`, or continued by its id."""

    name = "mlflow"

    def __init__(self, train: TrainConfig, run_dir: Path, run_name: str, saved: dict, params: dict[str, Any],
                 log: logging.Logger):
        from mlflow import MlflowClient

        params = {k: str(v)[:MAX_PARAM_CHARS] for k, v in params.items()}  # MLflow params are strings

        self.uri, self.log = resolve_tracking_uri(train, run_dir), log
        if self.uri.startswith(("http://", "https://")):
            check_tracking_uri(train)  # again here: under torchrun or srun no lockstep CLI probed it before the workers
            _set_mlflow_http_defaults()
        self.client = MlflowClient(tracking_uri=self.uri)
        self.project = train.project
        same_store = saved.get("tracking_uri") == self.uri and saved.get("project") == self.project
        self.resumed = same_store and self._continue(saved.get("run_id"), params)
        if not self.resumed:
            self.run_id = self._create(train.project, run_dir, run_name, params, default_store=not train.tracking_uri)

    def _create(self, project: str, run_dir: Path, run_name: str, params: dict[str, str], default_store: bool) -> str:
        experiment = self.client.get_experiment_by_name(project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # the default store keeps its artifacts in the run directory too, not in the working directory
            location = (Path(run_dir) / "mlartifacts").resolve().as_uri() if default_store else None
            experiment_id = self.client.create_experiment(project, artifact_location=location)
        run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self._log_params(run_id, params)
        return run_id

    def _continue(self, run_id: str | None, params: dict[str, str]) -> bool:
        from mlflow.exceptions import MlflowException

        if not run_id:
            return False
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            self.log.warning("MLflow run %s of RUN/%s is not in %s: logging to a new run", run_id, TRACKERS_FILE,
                             self.uri)
            return False
        if run.info.lifecycle_stage == "deleted":
            return False
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")
        old = run.data.params
        # params are immutable in MLflow: keys new to this attempt are added, changed values become a tag
        self._log_params(run_id, {k: v for k, v in params.items() if k not in old})
        changed = [f"{k}={v}" for k, v in params.items() if k in old and old[k] != v]
        if changed:
            self.client.set_tag(run_id, "lockstep.changed_on_resume", ", ".join(changed)[:MAX_PARAM_CHARS])
        return True

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i:i + PARAMS_PER_BATCH])

    def note_start(self, start_step: int) -> None:
        if not (self.resumed and start_step > 0):
            return
        tags = self.client.get_run(self.run_id).data.tags
        resumes = [tags["lockstep.resumed_at"]] if "lockstep.resumed_at" in tags else []
        self.client.set_tag(self.run_id, "lockstep.resumed_at", ",".join([*resumes, str(start_step)]))
        later = sorted({m.step for m in self.client.get_metric_history(self.run_id, "train/loss") if m.step > start_step})
        if later:
            self.log.warning("MLflow run %s already has train steps %d-%d from the attempt before this resume at step %d: "
                             "MLflow keeps both values of those steps (this attempt's are the later ones by timestamp)",
                             self.run_id, later[0], later[-1], start_step)

    def log_values(self, step: int, values: dict[str, float], split: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"{split}/{k}", v, now, step) for k, v in values.items()])

    def log_file(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def log_final_model(self, path: Path, manifest: dict) -> None:
        self.client.set_tag(self.run_id, "lockstep.final_model", str(path))
        self.client.log_dict(self.run_id, manifest, "final_model.json")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)
        self.log.info("MLflow run %s (%s) in %s; browse with: mlflow ui --backend-store-uri %s", self.run_id, status,
                      self.uri, self.uri)

    def saved(self) -> dict:
        return {"tracking_uri": self.uri, "project": self.project, "run_id": self.run_id}


class WandbTracker:
    """One W&B run (offline by default: RUN/wandb/offline-run-*/, `wandb sync` uploads it later)."""

    name = "wandb"

    def __init__(self, train: TrainConfig, run_dir: Path, run_name: str, saved: dict, params: dict[str, Any],
                 log: logging.Logger):
        import wandb

        # console off: lockstep's own log lines are in RUN/logs; create_new: no process-global run to collide with
        settings = wandb.Settings(console="off", silent=True, reinit="create_new", init_timeout=30)
        run_id = saved.get("id") if saved.get("project") == train.project else None
        try:
            self.run = wandb.init(mode=train.wandb_mode, dir=str(run_dir), project=train.project, name=run_name,
                                  config=params, id=run_id, resume="allow", settings=settings)
        except Exception as e:  # wandb raises its own error types (login, network): the fix is the same
            raise ConfigError(f"wandb.init (train.wandb_mode = {train.wandb_mode!r}) failed: {_short(e)}; run "
                              "`wandb login` for online mode, or set train.wandb_mode=offline") from None
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
        self.log.info("W&B run %s (%s) in %s%s", self.run.id, status, folder,
                      f"; upload with: wandb sync {folder}" if offline else "")

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
            except Exception as e:  # a tracker must never stop training: metrics.jsonl has the values
                self.items.remove(tracker)
                self.logger.warning("%s stopped working while %s (%s); training goes on without it, and metrics.jsonl "
                                    "has every value", tracker.name, what, _short(e))

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
        files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
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
            items.append(kind(cfg.train, run_dir, run_dir.resolve().name, saved.get(name, {}), params, log))
        except ConfigError:
            raise
        except Exception as e:  # the store could not be opened: the run has not started, so it stops here
            raise ConfigError(f"train.report_to: {name} could not start ({_short(e)}); check train.tracking_uri "
                              f"= {cfg.train.tracking_uri!r}, or drop {name} from train.report_to") from None
    saved.update({t.name: t.saved() for t in items})
    saved_path.write_text(json.dumps(saved, indent=2) + "\n")
    log.info("trackers: %s", ", ".join(f"{t.name} {t.saved()}" for t in items))
    return Trackers(items, log)


def build_metrics_writer(train: TrainConfig, run_dir: Path, is_main: bool, total_steps: int, start_step: int,
                         trackers: Trackers | None) -> MetricsWriter:
    """The loop's MetricsWriter: metrics.jsonl, TensorBoard if train.report_to names it, and the trackers."""
    if trackers:
        trackers.note_start(start_step)
    return MetricsWriter(run_dir, is_main, total_steps, start_step,
                         tensorboard="tensorboard" in check_trackers(train.report_to), sinks=[trackers] if trackers else [])


@contextlib.contextmanager
def _mlflow_http(knobs: dict[str, str], override: bool) -> Iterator[None]:
    """MLflow reads its HTTP retry knobs from the environment on every request; set them for a block."""
    before = {k: os.environ.get(k) for k in knobs}
    for k, v in knobs.items():
        if override or before[k] is None:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _set_mlflow_http_defaults() -> None:
    for k, v in RUN_HTTP.items():
        os.environ.setdefault(k, v)  # rank 0's process only; a user's own setting wins


def _short(e: BaseException | None) -> str:
    text = str(e).strip().splitlines()[0] if e is not None and str(e).strip() else ""
    text = text.split("Caused by ")[-1]  # MLflow wraps the connection error in a long sentence: its cause names it
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
