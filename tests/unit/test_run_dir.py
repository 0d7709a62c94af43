"""lockstep/run_dir.py on real directories: a run dir is created and probed, and one that cannot be written (a
read-only mount, a full disk, a file in the way) stops with the directory, the reason and the fix. Runs into a
read-only directory through the CLI: here, and tests/e2e/test_read_only.py."""

from __future__ import annotations

import errno
import os
import re

import pytest
from conftest import TINY, run_main
from tmpfs import read_only, tmpfs

from lockstep.errors import ConfigError
from lockstep.run_dir import check_run_dir_writable, unwritable_error, unwritable_fix

ELSEWHERE = "or pass another --output-dir (checkpoint.output_dir)"


def test_a_writable_run_dir_is_created_and_left_as_it_was(tmp_path):
    run = tmp_path / "runs" / "a"
    check_run_dir_writable(run)
    assert run.is_dir() and list(run.iterdir()) == []  # the probe file is gone again
    (run / "metrics.jsonl").write_text("{}\n")
    check_run_dir_writable(run)  # an existing run dir: its files untouched
    assert [p.name for p in run.iterdir()] == ["metrics.jsonl"]


def test_a_read_only_mount(tmp_path):
    with tmpfs(tmp_path / "mnt") as mnt:
        (mnt / "existing").mkdir()
        read_only(mnt)
        reason = (
            "; a run writes its logs, metrics and checkpoints there (a resume too); its filesystem is mounted "
            f"read-only: remount it read-write, {ELSEWHERE}"
        )
        with pytest.raises(ConfigError) as e:  # its parent cannot be made
            check_run_dir_writable(mnt / "new" / "run")
        assert str(e.value) == (
            f"run directory {mnt / 'new' / 'run'} cannot be written: Read-only file system "
            f"({mnt / 'new'}){reason}"
        )
        with pytest.raises(
            ConfigError,
            match=rf"^run directory {mnt / 'existing'} cannot be written: Read-only file "
            rf"system \({mnt / 'existing'}/\.lockstep-write-check-\w+\)"
            rf"{re.escape(reason)}$",
        ):  # it exists: the probe file in it fails
            check_run_dir_writable(mnt / "existing")


def one_line_error(code: int, err: str, run) -> str:
    """`lockstep train`'s refusal of a run directory on a read-only mount: exit 2, one line."""
    assert code == 2 and "Traceback" not in err, err[-3000:]
    [line] = [line for line in err.splitlines() if line.strip()]
    assert line.startswith(
        f"lockstep train: error: run directory {run} cannot be written: Read-only file system"
    ), line
    assert line.endswith(
        "its filesystem is mounted read-only: remount it read-write, or pass "
        "another --output-dir (checkpoint.output_dir)"
    ), line
    return line


@pytest.mark.parametrize("world", ["1", "2"])
def test_the_cli_refuses_a_fresh_run_into_a_read_only_directory(
    tmp_path, corpus, token_cache, world, capsys
):
    with tmpfs(tmp_path / "mnt") as mnt:
        read_only(mnt)
        run = mnt / "run"
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
            world,
        )
        one_line_error(code, err, run)
        assert "starting 2 workers" not in out  # stopped before any worker started


def test_a_full_disk(tmp_path):
    with tmpfs(tmp_path / "mnt", "size=1m,nr_inodes=8") as mnt:
        run = mnt / "run"
        run.mkdir()
        with pytest.raises(OSError) as full:  # every inode taken
            for i in range(100):
                (mnt / f"f{i}").touch()
        assert full.value.errno == errno.ENOSPC
        with pytest.raises(
            ConfigError,
            match=rf"^run directory {run} cannot be written: No space left on device "
            rf"\({run}/\.lockstep-write-check-\w+\); .* the disk is full: free "
            rf"space there, {re.escape(ELSEWHERE)}$",
        ):
            check_run_dir_writable(run)


def test_a_file_where_the_run_dir_should_be(tmp_path):
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(ConfigError) as e:
        check_run_dir_writable(tmp_path / "taken" / "run")
    assert str(e.value).startswith(
        f"run directory {tmp_path / 'taken' / 'run'} cannot be written: "
    )
    # no fix of its own
    assert str(e.value).endswith(f"; check that the directory can be written, {ELSEWHERE}")


def test_the_errors_a_user_can_fix():
    fixes = {
        code: unwritable_fix(OSError(code, os.strerror(code)))
        for code in (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO)
    }
    assert fixes == {
        errno.EROFS: f"its filesystem is mounted read-only: remount it read-write, {ELSEWHERE}",
        errno.ENOSPC: f"the disk is full: free space there, {ELSEWHERE}",
        errno.EDQUOT: f"the disk quota is used up: free space there, {ELSEWHERE}",
        errno.EACCES: f"this user may not write there: change its permissions, {ELSEWHERE}",
        errno.EPERM: f"this user may not write there: change its permissions, {ELSEWHERE}",
        errno.EIO: None,  # a failing disk: nothing the user can do about it here
    }
    log = "/runs/a/logs/rank3.log"
    error = unwritable_error("/runs/a", OSError(errno.EACCES, "Permission denied", log))
    assert isinstance(error, ConfigError) and str(error) == (
        f"run directory /runs/a cannot be written: Permission denied ({log}); a run writes its logs, metrics and "
        f"checkpoints there (a resume too); this user may not write there: change its permissions, {ELSEWHERE}"
    )
