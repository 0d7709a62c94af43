"""bench/bench_peers.py --workers' measuring parts, on real processes: the process tree and its
memory sampled while a command runs, the evenness of log windows, and the section it writes."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import bench_peers as bp  # noqa: E402
import bench_train as bt  # noqa: E402


def test_run_sampled_counts_a_real_tree(tmp_path):
    code = ("import os, time\n"
            "for _ in range(2):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(2); os._exit(0)\n"
            "time.sleep(2.5)\n")
    out = bp.run_sampled([sys.executable, "-c", code], tmp_path, every=0.1)
    assert out["processes"] == 3  # the parent and its two children
    assert 0 < out["pss_gb"] <= out["rss_gb"] < 1  # forked children share pages: PSS below RSS
    assert bp.process_tree(999_999_999) == []  # no such process: nothing


def test_run_sampled_reports_a_failure(tmp_path):
    with pytest.raises(RuntimeError, match=r"failed with exit code 3:\nboom"):
        bp.run_sampled([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], tmp_path)


def test_window_stats():
    assert bp.window_stats([100.0, 100.0]) == {"cv_pct": 0.0, "slow_fast": 1.0}
    got = bp.window_stats([80.0, 100.0, 120.0])
    assert got["cv_pct"] == pytest.approx(16.33, abs=0.01)
    assert got["slow_fast"] == pytest.approx(2 / 3)


def test_render_and_write_workers_section(tmp_path):
    def run(tok: float, said: str = "") -> dict:
        return {"tokens_per_s": tok, "cv_pct": 2.0, "slow_fast": 0.95, "processes": 3,
                "rss_gb": 1.4, "pss_gb": 1.2, "foreign": 0.01, "foreign_pct": 1.0, "said": said}

    said = "data: 0 DataLoader workers per rank (data.num_workers auto: 2 core(s) for 2 rank(s))"
    runs = {side: [run(tok, "" if side == "raw" else said) for tok in (1000.0, 1200.0)]
            for side in bp.WORKER_SIDES}
    info = {"date": "D", "arch": "x86_64", "cpu": "CPU", "cores": "2", "isa": "avx2", "torch": "T",
            "python": "P", "commit": "C"}
    args = Namespace(warmup=10, steps=40, log_interval=5, reps=2, max_foreign=0.1, retries=2)
    rows = [{"nproc": 2, "precision": "fp32", "runs": runs}]
    section = bp.render_workers(rows, info, args, "CMD")
    assert section.startswith(bp.WORKERS_BEGIN) and section.rstrip().endswith(bp.WORKERS_END)
    assert ("| 2 | fp32 | raw | - | 1,100 (1,000-1,200) | 2.0 (2.0-2.0) | 0.95 (0.95-0.95) "
            "| 3 (3-3) | 1.40 (1.40-1.40) | 1.20 (1.20-1.20) | 1 (1-1) |") in section
    assert "| 2 | fp32 | lockstep:auto | 0 | 1,100 (1,000-1,200) |" in section
    assert f"- `{said}`" in section
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(f"# B\n\n{bp.MARK_BEGIN}\npeers\n{bp.MARK_END}\n\n"
                      f"{bp.WORKERS_BEGIN}\nold\n{bp.WORKERS_END}\n")
    bt.write_section(target, section, bp.WORKERS_BEGIN, bp.WORKERS_END)
    text = target.read_text()
    assert "old" not in text and "peers" in text and text.count(bp.WORKERS_BEGIN) == 1
