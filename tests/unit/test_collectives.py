"""The small collectives every rank agrees through (lockstep/collectives.py), on a real 2-process gloo group and
on one process, where each is a no-op."""

from __future__ import annotations

import pytest
import torch
from conftest import one_process, run_ranks

from lockstep.collectives import (
    all_reduce_max,
    all_reduce_max_each,
    all_reduce_sum,
    broadcast_object,
    computed_once,
    failed_ranks,
    gather_objects,
    gather_to_main,
    run_on_main,
)


def _failing(rt, message: str):
    raise ValueError(f"{message} on rank {rt.rank}")


def _failing_unpicklably():
    class Local(Exception):  # a class inside a function: pickle cannot name it
        pass

    raise Local("defined in a function")


def _every_collective(rt) -> dict:
    out = {}
    values = torch.tensor([rt.rank + 1.0, 10.0])
    out["sum"] = all_reduce_sum(rt, values).tolist()
    out["sum_input_untouched"] = values.tolist() == [rt.rank + 1.0, 10.0]
    out["max"] = all_reduce_max(rt, 2.5 * rt.rank - 1)
    out["max_each"] = all_reduce_max_each(rt, [float(rt.rank), 5.0 - rt.rank, -1.0])
    out["failed"] = failed_ranks(rt, ok=rt.rank != 1)
    out["none_failed"] = failed_ranks(rt, ok=True)
    out["broadcast"] = broadcast_object(rt, {"from": rt.rank})
    out["broadcast_from_1"] = broadcast_object(rt, rt.rank, src=1)
    out["gathered"] = gather_objects(rt, ("rank", rt.rank))
    out["gathered_on_main"] = gather_to_main(rt, {"t": torch.full((2,), float(rt.rank))})
    calls = []
    out["main"] = run_on_main(rt, lambda: calls.append(rt.rank) or "done")
    out["calls"] = calls
    result, error = run_on_main(rt, lambda: _failing(rt, "no corpus"))
    out["main_error"] = (result, type(error).__name__, str(error))
    result, error = run_on_main(rt, _failing_unpicklably)
    out["local_error"] = (result, type(error).__name__, str(error))
    out["computed"] = computed_once(rt, lambda: {"tokens": 12, "on": rt.rank})
    try:
        computed_once(rt, lambda: _failing(rt, "bad header"))
        out["computed_error"] = None
    except ValueError as e:
        out["computed_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_every_collective)


def test_reductions_agree_on_every_rank(two_ranks):
    for rank in two_ranks:
        assert rank["sum"] == [3.0, 20.0] and rank["sum_input_untouched"]
        assert rank["max"] == 1.5
        assert rank["max_each"] == [1.0, 5.0, -1.0]  # each value's own rank: 1, 0, both
    # rank 1 alone said it failed; both know
    assert two_ranks[0]["failed"] == two_ranks[1]["failed"] == [1]
    assert two_ranks[0]["none_failed"] == two_ranks[1]["none_failed"] == []


def test_objects_travel_in_rank_order(two_ranks):
    for rank in two_ranks:
        assert rank["broadcast"] == {"from": 0} and rank["broadcast_from_1"] == 1
        assert rank["gathered"] == [("rank", 0), ("rank", 1)]
    gathered = two_ranks[0]["gathered_on_main"]
    assert [g["t"].tolist() for g in gathered] == [[0.0, 0.0], [1.0, 1.0]] and two_ranks[1][
        "gathered_on_main"
    ] is None


def test_run_on_main_runs_once_and_every_rank_learns_the_outcome(two_ranks):
    assert [r["main"] for r in two_ranks] == [("done", None), ("done", None)]
    assert [r["calls"] for r in two_ranks] == [[0], []]  # rank 0 alone ran it
    assert [r["main_error"] for r in two_ranks] == [(None, "ValueError", "no corpus on rank 0")] * 2
    # an exception that cannot be pickled reaches the other ranks as its text
    assert [r["local_error"] for r in two_ranks] == [
        (None, "RuntimeError", "Local: defined in a function")
    ] * 2


def test_computed_once_sends_rank_0s_result_or_raises_its_error_everywhere(two_ranks):
    assert [r["computed"] for r in two_ranks] == [{"tokens": 12, "on": 0}] * 2
    assert [r["computed_error"] for r in two_ranks] == ["bad header on rank 0"] * 2


def test_one_process_needs_no_group():
    rt = one_process()
    assert (
        all_reduce_sum(rt, [1.0, 2.0]).tolist() == [1.0, 2.0]
        and all_reduce_sum(rt, [1]).dtype == torch.float64
    )
    assert all_reduce_max(rt, 3.0) == 3.0 and all_reduce_max_each(rt, [1.0, 2.0]) == [1.0, 2.0]
    assert failed_ranks(rt, ok=False) == [0] and failed_ranks(rt, ok=True) == []
    obj = {"a": 1}
    assert (
        broadcast_object(rt, obj) is obj
        and gather_objects(rt, obj) == [obj]
        and gather_to_main(rt, obj) == [obj]
    )
    assert run_on_main(rt, lambda: 7) == (7, None)
    assert str(run_on_main(rt, _failing_unpicklably)[1]) == "Local: defined in a function"
    result, error = run_on_main(rt, lambda: _failing(rt, "x"))
    assert result is None and isinstance(error, ValueError) and str(error) == "x on rank 0"
    assert computed_once(rt, lambda: "tokens") == "tokens"
    with pytest.raises(ValueError, match="^y on rank 0$"):
        computed_once(rt, lambda: _failing(rt, "y"))
