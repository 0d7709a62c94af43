"""bench/bench_peers.py --workers' measuring parts, on real processes: the process tree and its
memory sampled while a command runs, the evenness of log windows, and the section it writes; every
ratio the tables state, per repetition and only where all repetitions agree
(bench_train.resolve_ratios)."""

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
    # the children live 1 s (10 of the sampler's looks); the parent waits for them, so the tree
    # holds all 3 while they live
    code = (
        "import os, time\n"
        "for _ in range(2):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(1); os._exit(0)\n"
        "for _ in range(2):\n"
        "    os.wait()\n"
    )
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
        return {
            "tokens_per_s": tok,
            "cv_pct": 2.0,
            "slow_fast": 0.95,
            "processes": 3,
            "rss_gb": 1.4,
            "pss_gb": 1.2,
            "foreign": 0.01,
            "foreign_pct": 1.0,
            "said": said,
        }

    said = "data: 0 DataLoader workers per rank (data.num_workers auto: 2 core(s) for 2 rank(s))"
    runs = {
        side: [run(tok, "" if side == "raw" else said) for tok in (1000.0, 1200.0)]
        for side in bp.WORKER_SIDES
    }
    info = {
        "date": "D",
        "arch": "x86_64",
        "cpu": "CPU",
        "cores": "2",
        "isa": "avx2",
        "torch": "T",
        "python": "P",
        "commit": "C",
    }
    args = Namespace(warmup=10, steps=40, log_interval=5, reps=2, max_foreign=0.1, retries=2)
    rows = [{"nproc": 2, "precision": "fp32", "runs": runs}]
    section = bp.render_workers(rows, info, args, "CMD")
    assert section.startswith(bp.WORKERS_BEGIN) and section.rstrip().endswith(bp.WORKERS_END)
    assert (
        "| 2 | fp32 | raw | - | 1,100 (1,000-1,200) | 2.0 (2.0-2.0) | 0.95 (0.95-0.95) "
        "| 3 (3-3) | 1.40 (1.40-1.40) | 1.20 (1.20-1.20) | 1 (1-1) |"
    ) in section
    assert "| 2 | fp32 | lockstep:auto | 0 | 1,100 (1,000-1,200) |" in section
    assert f"- `{said}`" in section
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(
        f"# B\n\n{bp.MARK_BEGIN}\npeers\n{bp.MARK_END}\n\n"
        f"{bp.WORKERS_BEGIN}\nold\n{bp.WORKERS_END}\n"
    )
    bt.write_section(target, section, bp.WORKERS_BEGIN, bp.WORKERS_END)
    text = target.read_text()
    assert "old" not in text and "peers" in text and text.count(bp.WORKERS_BEGIN) == 1


def test_every_ratio_in_the_peer_tables_is_stated_only_where_all_repetitions_agree():
    def runs(*values: float) -> list[dict]:
        return [{"tokens_per_s": v, "first_step_s": 1e4 / v, "foreign": 0.01} for v in values]

    # lockstep slower than raw in every repetition, faster than accelerate in every one, and on
    # both sides of fabric; per-repetition ratios, not medians: the medians differ by 2-3% either
    # way
    tput = {
        "raw": runs(100, 110, 104, 102),
        "lockstep": runs(97, 106, 101, 99),
        "accelerate": runs(95, 103, 98, 96),
        "fabric": runs(99, 104, 100, 101),
    }
    rows = [{"nproc": 2, "precision": "bf16", "tput": tput, "first": tput}]
    info = {
        "date": "D",
        "arch": "x86_64",
        "cpu": "CPU",
        "cores": "2",
        "isa": "avx2",
        "torch": "T",
        "python": "P",
        "commit": "C",
    }
    args = Namespace(warmup=10, steps=90, log_interval=10, reps=4, max_foreign=0.1, retries=2)
    section = bp.render(rows, info, args, {"accelerate": "A", "lightning": "L"}, "CMD")
    assert (
        "| 2 | bf16 | 103 (100-110) | 100 (97-106) | 97 (95-103) | 100 (99-104) "
        "| lockstep 3% faster (ratios 1.021-1.031, median 1.030; all 4 reps agree) "
        "| no difference resolved (ratios 0.980-1.019, median 0.995) "
        "| lockstep 3% slower (ratios 0.964-0.971, median 0.970; all 4 reps agree) |"
    ) in section
    # time to the first step (here 1e4 / tok/s): the same ratios inverted, in words for a time
    assert (
        "| lockstep takes 3% less (ratios 0.970-0.979, median 0.971; all 4 reps agree) "
        "| no difference resolved (ratios 0.981-1.021, median 1.005) "
        "| lockstep takes 3% longer (ratios 1.030-1.038, median 1.031; all 4 reps agree) |"
    ) in section
    one = {
        "nproc": 1,
        "precision": "fp32",
        "tput": {k: v[:1] for k, v in tput.items()},
        "first": {k: v[:1] for k, v in tput.items()},
    }
    args.reps = 1  # --quick
    assert "| not resolved: 1 of the 4 reps it takes (ratio 0.970) |" in bp.render(
        [one], info, args, {"accelerate": "A", "lightning": "L"}, "CMD"
    )


def test_the_workers_table_compares_each_lockstep_side_with_raw_per_repetition():
    def run(tok: float, pss: float) -> dict:
        return {
            "tokens_per_s": tok,
            "cv_pct": 2.0,
            "slow_fast": 0.95,
            "processes": 3,
            "rss_gb": 1.4,
            "pss_gb": pss,
            "foreign": 0.01,
            "foreign_pct": 1.0,
            "said": "data: 1 DataLoader worker",
        }

    raw = [run(100.0, 1.0) for _ in range(4)]
    runs = {side: raw for side in bp.WORKER_SIDES}
    runs["lockstep:1"] = [run(t, 1.2) for t in (90.0, 101.0, 95.0, 97.0)]
    info = {
        "date": "D",
        "arch": "x86_64",
        "cpu": "CPU",
        "cores": "2",
        "isa": "avx2",
        "torch": "T",
        "python": "P",
        "commit": "C",
    }
    args = Namespace(warmup=10, steps=40, log_interval=5, reps=4, max_foreign=0.1, retries=2)
    rows = [{"nproc": 2, "precision": "fp32", "runs": runs}]
    section = bp.render_workers(rows, info, args, "CMD")
    assert (
        "| no difference resolved (ratios 0.900-1.010, median 0.960) "
        "| 20% more (ratios 1.200-1.200, median 1.200; all 4 reps agree) |"
    ) in section
    assert "| 1 (1-1) | - | - |" in section  # the raw row compares with nothing
