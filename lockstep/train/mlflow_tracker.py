"""MLflow, one of the experiment trackers of lockstep.train.trackers: where its store is
(resolve_tracking_uri), the checks that fail a run within seconds on a server that does not answer
or an sqlite store that cannot be written (check_tracking_uri, check_sqlite_store), the run itself
(MlflowTracker, through `mlflow.MlflowClient`), and MLflow's HTTP retry knobs while probing and
during the run.

Seen with a real `mlflow server` killed at step 38 of 300: one warning, the failing call cost
rank 0 3.4 s (RUN_HTTP below), the run finished with all 300 steps in metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lockstep.config import TrainConfig, check_trackers
from lockstep.errors import ConfigError
from lockstep.rank_logs import route_library_logs

# in the run directory: each tracker's run id, for a resumed run to continue (written by
# lockstep.train.trackers.open_trackers; defined here, below it, because MlflowTracker names it)
TRACKERS_FILE = "trackers.json"
# MLflow's HTTP knobs while probing a server: one try, a short timeout (its defaults, 7 retries
# with exponential backoff and 120 s per request, take minutes to say that a server is down)
PROBE_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
# a name that does not resolve is outside requests' timeout: the probe thread is bounded too
PROBE_SECONDS = 15.0
# during the run, unless the user set them: a server that goes away costs rank 0 seconds once
# (refused: ~3 s; a silent host: 3 tries x 10 s), then the tracker is dropped, instead of minutes
# per call while the other ranks wait
RUN_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
PARAMS_PER_BATCH = 100  # MLflow's limit on params in one log_batch
# the loggers MLflow gives its own console handler (mlflow.utils.logging_utils): a store failing
# mid-run logs a traceback through them, which belongs in the rank log beside lockstep's warning
MLFLOW_LOGGERS = ("mlflow", "sqlalchemy.engine", "alembic")


def resolve_tracking_uri(train: TrainConfig, run_dir: Path) -> str:
    """train.tracking_uri as given, or a sqlite file in the run directory (its artifacts in
    RUN/mlartifacts)."""
    return train.tracking_uri or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


def check_sqlite_store(uri: str) -> None:
    """An sqlite store that cannot be written fails here at once: MLflow itself retries opening
    it 10 times with exponential backoff, about 100 s, before it says "unable to open database
    file"."""
    name = uri.removeprefix("sqlite:///").split("?")[0]
    if not uri.startswith("sqlite:///") or name in ("", ":memory:"):
        return
    path = Path(name)
    try:
        # as MLflow would: sqlite makes no directories
        path.parent.mkdir(parents=True, exist_ok=True)
        # sqlite writes its journal beside the file
        fd, probe = tempfile.mkstemp(prefix=".lockstep-probe-", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
        if path.exists():
            path.open("r+b").close()
    except OSError as e:
        ro = " (its filesystem is mounted read-only)" if e.errno == errno.EROFS else ""
        raise ConfigError(
            f"the MLflow store {path} (train.tracking_uri = {uri!r}) cannot be written: "
            f"{e.strerror or e}{ro}; point train.tracking_uri at a writable directory "
            "(sqlite:////abs/dir/mlflow.db), leave it unset to log into RUN/mlflow.db, or drop "
            "mlflow from train.report_to"
        ) from None


def check_tracking_uri(train: TrainConfig) -> None:
    """An MLflow tracking server that does not answer, or an sqlite store that cannot be written,
    fails here within seconds, before any worker starts."""
    uri = train.tracking_uri
    if not uri or "mlflow" not in check_trackers(train.report_to):
        return  # the default RUN/mlflow.db: checked with the run directory
    if uri.startswith("sqlite:"):
        check_sqlite_store(uri)
        return
    if not uri.startswith(("http://", "https://")):
        return  # another local store: opened (and its errors reported) at start
    outcome: list[BaseException | None] = []

    def probe() -> None:
        from mlflow import MlflowClient

        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
            outcome.append(None)
        except Exception as e:  # any failure: rank 0 could not log there; the message says which
            outcome.append(e)

    with _mlflow_http(PROBE_HTTP, override=True):
        thread = threading.Thread(target=probe, name="lockstep-mlflow-probe", daemon=True)
        thread.start()
        thread.join(PROBE_SECONDS)
    if outcome == [None]:
        return
    reason = short_error(outcome[0]) if outcome else f"no answer within {PROBE_SECONDS:.0f} s"
    raise ConfigError(
        f"train.tracking_uri = {uri!r} does not answer ({reason}); the MLflow tracking server "
        "must be reachable from global rank 0 when training starts. Start it (mlflow server "
        "--host 0.0.0.0 --port 5000), fix the URI, or leave train.tracking_uri unset to log into "
        "RUN/mlflow.db (or drop mlflow from train.report_to)"
    )


class MlflowTracker:
    """One MLflow run: created in the experiment `train.project`, or continued by its id."""

    name = "mlflow"

    def __init__(
        self,
        train: TrainConfig,
        run_dir: Path,
        run_name: str,
        saved: dict,
        params: dict[str, Any],
        log: logging.Logger,
    ):
        from mlflow import MlflowClient

        # MLflow params are strings
        params = {k: str(v)[:MAX_PARAM_CHARS] for k, v in params.items()}

        # after the import, which installs MLflow's console handler
        route_library_logs(MLFLOW_LOGGERS)
        self.uri, self.log = resolve_tracking_uri(train, run_dir), log
        # also the default RUN/mlflow.db: a rank under torchrun or srun had no CLI check
        check_sqlite_store(self.uri)
        if self.uri.startswith(("http://", "https://")):
            # again here: under torchrun or srun no lockstep CLI probed it before the workers
            check_tracking_uri(train)
            _set_mlflow_http_defaults()
        self.client = MlflowClient(tracking_uri=self.uri)
        self.project = train.project
        same_store = saved.get("tracking_uri") == self.uri and saved.get("project") == self.project
        self.resumed = same_store and self._continue(saved.get("run_id"), params)
        if not self.resumed:
            self.run_id = self._create(
                train.project, run_dir, run_name, params, default_store=not train.tracking_uri
            )

    def _create(
        self,
        project: str,
        run_dir: Path,
        run_name: str,
        params: dict[str, str],
        default_store: bool,
    ) -> str:
        experiment = self.client.get_experiment_by_name(project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            # the default store keeps its artifacts in the run directory too, not in the working
            # directory
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
            self.log.warning(
                "MLflow run %s of RUN/%s is not in %s: logging to a new run",
                run_id,
                TRACKERS_FILE,
                self.uri,
            )
            return False
        if run.info.lifecycle_stage == "deleted":
            return False
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")
        old = run.data.params
        # params are immutable in MLflow: keys new to this attempt are added, changed values become
        # a tag
        self._log_params(run_id, {k: v for k, v in params.items() if k not in old})
        changed = [f"{k}={v}" for k, v in params.items() if k in old and old[k] != v]
        if changed:
            self.client.set_tag(
                run_id, "lockstep.changed_on_resume", ", ".join(changed)[:MAX_PARAM_CHARS]
            )
        return True

    def _log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i : i + PARAMS_PER_BATCH])

    def note_start(self, start_step: int) -> None:
        if not (self.resumed and start_step > 0):
            return
        tags = self.client.get_run(self.run_id).data.tags
        resumes = [tags["lockstep.resumed_at"]] if "lockstep.resumed_at" in tags else []
        self.client.set_tag(
            self.run_id, "lockstep.resumed_at", ",".join([*resumes, str(start_step)])
        )
        later = sorted(
            {
                m.step
                for m in self.client.get_metric_history(self.run_id, "train/loss")
                if m.step > start_step
            }
        )
        if later:
            self.log.warning(
                "MLflow run %s already has train steps %d-%d from the attempt before this resume "
                "at step %d: MLflow keeps both values of those steps (this attempt's are the later "
                "ones by timestamp)",
                self.run_id,
                later[0],
                later[-1],
                start_step,
            )

    def log_values(self, step: int, values: dict[str, float], split: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(f"{split}/{k}", v, now, step) for k, v in values.items()]
        )

    def log_file(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def log_final_model(self, path: Path, manifest: dict) -> None:
        self.client.set_tag(self.run_id, "lockstep.final_model", str(path))
        self.client.log_dict(self.run_id, manifest, "final_model.json")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)
        self.log.info(
            "MLflow run %s (%s) in %s; browse with: mlflow ui --backend-store-uri %s",
            self.run_id,
            status,
            self.uri,
            self.uri,
        )

    def saved(self) -> dict:
        return {"tracking_uri": self.uri, "project": self.project, "run_id": self.run_id}


@contextlib.contextmanager
def _mlflow_http(knobs: dict[str, str], override: bool) -> Iterator[None]:
    """MLflow reads its HTTP retry knobs from the environment on every request; set them for a
    block."""
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


def short_error(e: BaseException | None) -> str:
    """An exception in one line, for a warning or a ConfigError: its type and the first line of its
    message, or the sqlite3 error at the root of its causes."""
    root = e
    while root is not None and root.__cause__ is not None:
        root = root.__cause__
    # MLflow's message leads with SQLAlchemy's advice; the driver's error says what happened
    if isinstance(root, sqlite3.Error) and root is not e:
        return f"{type(e).__name__}: sqlite3.{type(root).__name__}: {root}"
    text = str(e).strip().splitlines()[0] if e is not None and str(e).strip() else ""
    # MLflow wraps the connection error in a long sentence: its cause names it
    text = text.split("Caused by ")[-1]
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
