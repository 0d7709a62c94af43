"""Who trains each attempt of a run, and the line that says what changed (lockstep/train/membership.py).
An elastic job losing and regaining a node for real: tests/e2e/test_launch.py."""

from __future__ import annotations

import dataclasses
import json
import logging

from conftest import one_process, run_ranks

from lockstep.parallel.mesh import BatchPlan
from lockstep.train.membership import FILE, Members, describe_change, note_members

LOG = logging.getLogger("test-membership")


def test_the_change_line_names_who_left_and_joined_the_world_sizes_the_plan_and_the_step():
    plan = BatchPlan(global_batch=64, world_size=8, micro_batch=4, grad_accum=2)
    before = Members(hosts=["a"] * 8 + ["b"] * 8, step=120, restart=0)
    lost = Members(hosts=["a"] * 8, step=100, restart=1)
    assert describe_change(before, lost, plan) == (
        "membership changed since the last attempt (left: b (8 ranks)): world size 16 -> 8, global batch 64 = 8 "
        "replicas x micro-batch 4 x 2 accumulation steps; resumed at step 100"
    )
    swapped = Members(hosts=["a"] * 8 + ["c"], step=100, restart=1)
    assert "(joined: c (1 rank)): world size 8 -> 9" in describe_change(lost, swapped, plan)
    assert "(left: b (8 ranks); joined: c (1 rank)): world size 16 -> 9" in describe_change(
        before, swapped, plan
    )
    # the same hosts in another rank order (a new rendezvous numbers nodes afresh) is no change
    assert describe_change(Members(["a", "b"], 0, 0), Members(["b", "a"], 5, 1), plan) is None


def test_one_process_records_its_attempt_and_compares_with_the_last(tmp_path, caplog):
    rt = one_process()
    plan = BatchPlan(8, 1, 4, 2)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        # a first attempt: nothing to compare with
        assert note_members(rt, tmp_path, 0, plan, LOG) is None
        assert json.loads((tmp_path / FILE).read_text()) == {
            "hosts": ["h"],
            "step": 0,
            "restart": 0,
        }
        assert note_members(rt, tmp_path, 10, plan, LOG) is None  # a plain resume: the same members
    assert "membership changed" not in caplog.text
    (tmp_path / FILE).write_text(json.dumps({"hosts": ["h", "gone"], "step": 0, "restart": 0}))
    with caplog.at_level(logging.INFO, logger=LOG.name):
        line = note_members(rt, tmp_path, 20, plan, LOG)
    assert line == (
        "membership changed since the last attempt (left: gone (1 rank)): world size 2 -> 1, global "
        "batch 8 = 1 replica x micro-batch 4 x 2 accumulation steps; resumed at step 20"
    )
    assert line in caplog.text
    # damaged, or from another version: no comparison, no error
    (tmp_path / FILE).write_text("{not json")
    assert note_members(rt, tmp_path, 30, plan, LOG) is None
    assert json.loads((tmp_path / FILE).read_text())["step"] == 30


def _two_ranks(rt, run_dir):
    rt = dataclasses.replace(rt, hostname=f"host{rt.rank}")  # two "hosts"
    return note_members(rt, run_dir, 7, BatchPlan(8, 2, 4, 1), LOG)


def test_two_ranks_gather_their_hosts_and_rank_0_writes_them(tmp_path):
    (tmp_path / FILE).write_text(json.dumps({"hosts": ["host0"], "step": 3, "restart": 0}))
    lines = run_ranks(_two_ranks, tmp_path)
    assert lines == [
        "membership changed since the last attempt (joined: host1 (1 rank)): world size 1 -> 2, global "
        "batch 8 = 2 replicas x micro-batch 4 x 1 accumulation step; resumed at step 7",
        None,
    ]
    assert json.loads((tmp_path / FILE).read_text())["hosts"] == ["host0", "host1"]
