"""Shared helpers: run lockstep as a user would (a real subprocess), and a tiny model's settings."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One thread per process: the suite's runs share 2 cores, and OpenMP threads that spin on a busy core make a
# 1-process run ~30x slower (measured: 2.3k vs 70k tok/s with a benchmark running beside it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# a model small enough that 2 CPU processes train it in seconds
TINY = ["--hidden-size", "32", "--attention-heads", "2", "--layers", "2", "--max-seq-length", "32",
        "--log-interval", "1", "--set", "train.sample_tokens=0", "--set", "data.num_workers=0",
        "--peak-flops", "1e12"]


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    """One token cache for the whole session (keyed by content, so sharing it is safe)."""
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small fixed text corpus: a slice of the standard library's own source, copied once."""
    import sysconfig

    src = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join((src / name).read_text() for name in ("argparse.py", "dataclasses.py", "textwrap.py"))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text[:300_000])
    return path


def lockstep_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lockstep", *map(str, args)]


def run_lockstep(*args: str, timeout: float = 300, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(lockstep_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"lockstep {' '.join(args)} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-6000:]}")
    return proc


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


def busy_port() -> tuple[socket.socket, int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]
