"""bench/snapshot_write.py on a small state: a row per size with both ways timed as many times as
asked, each snapshot committed (the script asserts it), nothing left in /dev/shm."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_ways_are_timed_and_every_snapshot_commits(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "snapshot_write.py"),
            "--params",
            "0.6",
            "--reps",
            "2",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = re.findall(
        r"^\| 0\.6M \+ AdamW \| (\d+) MiB \| ([\d.]+) \| ([\d.]+) \| (.+) \|$", proc.stdout, re.M
    )
    assert row[0] == "7"  # 0.6M float32 parameters and AdamW's two moments
    ways = dict(part.split(": ") for part in row[3].split("; "))
    assert set(ways) == {"background", "synchronous"}
    assert all(len(times.split(", ")) == 2 for times in ways.values())
    assert not list(Path("/dev/shm").glob("lockstep-bench-*"))
