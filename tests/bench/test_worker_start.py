"""bench/worker_start.py's table: medians and ranges per mode, and fresh / warm stated only where
every repetition agrees (bench_train.resolve_ratios)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import worker_start as ws  # noqa: E402

INFO = {
    "date": "2026-11-26 05:00 UTC",
    "commit": "abc1234",
    "arch": "x86_64",
    "cpu": "EPYC",
    "cores": "2",
    "isa": "avx2",
    "torch": "2.13.0",
    "python": "3.11.7",
}


def test_the_table_states_medians_ranges_and_the_paired_ratio():
    row = {
        "nproc": 2,
        "omp": 2,
        "warm": [(5.0, 9.0), (6.0, 10.0), (5.5, 9.5), (5.2, 9.2)],
        "fresh": [(8.0, 13.5), (9.0, 14.0), (8.5, 14.25), (8.2, 13.8)],
    }
    text = ws.render([row], INFO, "python bench/worker_start.py --nproc 2")
    assert text.startswith(ws.BEGIN) and text.rstrip().endswith(ws.END)
    line = next(x for x in text.splitlines() if x.startswith("| 2 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "2 (new interpreter)"  # the server, as OMP_NUM_THREADS makes it
    assert cells[2:6] == [
        "5.3 s (5.0-6.0)",
        "8.3 s (8.0-9.0)",
        "9.3 s (9.0-10.0)",
        "13.9 s (13.5-14.2)",
    ]
    # per rep: 1.5, 1.4, 1.5, 1.5 -> every rep agrees
    assert cells[6] == "warm 50% faster (ratios 1.400-1.500, median 1.500; all 4 reps agree)"
    row["fresh"][1] = (5.0, 9.0)  # one rep the other way: nothing resolved
    line = next(x for x in ws.render([row], INFO, "c").splitlines() if x.startswith("| 2 |"))
    assert line.strip("|").split("|")[6].strip().startswith("no difference resolved")
    row["omp"] = 1
    line = next(x for x in ws.render([row], INFO, "c").splitlines() if x.startswith("| 2 |"))
    assert line.split("|")[2].strip() == "1 (fork of the launcher)"
