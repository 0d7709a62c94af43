"""lockstep/train/mlflow_tracker.py: the checks of an MLflow store, before any worker starts and
again on rank 0 at start (an sqlite store that cannot be written, the bounded probe of an
unreachable server, local stores that need no probe), and a store whose disk fills up mid-run: one
warning on the console, MLflow's own traceback in the rank log."""

from __future__ import annotations

import logging
import os
import time

import pytest
from conftest import TINY, run_main
from tmpfs import read_only, tmpfs

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.metrics import MetricsWriter, read_metrics
from lockstep.rank_logs import init_rank_logging
from lockstep.train.mlflow_tracker import PROBE_HTTP, check_tracking_uri
from lockstep.train.trackers import open_trackers

from .tiny import drop_log_handlers

mlflow = pytest.importorskip("mlflow")
LOG = logging.getLogger("lockstep.test")


def test_an_sqlite_store_that_cannot_be_written_is_refused_before_mlflow_retries_it(tmp_path):
    """MLflow retries opening such a store 10 times with backoff (about 100 s) before it gives up:
    the refusal comes from lockstep's own probe (its message), before MLflow is handed the URI."""
    with tmpfs(tmp_path / "mnt", "size=1m") as mnt:
        read_only(mnt)
        store = mnt / "mlflow.db"
        uri = f"sqlite:///{store}"
        cfg = load_config(None, {"train.report_to": "mlflow", "train.tracking_uri": uri})
        want = (
            f"the MLflow store {store} (train.tracking_uri = {uri!r}) cannot be written: "
            "Read-only file system (its filesystem is mounted read-only); point "
            "train.tracking_uri at a writable directory"
        )
        with pytest.raises(ConfigError) as e:
            check_tracking_uri(cfg.train)  # the CLI, before any worker starts
        assert str(e.value).startswith(want), str(e.value)
        # rank 0 at start, where no CLI checked (torchrun, srun)
        with pytest.raises(ConfigError) as e:
            open_trackers(cfg, tmp_path / "run", is_main=True, log=LOG)
        assert str(e.value).startswith(want) and not store.exists()
    # a file where the directory should be: no mount needed
    (tmp_path / "file").write_text("")
    uri = f"sqlite:///{tmp_path}/file/m.db"
    cfg = load_config(None, {"train.report_to": "mlflow", "train.tracking_uri": uri})
    with pytest.raises(ConfigError, match=r"the MLflow store .*/file/m.db \(train.tracking_uri = "):
        check_tracking_uri(cfg.train)


def test_the_cli_refuses_an_sqlite_store_on_a_read_only_filesystem_in_one_line(
    tmp_path, corpus, token_cache, capsys
):
    """Refused by the launching command in one line, before any worker starts: MLflow alone would
    retry opening the store for about 100 s on rank 0."""
    with tmpfs(tmp_path / "mnt", "size=1m") as mnt:
        read_only(mnt)
        store, run = mnt / "mlflow.db", tmp_path / "run"
        uri = f"sqlite:///{store}"
        code, out, err = run_main(
            capsys,
            "train",
            "--data",
            corpus,
            "--output-dir",
            run,
            *TINY,
            "--global-batch-size",
            "8",
            "--max-steps",
            "2",
            "--save-interval",
            "2",
            "--set",
            f"data.cache_dir={token_cache}",
            "--world-size",
            "2",
            "--set",
            "train.report_to=mlflow",
            "--set",
            f"train.tracking_uri={uri}",
        )
    assert code == 2 and "Traceback" not in err, err[-3000:]
    [line] = [line for line in err.splitlines() if line.strip()]
    assert line.startswith(
        f"lockstep train: error: the MLflow store {store} (train.tracking_uri = "
        f"{uri!r}) cannot be written: Read-only file system"
    ), line
    assert "starting 2 workers" not in out and not (run / "metrics.jsonl").exists()


