"""A worker's failure recorded for the launcher (lockstep/runtime/failures.py): the error file torch's
agent reads, the ranks described in the order they raised, and a real launch in which the rank that
raised first exits last. The same through `lockstep train`: tests/e2e/test_stop_messages.py."""

from __future__ import annotations

import json
import signal
import textwrap

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from lockstep.launch.elastic import WorkerFailed, launch_workers
from lockstep.runtime.failures import (
    ERROR_FILE_ENV,
    describe_exit,
    describe_failures,
    record_failure,
)
from lockstep.runtime.watchdog import HANG_EXIT_CODE


def test_describe_exit():
    assert describe_exit(3, 1) == "rank 3 exited with an error (exit code 1)"
    # elastic reports signal N as -N
    assert describe_exit(0, -signal.SIGKILL) == "rank 0 was killed by SIGKILL"
    assert describe_exit(0, -200) == "rank 0 was killed by signal 200"
    assert describe_exit(1, HANG_EXIT_CODE) == (
        f"rank 1 was stopped by the hang watchdog (exit code {HANG_EXIT_CODE}; "
        "see the run's hang/report.txt)"
    )


def _failure(tmp_path, monkeypatch, rank: int, exitcode: int, error=None) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    if error is not None:
        monkeypatch.setenv(ERROR_FILE_ENV, str(path))
        try:
            raise error
        except Exception as e:
            record_failure(e)
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_the_record_is_torchs_error_file_with_the_time_to_the_microsecond(tmp_path, monkeypatch):
    failure = _failure(tmp_path, monkeypatch, 0, 1, ValueError("bad shape\nsecond line"))
    # torch's agent reads it as it reads its own ErrorHandler's
    assert failure.message["message"] == "ValueError: bad shape\nsecond line"
    extra = json.loads((tmp_path / "error0.json").read_text())["message"]["extraInfo"]
    assert failure.timestamp == int(extra["raised_at"]) > 1.7e9
    assert (
        "raise error" in extra["py_callstack"] and "ValueError: bad shape" in extra["py_callstack"]
    )
    assert describe_failures({0: failure}) == (
        "rank 0 failed first (ValueError: bad shape) and exited with an error (exit code 1)"
    )


def test_the_rank_that_raised_first_is_named_first_whatever_its_rank(tmp_path, monkeypatch):
    first = _failure(tmp_path, monkeypatch, 2, -signal.SIGTERM, RuntimeError("simulated crash"))
    echo = _failure(tmp_path, monkeypatch, 0, 1, RuntimeError("Connection closed by peer"))
    quiet = _failure(tmp_path, monkeypatch, 1, -signal.SIGKILL)  # no record: killed
    assert describe_failures({0: echo, 1: quiet, 2: first}) == (
        "rank 2 failed first (RuntimeError: simulated crash) and was killed by SIGTERM; "
        "rank 0 exited with an error (exit code 1); rank 1 was killed by SIGKILL"
    )
    # without any record: every rank as it ended, in rank order
    assert describe_failures({1: quiet}) == "rank 1 was killed by SIGKILL"


def test_a_long_message_is_cut_and_an_empty_one_named(tmp_path, monkeypatch):
    long = _failure(tmp_path, monkeypatch, 0, 1, RuntimeError("x" * 500))
    # 200 characters of it, the last three dots
    assert describe_failures({0: long}) == (
        f"rank 0 failed first (RuntimeError: {'x' * 183}...) and exited with an error (exit code 1)"
    )
    empty = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(tmp_path / "e.json"))
    empty.error_file_data = {"message": {"message": "  ", "extraInfo": {"raised_at": 1.0}}}
    empty.message = empty.error_file_data["message"]
    assert describe_failures({1: empty}).startswith("rank 1 failed first (an error) and exited")


def test_no_agent_no_file_and_an_unwritable_one_is_no_error(tmp_path, monkeypatch):
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    record_failure(RuntimeError("no agent"))  # nothing to write to
    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "gone" / "error.json"))
    record_failure(RuntimeError("agent's folder removed"))
    assert list(tmp_path.iterdir()) == []


WORKER = """
import os, sys, time
from lockstep.runtime.failures import record_failure

if os.environ["RANK"] == "1":  # raises first, then is slow to leave (writing its logs)
    record_failure(RuntimeError("simulated crash in forward call 9"))
    time.sleep(60)
    sys.exit(1)
time.sleep(0.5)  # its peer's failure reaches it, and it leaves at once
record_failure(RuntimeError("Connection closed by peer"))
sys.exit(1)
"""


def test_a_real_launch_names_the_rank_that_raised_first_though_it_exits_last(tmp_path, monkeypatch):
    (tmp_path / "lockstep_fails_first.py").write_text(textwrap.dedent(WORKER))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the workers inherit it
    with pytest.raises(WorkerFailed) as info:
        launch_workers(["lockstep_fails_first"], 2)
    # torch's agent saw rank 0 end first and stopped rank 1 with SIGTERM
    assert info.value.failed == (
        "rank 1 failed first (RuntimeError: simulated crash in forward call 9) and was killed by "
        "SIGTERM; rank 0 exited with an error (exit code 1)"
    )
