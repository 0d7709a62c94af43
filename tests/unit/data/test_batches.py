"""lockstep/data/batches.py: this rank's batches on one process and on two data-parallel ranks: the steps it
serves against the global cursor's, micro-batches read ahead served again, the cursor and epochs after a step,
the held-out share; the float epoch's arithmetic."""

from __future__ import annotations

import pytest

from lockstep.data.batches import Batches, DataSource, Reading, epochs_done
from lockstep.data.sampler import Cursor, GlobalCursorSampler, cursor_after, eval_micro_batches
from lockstep.parallel.mesh import BatchPlan

PLAN = BatchPlan(global_batch=8, world_size=2, micro_batch=2, grad_accum=2)


def batches(
    rank: int, start: Cursor = Cursor(), start_step: int = 0, last_step: int = 6, **source
) -> Batches:
    """Rank `rank` of 2 reading the sample indices 0..39 (a collate that keeps them) from `start`."""
    source = {"train": range(40), "collate": list, "eval": range(40, 52), **source}
    reading = Reading(
        plan=PLAN,
        dp_rank=rank,
        dp=2,
        seed=3,
        start=start,
        start_step=start_step,
        last_step=last_step,
        eval_batches=2,
    )
    return Batches(DataSource(**source), reading)


def test_each_step_serves_the_global_cursors_micro_batches_and_peeked_ones_again():
    for rank in (0, 1):
        b = batches(rank, count_tokens=len)
        want = [micro for micro in GlobalCursorSampler(40, PLAN, rank, 3, Cursor(), 6)]
        assert b.peek(3) == want[:3] and b.peek(1) == want[:1]  # read ahead once, kept in front
        served = []
        for step in range(1, 7):
            got = b.next_step()
            # 2 micro-batches of 2 samples
            assert len(got.micro_batches) == 2 and got.tokens == 4 and got.wait >= 0
            assert b.step == step
            served += got.micro_batches
        assert served == want  # the peeked ones served once, in their place
        with pytest.raises(StopIteration):
            b.next_step()  # the last step was served


def test_a_resume_continues_at_the_cursor_and_the_cursor_after_a_step_is_computed():
    start = cursor_after(40, 3, Cursor(), 8, 2)  # where a checkpoint of step 2 continues
    resumed = batches(0, start=start, start_step=2)
    assert resumed.cursor_at(2) == start and resumed.cursor_at(5) == cursor_after(
        40, 3, Cursor(), 8, 5
    )
    whole = batches(0)
    for _ in range(2):
        whole.next_step()
    assert [resumed.next_step().micro_batches for _ in range(4)] == [
        whole.next_step().micro_batches for _ in range(4)
    ]
    # 40 samples: 5 steps of 8 an epoch
    assert resumed.epochs_done(5) == 1.0 and resumed.steps_per_epoch() == 5
    assert resumed.epochs_done(7) == epochs_done(cursor_after(40, 3, Cursor(), 8, 7), 40, 8) == 1.4


def test_the_held_out_share_is_collated_as_training_and_empty_without_an_eval_split():
    for rank in (0, 1):
        b = batches(rank)
        assert b.eval_indices == eval_micro_batches(12, 2, rank, 2, 2)
        assert list(b.held_out()) == [[40 + i for i in batch] for batch in b.eval_indices]
    b = batches(0, eval=None)
    assert b.eval_indices == [] and list(b.held_out()) == []


def test_epochs_done_is_the_share_of_the_epochs_steps_as_hfs_float_epoch():
    # 68 samples, global batch 8: 8 steps an epoch, the 4-sample tail dropped
    def at(step: int, start: Cursor = Cursor()) -> float:
        return epochs_done(cursor_after(68, 0, start, 8, step), 68, 8)

    assert at(0) == 0.0 and at(7) == 0.875
    assert at(8) == 1.0  # the last step of epoch 1: one epoch done, not "epoch 1" of the next
    assert at(12) == 1.5 and at(16) == 2.0  # the end of a 2-epoch run
    assert at(4, start=Cursor(1, 32)) == 2.0  # resumed mid-epoch: the same arithmetic
    # a cursor too close to the epoch's end for another batch (saved with a smaller batch) has
    # finished it
    assert epochs_done(Cursor(0, 66), 68, 8) == 1.0