def test_a_store_whose_disk_fills_up_mid_run_warns_once_with_the_traceback_in_the_rank_log(
    tmp_path, capfd
):
    run = tmp_path / "run"
    log = init_rank_logging(run, 0, True)  # the real console and rank-log handlers
    try:
        with tmpfs(tmp_path / "mnt", "size=4m") as mnt:
            uri = f"sqlite:///{mnt}/m.db"
            cfg = load_config(None, {"train.report_to": "mlflow", "train.tracking_uri": uri})
            trackers = open_trackers(cfg, run, is_main=True, log=log)
            with MetricsWriter(
                run, True, 4, tensorboard=False, progress=False, sinks=[trackers]
            ) as writer:
                writer.log(1, {"loss": 3.0})
                with open(mnt / "filler", "wb") as f, pytest.raises(OSError, match="No space"):
                    while True:
                        f.write(bytes(1 << 16))
                for step in (2, 3, 4):
                    many = {f"metric_{i}": i for i in range(50)}
                    writer.log(step, {"loss": 3.0 - step / 10, **many})
            assert not trackers  # dropped at step 2
    finally:
        drop_log_handlers()
    # this process's stderr: lockstep's console handler and MLflow's own stream
    lines = capfd.readouterr().err.splitlines()
    warnings = [line for line in lines if "WARNING" in line or "ERROR" in line]
    assert warnings == [line for line in lines if "mlflow stopped working" in line], lines
    assert (
        len(warnings) == 1
        and (
            "while logging train step 2 (MlflowException: sqlite3.OperationalError: database or "
            "disk is full); training goes on without it"
        )
        in warnings[0]
    ), lines
    assert not [line for line in lines if "Traceback" in line or "[SQL:" in line], lines
    rank_log = (run / "logs" / "rank0.log").read_text()
    assert "Traceback (most recent call last)" in rank_log
    assert "sqlite3.OperationalError: database or disk is full" in rank_log
    assert warnings[0].split("WARNING ")[1] in rank_log
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize("uri", ["http://127.0.0.1:9", "http://lockstep-no-such-host.invalid:5000"])
def test_an_unreachable_tracking_server_fails_fast_naming_the_uri(tmp_path, uri):
    cfg = load_config(
        None,
        {
            "train.report_to": "mlflow",
            "train.tracking_uri": uri,
            "checkpoint.output_dir": str(tmp_path),
        },
    )
    before = {k: os.environ.get(k) for k in PROBE_HTTP}
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        check_tracking_uri(cfg.train)
    assert time.monotonic() - start < 30  # a hang guard: MLflow's own retries would take minutes
    assert f"train.tracking_uri = {uri!r} does not answer" in str(
        e.value
    ) and "mlflow server" in str(e.value)
    # the probe's knobs do not leak into the run
    assert {k: os.environ.get(k) for k in PROBE_HTTP} == before
    # without the CLI's check, opening the tracker on rank 0 at start says the same, before any step
    with pytest.raises(ConfigError, match="does not answer"):
        open_trackers(cfg, tmp_path, is_main=True, log=LOG)


def test_the_cli_stops_before_any_worker_when_the_server_does_not_answer(
    tmp_path, corpus, token_cache, capsys
):
    run = tmp_path / "run"
    start = time.monotonic()
    code, out, err = run_main(
        capsys,
        "train",
        "--world-size",
        "2",
        "--data",
        corpus,
        "--output-dir",
        run,
        *TINY,
        "--max-steps",
        "2",
        "--global-batch-size",
        "8",
        "--set",
        f"data.cache_dir={token_cache}",
        "--set",
        "train.report_to=mlflow",
        "--set",
        "train.tracking_uri=http://127.0.0.1:9",
    )
    assert time.monotonic() - start < 60  # a hang guard: MLflow's own retries take minutes
    assert code != 0
    assert "train.tracking_uri = 'http://127.0.0.1:9' does not answer" in err
    assert "starting 2 workers" not in out and not (run / "metrics.jsonl").exists()


def test_local_stores_need_no_server_probe(tmp_path):
    uri = f"sqlite:///{tmp_path / 'x.db'}"
    cfg = load_config(None, {"train.report_to": "mlflow", "train.tracking_uri": uri})
    check_tracking_uri(cfg.train)  # a writable place for the file, opened at start
    assert list(tmp_path.iterdir()) == []  # the writability probe leaves nothing behind
    tensorboard_only = {
        "train.report_to": "tensorboard",
        "train.tracking_uri": "http://127.0.0.1:9",
    }
    check_tracking_uri(load_config(None, tensorboard_only).train)
