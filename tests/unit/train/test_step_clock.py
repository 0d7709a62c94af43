"""Each rank's step time by phase (lockstep/train/step_clock.py): laps on a clock, the exposed part of
DDP's all-reduce taken out of compute on a real 2-rank gloo group where one rank is slow, and every
rank's window gathered."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from conftest import run_ranks

from lockstep.train.step_clock import PHASES, StepClock, gather_times


def test_each_lap_goes_to_its_phase_and_the_window_gives_means_per_step():
    ticks = itertools.count(0.0, 0.5)  # every read of the clock is half a second later
    clock = StepClock(torch.device("cpu"), clock=lambda: next(ticks))
    for _ in range(2):
        clock.lap("data")
        clock.mark_ready()  # the last gradient's hook
        clock.lap_backward()
        clock.lap("optimizer")
        clock.step_done()
    assert (
        clock.means()
        == {
            "data": 0.5,
            "compute": 0.5,
            "comm": 0.5,
            "bubble": 0.0,  # a pipeline's (lockstep.parallel.pp.ChunkLaps; tests/unit/parallel/test_pp.py)
            "optimizer": 0.5,
            "checkpoint": 0.0,
            "other": 0.0,
        }
    )
    clock.reset()
    clock.lap_backward()  # no gradient watched: all of it is compute
    clock.step_done()
    assert clock.means()["compute"] == 0.5 and clock.means()["comm"] == 0.0


def test_a_wait_in_a_collective_goes_from_its_phase_to_comm_but_never_more_than_the_lap():
    ticks = itertools.count(0.0, 0.5)
    clock = StepClock(torch.device("cpu"), clock=lambda: next(ticks))
    clock.waited(0.2)  # FSDP's all-gathers in the forward (lockstep.train.collective_waits)
    clock.lap_backward()  # 0.5 s: 0.3 of it compute
    clock.waited(0.9)  # more than the lap: the clock's own reading wins
    clock.lap("optimizer")
    clock.waited(0.1)
    clock.lap("bubble")  # a wait already: stays a bubble
    clock.waited(0.1)
    clock.skip()  # an evaluation's waits are no step's
    clock.lap("data")
    clock.step_done()
    means = clock.means()
    assert means["compute"] == pytest.approx(0.3) and means["comm"] == pytest.approx(0.7)
    assert means["optimizer"] == 0.0 and means["bubble"] == 0.5 and means["data"] == 0.5


class _Slow(torch.nn.Module):
    """A linear layer whose forward takes `delay` seconds longer."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay, self.layer = delay, torch.nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(self.delay)
        return self.layer(x)


def _ddp_steps(rt, delay_on_1: float):
    torch.manual_seed(0)
    model = _Slow(delay_on_1 if rt.rank == 1 else 0.0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    clock = StepClock(torch.device("cpu"), watch=model.parameters())
    for _ in range(3):
        clock.lap("data")
        ddp(torch.ones(4, 8)).sum().backward()
        clock.lap_backward()
        clock.step_done()
    return [(t.rank, t.host, t.phases) for t in gather_times(rt, clock)]


def test_the_fast_rank_waits_in_the_all_reduce_and_the_slow_one_computes():
    times = run_ranks(_ddp_steps, 0.2)[0]
    assert [(rank, host) for rank, host, _ in times] == [(0, times[0][1]), (1, times[0][1])]
    (_, _, fast), (_, _, slow) = times
    assert set(fast) == set(PHASES)
    # rank 1 slept 0.2 s in each forward; rank 0 waited for it after its last gradient
    assert slow["compute"] >= 0.2 and fast["comm"] >= 0.15
    # the same step on both: the fast rank's wait is the slow rank's extra compute
    assert fast["compute"] < slow["compute"] - 0.1 and slow["comm"] < fast["comm"] - 0.1
