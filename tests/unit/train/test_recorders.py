"""lockstep/train/recorders.py: the sample indices every rank records per step (the loader's own, an epoch exactly
once, the same after a resume), and the profiler trace of a window of steps."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from conftest import one_process

from lockstep.data.batches import Batches, DataSource, Reading
from lockstep.data.sampler import Cursor, GlobalCursorSampler
from lockstep.parallel.mesh import BatchPlan
from lockstep.train.recorders import SampleRecorder, StepProfiler, drop_abandoned_records

PLAN = BatchPlan(global_batch=8, world_size=2, micro_batch=2, grad_accum=2)
SAMPLES, SEED = 40, 3  # 5 steps an epoch


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def record(
    run: Path, rank: int, steps: range, cursor: Cursor = Cursor(), data_rank: int | None = None
) -> list[dict]:
    reading = Reading(
        plan=PLAN,
        dp_rank=rank if data_rank is None else data_rank,
        dp=PLAN.world_size,
        seed=SEED,
        start=cursor,
        start_step=0,
        last_step=0,
    )  # the recorder reads no batch: it computes them
    recorder = SampleRecorder(
        run, rank, Batches(DataSource(train=range(SAMPLES), collate=list), reading)
    )
    for step in steps:
        recorder.record(step)
    return lines(run / "samples" / f"rank{rank}.jsonl")


def test_every_rank_records_its_micro_batches_and_an_epoch_covers_every_sample_once(tmp_path):
    ranks = [record(tmp_path, rank, range(1, 6)) for rank in (0, 1)]
    for rank, recorded in enumerate(ranks):
        assert [(r["step"], r["rank"]) for r in recorded] == [(step, rank) for step in range(1, 6)]
        # grad_accum x micro_batch
        assert all(np.shape(r["micro_batches"]) == (2, 2) for r in recorded)
        # what the loader of that rank reads, in the same order
        loader = list(GlobalCursorSampler(SAMPLES, PLAN, rank, SEED, Cursor(), 5))
        assert [mb for r in recorded for mb in r["micro_batches"]] == loader
    for step in range(5):
        batch = [i for recorded in ranks for mb in recorded[step]["micro_batches"] for i in mb]
        assert len(set(batch)) == 8  # the ranks share no sample within a step
    every = sorted(
        i for recorded in ranks for r in recorded for mb in r["micro_batches"] for i in mb
    )
    assert every == list(range(SAMPLES))


def test_a_resumed_recorder_goes_on_where_the_cursor_says(tmp_path):
    straight = record(tmp_path / "straight", 1, range(1, 8))  # into the second epoch
    resumed = record(tmp_path / "resumed", 1, range(3, 8), cursor=Cursor(epoch=0, offset=16))
    assert resumed == straight[2:]


def test_a_resume_drops_the_abandoned_steps_of_every_rank(tmp_path):
    """Steps 1-7 were recorded on 2 ranks, the commit was at 5, the run resumes there (maybe on 1 rank): 6 and 7
    are trained again, so their first records go, rank 1's too; the files then hold each step once."""
    for rank in (0, 1):
        record(tmp_path, rank, range(1, 8))
    drop_abandoned_records(tmp_path, 5)
    for rank in (0, 1):
        assert [r["step"] for r in lines(tmp_path / "samples" / f"rank{rank}.jsonl")] == [
            1,
            2,
            3,
            4,
            5,
        ]
    again = record(tmp_path, 0, range(6, 8), cursor=Cursor(epoch=1, offset=0))
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6, 7]
    drop_abandoned_records(tmp_path, 7)  # nothing later: the files stay as they are
    assert [r["step"] for r in lines(tmp_path / "samples" / "rank0.jsonl")] == [1, 2, 3, 4, 5, 6, 7]
    drop_abandoned_records(tmp_path / "never-recorded", 3)  # no samples/ dir: nothing to do


def test_a_model_parallel_peer_records_its_data_rank_samples_under_its_own_rank(tmp_path):
    dp0 = record(tmp_path, 0, range(1, 3))
    # rank 2 reads what data-parallel rank 0 reads
    peer = record(tmp_path, 2, range(1, 3), data_rank=0)
    assert [r["rank"] for r in peer] == [2, 2]
    assert [r["micro_batches"] for r in peer] == [r["micro_batches"] for r in dp0]


def test_profiler_traces_the_window_of_steps(tmp_path, caplog):
    out = tmp_path / "profile"
    profiler = StepProfiler("1:3", out, one_process(), logging.getLogger("test.train.recorders"))
    a = torch.randn(64, 64)
    trace = out / "rank0.steps1-3.pt.trace.json"
    written_after = []
    with caplog.at_level(logging.INFO, "test.train.recorders"):
        # the loop's calls: before_step(steps done), after_step(steps done after it)
        for step in range(4):
            profiler.before_step(step)
            a = torch.tanh(a @ a)
            profiler.after_step(step + 1)
            written_after.append(trace.exists())
    assert written_after == [False, False, True, True]  # written when step 3 ends, not before
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert f"profiler trace: {trace} (open in Perfetto or TensorBoard)" in caplog.text
    assert (out / "rank0.kineto.txt").exists()  # kineto's own console lines go here
    assert sorted(p.name for p in out.iterdir()) == ["rank0.kineto.txt", trace.name]


def test_no_profile_steps_writes_nothing(tmp_path):
    profiler = StepProfiler(
        None, tmp_path / "profile", one_process(), logging.getLogger("test.train.recorders")
    )
    for step in range(3):
        profiler.before_step(step)
        profiler.after_step(step + 1)
    assert not (tmp_path / "profile").exists()
