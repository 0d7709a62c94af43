"""The processes a test starts, finds, holds, signals and waits for: through /proc, as a person with
ps and kill would (torch's elastic agent starts workers in sessions of their own, so killpg misses them)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path


def worker_pid(run, rank: int) -> int:
    """The pid of `rank`'s worker in the run's latest attempt: its log's last "rank R/W on HOST (pid P)" line."""
    return int(
        re.findall(
            r"rank \d+/\d+ on \S+ \(pid (\d+)\)", (run / "logs" / f"rank{rank}.log").read_text()
        )[-1]
    )


def pending(pid: int, sig: signal.Signals) -> bool:
    """Whether `sig` waits to be delivered to process `pid` (a stopped process keeps it pending)."""
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return any(int(status[field], 16) >> (sig - 1) & 1 for field in ("ShdPnd", "SigPnd"))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torch elastic starts workers in sessions of their own, so killpg misses them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def held(pids: list[int]):
    """The processes held still (SIGSTOP) while the block runs, then let go (SIGCONT): what the block sends
    them arrives mid-run, however loaded the machine (a run once finished first)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
