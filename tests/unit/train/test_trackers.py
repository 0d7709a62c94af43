"""lockstep/train/trackers.py: MLflow and W&B runs written through the libraries and read back with their own APIs
(MlflowClient on the sqlite store; W&B's offline transaction log parsed into its own protobuf records), a resumed
run continuing the same runs, a tracker failing mid-run, and check_trackers (lockstep.config) on unknown names
and missing packages. The checks of an MLflow store: test_mlflow_tracker.py."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from lockstep.config import check_trackers, load_config
from lockstep.errors import ConfigError, DataError
from lockstep.metrics import MetricsWriter, read_metrics
from lockstep.tools.final import write_final_outputs
from lockstep.train.mlflow_tracker import resolve_tracking_uri
from lockstep.train.trackers import TRACKERS_FILE, Trackers, build_metrics_writer, open_trackers

from .tiny import tiny_config, train

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")
LOG = logging.getLogger("lockstep.test")


# ----------------------------------------------------------------------------- readers


def wandb_records(run_dir: Path) -> list:
    """Every record of the W&B offline runs in RUN/wandb, oldest run first, as wandb's own protobuf Records.

    The .wandb file is a LevelDB-format log (32 KiB blocks, 7-byte chunk headers) after a 7-byte ':W&B' header;
    wandb 0.31 ships no Python reader for it, only the Record message.
    """
    from wandb.proto import wandb_internal_pb2

    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, chunks, pending = path.read_bytes(), 7, [], b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind == 1:  # full
                chunks.append(chunk)
            elif kind in (2, 3):  # first, middle
                pending = (pending if kind == 3 else b"") + chunk
            elif kind == 4:  # last
                chunks.append(pending + chunk)
        out += [wandb_internal_pb2.Record.FromString(c) for c in chunks]
    return out


def wandb_history(records: list) -> list[dict]:
    return [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def mlflow_client(run: Path):
    return mlflow.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")


# ----------------------------------------------------------------------------- a real run, then its resume


def test_a_run_and_its_resume_log_the_same_values_to_mlflow_and_wandb(
    tmp_path, corpus, token_cache
):
    run = tmp_path / "run"
    trackers = {
        "train.report_to": "tensorboard,mlflow,wandb",
        "checkpoint.save_interval": 2,
        "train.plots": True,
    }  # commits steps 2, 3
    cfg = tiny_config(run, corpus, token_cache, **trackers)
    result = train(cfg)
    # adds the final model's path (here: the last checkpoint) and closes them
    write_final_outputs(cfg, result, LOG)

    saved = json.loads((run / TRACKERS_FILE).read_text())
    run_id, wandb_id = saved["mlflow"]["run_id"], saved["wandb"]["id"]
    assert saved["mlflow"]["tracking_uri"] == resolve_tracking_uri(cfg.train, run)
    client = mlflow_client(run)
    mlrun = client.get_run(run_id)
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    assert client.get_experiment(mlrun.info.experiment_id).name == "lockstep"
    assert (
        mlrun.data.params["train.batch_size"] == "8"
        and mlrun.data.params["model.hidden_size"] == "32"
    )
    assert mlrun.data.params["train.report_to"] == "tensorboard,mlflow,wandb"
    rows = read_metrics(run / "metrics.jsonl")
    train_rows = [r for r in rows if r["split"] == "train"]
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in train_rows]
    assert [m.value for m in client.get_metric_history(run_id, "eval/loss")] == [
        r["loss"] for r in rows if r["split"] == "eval"
    ]
    assert {a.path for a in client.list_artifacts(run_id)} == {"loss.png", "final_model.json"}
    assert mlrun.data.tags["lockstep.final_model"] == str(result.checkpoint.resolve())
    assert (run / "mlartifacts" / run_id / "artifacts" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (run / "tensorboard").is_dir()  # still there beside them

    records = wandb_records(run)
    (first,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (first.run_id, first.project, first.display_name) == (wandb_id, "lockstep", "run")
    config = {item.key: json.loads(item.value_json) for item in first.config.update}
    assert (
        config["train.batch_size"] == 8
        and config["model.kind"] == "gpt"
        and config["train.peak_flops"] == 1e12
    )
    logged = [(h["step"], h["train/loss"]) for h in wandb_history(records) if "train/loss" in h]
    assert logged == [(r["step"], r["loss"]) for r in train_rows]
    files = {
        f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files
    }
    assert "loss.png" in files
    summary = {
        i.key: json.loads(i.value_json)
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for i in r.summary.update
        if i.key
    }
    assert summary["final_model"] == str(result.checkpoint.resolve())

    # resumed from step 2 (as after a crash that lost step 3's commit) to step 4: the same MLflow run and W&B run id;
    # step 3 is logged again, and both values stay in MLflow's history, this attempt's the later one
    step2 = run / "checkpoints" / "step_00000002"
    cfg4 = tiny_config(
        run,
        corpus,
        token_cache,
        **trackers,
        **{"train.max_steps": 4, "checkpoint.resume": str(step2)},
    )
    result = train(cfg4)
    write_final_outputs(cfg4, result, LOG)
    saved = json.loads((run / TRACKERS_FILE).read_text())
    assert saved["mlflow"]["run_id"] == run_id and saved["wandb"]["id"] == wandb_id
    # the superseded step 3 dropped
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "train"]
    history = sorted(
        client.get_metric_history(run_id, "train/loss"), key=lambda m: (m.step, m.timestamp)
    )
    assert [m.step for m in history] == [1, 2, 3, 3, 4]
    assert [(m.step, m.value) for m in history if m is not history[2]] == [
        (r["step"], r["loss"]) for r in rows
    ]
    mlrun = client.get_run(run_id)
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags["lockstep.resumed_at"] == "2"
    # params are immutable in MLflow: what the resume changed is a tag
    assert "train.max_steps=4" in mlrun.data.tags["lockstep.changed_on_resume"]
    records = wandb_records(run)
    assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} == {wandb_id}
    assert [h["step"] for h in wandb_history(records) if "train/loss" in h] == [1, 2, 3, 3, 4]
    assert (
        "already has train steps 3-3 from the attempt before this resume at step 2"
        in (run / "logs" / "rank0.log").read_text()
    )


def test_report_to_none_keeps_metrics_jsonl_only(tmp_path):
    cfg = load_config(None, {"train.report_to": "none", "checkpoint.output_dir": str(tmp_path)})
    trackers = open_trackers(cfg, tmp_path, is_main=True, log=LOG)
    with build_metrics_writer(cfg.train, tmp_path, True, 3, 0, trackers) as writer:
        writer.log(1, {"loss": 2.5})
    assert (
        not trackers
        and not (tmp_path / "tensorboard").exists()
        and not (tmp_path / TRACKERS_FILE).exists()
    )
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [2.5]
    # the default is TensorBoard alone, as before train.report_to existed
    default = load_config(None, {"checkpoint.output_dir": str(tmp_path / "b")})
    assert check_trackers(default.train.report_to) == ["tensorboard"]
    with build_metrics_writer(
        default.train, tmp_path / "b", True, 3, 0, open_trackers(default, tmp_path / "b", True, LOG)
    ):
        pass
    assert (tmp_path / "b" / "tensorboard").is_dir() and not (tmp_path / "b" / "mlflow.db").exists()


def test_only_rank_0_opens_trackers(tmp_path):
    cfg = load_config(None, {"train.report_to": "mlflow", "checkpoint.output_dir": str(tmp_path)})
    assert not open_trackers(cfg, tmp_path, is_main=False, log=LOG)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / TRACKERS_FILE).exists()


# ----------------------------------------------------------------------------- failures


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning(tmp_path, caplog):
    cfg = load_config(None, {"train.report_to": "mlflow", "checkpoint.output_dir": str(tmp_path)})
    trackers = open_trackers(cfg, tmp_path, is_main=True, log=LOG)
    run_id = json.loads((tmp_path / TRACKERS_FILE).read_text())["mlflow"]["run_id"]
    client = mlflow_client(tmp_path)
    with (
        caplog.at_level(logging.WARNING, logger=LOG.name),
        MetricsWriter(
            tmp_path, True, 4, tensorboard=False, progress=False, sinks=[trackers]
        ) as writer,
    ):
        writer.log(1, {"loss": 3.0})
        # the store now refuses the run's writes, as a server that lost it would
        client.delete_run(run_id)
        for step in (2, 3, 4):
            writer.log(step, {"loss": 3.0 - step / 10})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "mlflow stopped working while logging train step 2" in warnings[0]
    assert not trackers  # dropped: later steps cost nothing
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1]
    trackers.close()  # nothing left to close: no error


def test_check_trackers_names_the_valid_ones():
    assert check_trackers("tensorboard, mlflow,wandb") == ["tensorboard", "mlflow", "wandb"]
    assert check_trackers("none") == []
    with pytest.raises(
        ConfigError, match=r"'comet', which is not a tracker; valid: tensorboard, mlflow, wandb"
    ):
        check_trackers("tensorboard,comet")
    with pytest.raises(ConfigError, match="not a tracker"):
        load_config(None, {"train.report_to": "wandb,mlfow"})


def test_check_trackers_names_the_missing_package(tmp_path):
    """A Python without site-packages but lockstep's config's own needs: mlflow is really not importable there."""
    site = Path(sysconfig.get_paths()["purelib"])
    for name in ("yaml", "lockstep"):
        (tmp_path / name).symlink_to(
            site / name if name == "yaml" else Path(__file__).parents[3] / "lockstep"
        )
    code = (
        "from lockstep.config import check_trackers\n"
        "try:\n    check_trackers('mlflow')\nexcept Exception as e:\n    print(type(e).__name__, e)"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "ConfigError train.report_to names 'mlflow' but the mlflow package is not installed"
    )
    assert "pip install 'lockstep[mlflow]'" in proc.stdout


class KeptRecords:
    """A sink that is on and keeps (step, split, keys) of what it is handed."""

    def __init__(self):
        self.calls = []

    def log(self, step, values, split):
        self.calls.append((step, split, sorted(values)))


def test_the_metrics_writer_hands_trainjob_progress_its_records_only_inside_a_trainjob(tmp_path):
    from lockstep.train.trainjob_progress import TrainJobProgress

    train = load_config(None, {"train.report_to": "none"}).train
    kept = KeptRecords()
    with build_metrics_writer(train, tmp_path / "a", True, 4, 0, None, kept) as writer:
        writer.log(1, {"loss": 1.0})
        writer.log(1, {"loss": 1.5}, "eval")
    assert kept.calls == [(1, "train", ["eta_s", "loss"]), (1, "eval", ["loss"])]
    outside = TrainJobProgress(None, 4, LOG)  # no KUBEFLOW_TRAINER_SERVER_URL: off, and no sink
    with build_metrics_writer(train, tmp_path / "b", True, 4, 0, None, outside) as writer:
        assert writer._sinks == []


def test_trackers_without_items_do_nothing(tmp_path):
    empty = Trackers([], LOG)
    empty.log(1, {"loss": 1.0})
    empty.log_file(tmp_path / "missing.png")
    empty.close()
    assert not empty


def test_a_run_that_fails_at_setup_marks_its_mlflow_run_failed(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    cfg = tiny_config(
        run,
        corpus,
        token_cache,
        **{"train.report_to": "mlflow", "data.path": str(tmp_path / "none.txt")},
    )
    with pytest.raises(DataError, match="none.txt' does not exist"):
        train(cfg)
    run_id = json.loads((run / TRACKERS_FILE).read_text())["mlflow"]["run_id"]
    assert mlflow_client(run).get_run(run_id).info.status == "FAILED"
