"""bench/bench_train.py's rule for what repetitions resolve (resolve_ratios, shared with
bench_peers.py): a difference is stated only where at least MIN_REPS paired repetitions all agree in
sign, with the median and range of the per-repetition ratios either way; and the table rows that
use it."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import bench_train as bt  # noqa: E402


def test_a_difference_is_stated_only_where_every_repetition_agrees_in_sign():
    assert bt.MIN_REPS == 4
    assert (
        bt.resolve_ratios([0.96, 0.975, 0.98, 0.965])
        == "lockstep 3% slower (ratios 0.960-0.980, median 0.970; all 4 reps agree)"
    )
    assert (
        bt.resolve_ratios([1.01, 1.04, 1.02, 1.03, 1.05])
        == "lockstep 3% faster (ratios 1.010-1.050, median 1.030; all 5 reps agree)"
    )
    # one repetition on the other side of 1: nothing is resolved, whatever the median says
    assert (
        bt.resolve_ratios([0.97, 1.04, 0.98, 0.96])
        == "no difference resolved (ratios 0.960-1.040, median 0.975)"
    )
    assert (
        bt.resolve_ratios([1.0, 1.02, 1.03, 1.01])
        == "no difference resolved (ratios 1.000-1.030, median 1.015)"
    )  # a tie: neither side
    # a small difference that every repetition shows is stated, to a tenth of a percent
    assert (
        bt.resolve_ratios([1.004, 1.006, 1.005, 1.005], "{pct} more", "{pct} less")
        == "0.5% more (ratios 1.004-1.006, median 1.005; all 4 reps agree)"
    )


def test_fewer_than_min_reps_resolve_nothing_even_when_they_agree():
    assert bt.resolve_ratios([0.9]) == "not resolved: 1 of the 4 reps it takes (ratio 0.900)"
    assert (
        bt.resolve_ratios([0.9, 0.8, 0.85])
        == "not resolved: 3 of the 4 reps it takes (ratios 0.800-0.900, median 0.850)"
    )
    assert bt.agreed_sign([0.9, 0.8, 0.85]) == 0
    assert bt.agreed_sign([0.99] * 4, 0.98) == 1 and bt.agreed_sign([0.97] * 4, 0.98) == -1
    assert bt.agreed_sign([0.97, 0.99, 0.99, 0.99], 0.98) == 0


def test_ratios_pair_the_runs_of_one_repetition():
    assert bt.paired_ratios([110.0, 90.0], [100.0, 100.0]) == [1.1, 0.9]
    with pytest.raises(ValueError, match="3 runs of one side against 2 of the other.*same --reps"):
        bt.paired_ratios([1.0, 1.0, 1.0], [1.0, 1.0])


def test_the_throughput_table_states_what_its_repetitions_resolve():
    def runs(*tok_s: float) -> list[bt.Run]:
        return [bt.Run("x", t, 0.01, 1, 10.0) for t in tok_s]

    # 1 process: lockstep below raw in every repetition; 2 processes: medians 2% apart, the
    # repetitions disagree
    rows = [
        {
            "nproc": n,
            "precision": "fp32",
            "peak": 1e11,
            "flops_per_token": 2e7,
            "params": 3.2e6,
            "raw": runs(*raw),
            "lockstep": runs(*ls),
        }
        for n, raw, ls in (
            (1, (100, 110, 105, 100), (95, 105, 100, 96)),
            (2, (100, 100, 100, 100), (90, 104, 97, 99)),
        )
    ]
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
    table = bt.render(rows, info, args, "CMD")
    assert (
        "| 1 | fp32 | 102 (10%) | 98 (10%) | lockstep 5% slower (ratios 0.950-0.960, "
        "median 0.953; all 4 reps agree) | no |"
    ) in table
    assert (
        "| 2 | fp32 | 100 (0%) | 98 (14%) | no difference resolved (ratios 0.900-1.040, "
        "median 0.980) | not resolved |"
    ) in table
    assert "only where all of at least 4 repetitions agree in sign" in table
