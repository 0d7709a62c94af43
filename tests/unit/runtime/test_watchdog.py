"""The hang watchdog: a real 2-rank torchrun job that deadlocks, and the pieces that name the culprit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from procs import kill_tree

from lockstep.runtime import Runtime
from lockstep.runtime.watchdog import HANG_EXIT_CODE, Watchdog

WORKER = Path(__file__).parents[2] / "hang_worker.py"
STALL = 6.0
# From the moment rank 1 goes astray to the launcher's exit: the stall itself, a poll, the exchange of
# reports (normally < 1 s) and torchrun's teardown. Generous: the suite shares 2 busy cores.
MARGIN = 20.0


def marker_line(marker: str) -> int:
    """The line of the worker that carries `marker` (so editing the worker cannot break the test)."""
    lines = WORKER.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if f"# {marker}" in line)


def run_worker(run: Path, stall: float, *extra: str) -> tuple[subprocess.Popen, str, str, float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(WORKER),
        str(run),
        str(stall),
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
    )
    try:  # a watchdog that fails leaves a job that hangs for the 120 s group timeout: kill the whole tree
        out, err = proc.communicate(timeout=55)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(
            "the job did not end within 55 s: the watchdog did not stop it"
        ) from None
    return proc, out, err, time.time()


def test_rank_that_skips_a_collective_is_named_with_its_line(tmp_path):
    run = tmp_path / "run"
    proc, out, err, ended = run_worker(run, STALL)

    assert proc.returncode != 0, out + err
    assert f"exitcode  : {HANG_EXIT_CODE}" in err, err[-3000:]
    began = float(re.search(r"hang begins at ([\d.]+)", out).group(1))
    assert ended - began < STALL + MARGIN, f"took {ended - began:.1f} s after the hang began"

    report = (run / "hang" / "report.txt").read_text()
    message, table = report.split("\n\n", 1)
    line1, line0 = marker_line("HANG-RANK1"), marker_line("HANG-RANK0")
    assert f"behind: rank 1 at step 3 (forward), hang_worker.py:{line1} in main" in message, report
    assert "rank 0" not in message.split("behind:")[1], report
    rows = {int(r.split("\t")[0]): r.split("\t") for r in table.splitlines()[1:]}
    assert rows[1][5] == "BEHIND" and rows[1][6] == f"hang_worker.py:{line1} in main", report
    assert rows[0][5] == "-" and rows[0][6] == f"hang_worker.py:{line0} in main", report
    # every rank stopped itself and said why
    assert err.count("ERROR hang: no progress") + out.count("ERROR hang: no progress") == 2, err[
        -3000:
    ]

    for rank, line in ((0, line0), (1, line1)):
        stacks = (run / "hang" / f"rank{rank}.txt").read_text()
        assert "Thread MainThread" in stacks and "Thread lockstep-watchdog" in stacks
        assert f'hang_worker.py", line {line}, in main' in stacks, stacks


def test_slow_steps_that_progress_are_not_a_hang(tmp_path):
    run = tmp_path / "run"
    # 10 steps of 0.5 s: longer than the limit in all
    proc, out, err, _ = run_worker(run, 3.0, "healthy")
    assert proc.returncode == 0, err[-3000:]
    assert out.count("finished") == 2 and not (run / "hang").exists() and "hang:" not in err


def test_one_process_is_a_no_op(tmp_path):
    rt = Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "localhost")
    threads = threading.active_count()
    with Watchdog(rt, tmp_path, stall_seconds=0.01, poll_seconds=0.01) as wd:
        wd.beat(1, "forward")
        time.sleep(0.05)
        wd.beat(1, "optimizer")
        assert threading.active_count() == threads
    wd.stop()  # twice is fine
    assert list(tmp_path.iterdir()) == []


def test_beat_orders_phases_within_a_step(tmp_path):
    wd = Watchdog(Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "localhost"), tmp_path)
    wd.beat(4, "forward")
    wd.beat(4, "forward")  # repeated phase (micro-batches): no change
    wd.beat(4, "optimizer")
    assert wd._progress[:3] == (4, "optimizer", 1)
    wd.beat(5, "forward")
    assert wd._progress[:3] == (5, "forward", 0)


def test_an_error_leaving_the_block_is_not_kept_waiting_for_a_blocked_thread(tmp_path):
    """The thread stuck in a store call whose host died (a stand-in: a thread blocked on an event):
    a normal stop waits for it (two store calls), an error leaving the block does not."""
    wd = Watchdog(
        Runtime(0, 0, 2, 2, 0, torch.device("cpu"), "gloo", "test", "localhost"),
        tmp_path,
        stall_seconds=100,
        poll_seconds=5,
    )  # store calls of 10 s: a normal stop waits 21 s
    blocked = threading.Event()
    wd._thread = threading.Thread(target=blocked.wait, daemon=True)
    wd._thread.start()
    left = threading.Event()

    def leave_with_an_error() -> None:
        wd.__exit__(RuntimeError, RuntimeError("gloo: connection closed by peer"), None)
        left.set()

    threading.Thread(target=leave_with_an_error, daemon=True).start()
    assert left.wait(timeout=15), "the error waited for the blocked watchdog thread"
    assert wd._thread is None and not blocked.is_set()
    blocked.set()
