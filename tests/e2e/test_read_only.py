"""A run directory on a read-only filesystem, through the CLI: a resume after the filesystem
turned read-only stops with one line (the directory, why, what to do), no traceback. The checks
themselves, and the refusals that need no training first, in-process (a fresh run:
tests/unit/test_run_dir.py; a rank's first write: tests/unit/test_metrics.py; an MLflow store:
tests/unit/train/test_mlflow_tracker.py); a checkpoint save: tests/unit/checkpoint/test_commit.py.

We run as root, and root ignores permissions: the directory is a real read-only mount (tmpfs), skipped with
the reason where this machine lets us mount none.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import TINY, run_lockstep
from tmpfs import read_only, tmpfs

from lockstep.checkpoint.commit import list_checkpoints


@pytest.fixture
def mount(tmp_path):
    """A fresh tmpfs at tmp_path/mnt, writable until `read_only(mnt)`; unmounted afterwards."""
    with tmpfs(tmp_path / "mnt") as mnt:
        yield mnt


def _train(run: Path, corpus: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(corpus),
        "--output-dir",
        str(run),
        *TINY,
        "--global-batch-size",
        "8",
        "--max-steps",
        "2",
        "--save-interval",
        "2",
        "--set",
        f"data.cache_dir={cache}",
        *extra,
    ]


def _one_line_error(proc: subprocess.CompletedProcess, run: Path) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith(
        f"lockstep train: error: run directory {run} cannot be written: Read-only file system"
    ), line
    assert line.endswith(
        "its filesystem is mounted read-only: remount it read-write, or pass another --output-dir "
        "(checkpoint.output_dir)"
    ), line
    return line


@pytest.mark.slow  # trains, then resumes
def test_resume_after_the_filesystem_turned_read_only(mount, corpus, token_cache):
    run = mount / "run"
    run_lockstep(*_train(run, corpus, token_cache))
    assert [c.name for c in list_checkpoints(run)] == ["step_00000002"]
    read_only(mount)
    proc = run_lockstep(
        *_train(run, corpus, token_cache, "--max-steps", "4"), check=False, timeout=120
    )
    _one_line_error(proc, run)
