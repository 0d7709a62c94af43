"""A run directory on a read-only filesystem, through the CLI: a fresh run, a resume after the filesystem turned
read-only, and a rank's first write all stop with one line (the directory, why, what to do), no traceback. The
checks themselves: tests/unit/test_run_dir.py; a checkpoint save: tests/unit/checkpoint/test_commit.py.

We run as root, and root ignores permissions: the directory is a real read-only mount (tmpfs), skipped with
the reason where this machine lets us mount none.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import TINY, run_lockstep
from lockstep.checkpoint.commit import list_checkpoints
from lockstep.errors import ConfigError
from lockstep.metrics import init_rank_logging
from tmpfs import read_only, tmpfs


@pytest.fixture
def mount(tmp_path):
    """A fresh tmpfs at tmp_path/mnt, writable until `read_only(mnt)`; unmounted afterwards."""
    with tmpfs(tmp_path / "mnt") as mnt:
        yield mnt


def _train(run: Path, corpus: Path, cache: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), "--output-dir", str(run), *TINY, "--global-batch-size", "8", "--max-steps", "2",
            "--save-interval", "2", "--set", f"data.cache_dir={cache}", *extra]


def _one_line_error(proc: subprocess.CompletedProcess, run: Path) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith(f"lockstep train: error: run directory {run} cannot be written: Read-only file system"), line
    assert line.endswith("its filesystem is mounted read-only: remount it read-write, or pass another --output-dir "
                         "(checkpoint.output_dir)"), line
    return line


@pytest.mark.parametrize("world", ["1", "2"])
def test_fresh_run_into_a_read_only_directory(mount, corpus, token_cache, world):
    read_only(mount)
    run = mount / "run"
    proc = run_lockstep(*_train(run, corpus, token_cache, "--world-size", world), check=False, timeout=120)
    _one_line_error(proc, run)
    assert "starting 2 workers" not in proc.stdout  # stopped before any worker started


@pytest.mark.slow  # trains, then resumes
def test_resume_after_the_filesystem_turned_read_only(mount, corpus, token_cache):
    run = mount / "run"
    run_lockstep(*_train(run, corpus, token_cache))
    assert [c.name for c in list_checkpoints(run)] == ["step_00000002"]
    read_only(mount)
    proc = run_lockstep(*_train(run, corpus, token_cache, "--max-steps", "4"), check=False, timeout=120)
    _one_line_error(proc, run)


def test_a_ranks_first_write(mount, corpus, token_cache):
    """Under a launcher the CLI leaves the check to each rank: its first write (the log) says it, in one line."""
    run = mount / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank0.log").write_text("an earlier attempt\n")  # appended to, normally
    read_only(mount)
    with pytest.raises(ConfigError, match=f"run directory {run} cannot be written: Read-only file system"):
        init_rank_logging(run, 0, True)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "read-only-test"}
    proc = run_lockstep(*_train(run, corpus, token_cache), env=env, check=False, timeout=120)
    line = _one_line_error(proc, run)
    assert f"({run / 'logs' / 'rank0.log'})" in line


def test_an_mlflow_store_on_a_read_only_filesystem(mount, tmp_path, corpus, token_cache):
    """Refused by the launching command in one line, before any worker starts: MLflow alone would
    retry opening the store for about 100 s on rank 0."""
    read_only(mount)
    store, run = mount / "mlflow.db", tmp_path / "run"
    uri = f"sqlite:///{store}"
    args = _train(run, corpus, token_cache, "--world-size", "2", "--set", "train.report_to=mlflow",
                  "--set", f"train.tracking_uri={uri}")
    proc = run_lockstep(*args, check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith(f"lockstep train: error: the MLflow store {store} (train.tracking_uri = "
                           f"{uri!r}) cannot be written: Read-only file system"), line
    assert "starting 2 workers" not in proc.stdout and not (run / "metrics.jsonl").exists()
