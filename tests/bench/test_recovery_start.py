"""bench/recovery_start.py on a small state: both orders start from the snapshot (step 47), and the
table it prints has a row for each with as many timings as repetitions."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_orders_start_from_the_snapshot_and_are_timed(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "recovery_start.py"),
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
    assert proc.returncode == 0, proc.stderr[-3000:]  # each run asserts it started at step 47
    assert re.search(r"state: 0\.6M parameters \+ AdamW, 0\.0\d GiB per checkpoint", proc.stdout)
    rows = dict(
        re.findall(
            r"^\| (memory first|disk first \(before\)) \| [\d.]+ \| (.+) \|$", proc.stdout, re.M
        )
    )
    assert set(rows) == {"memory first", "disk first (before)"}
    assert all(len(times.split(", ")) == 2 for times in rows.values())
    assert list(tmp_path.iterdir()) == []  # the run directory it made is gone
