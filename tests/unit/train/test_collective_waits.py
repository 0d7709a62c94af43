"""The training thread's waits in collectives (lockstep/train/collective_waits.py), on real 2-rank
gloo groups where rank 1 is slow: torch's synchronous collectives, FSDP2's and TP's waits are timed
inside the block, on its thread only, and torch's functions are its own again after it."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from conftest import run_ranks

from lockstep.train.collective_waits import timed_waits
from lockstep.train.step_clock import StepClock, gather_times

CPU = torch.device("cpu")


def _torch_waits() -> tuple:
    return dist.distributed_c10d.Work.__dict__["wait"], funcol.__dict__["wait_tensor"]


TORCH_WAITS = _torch_waits()  # at import, before any block opened


def _waits_where_timed(rt) -> dict:
    """Rank 1 joins each all-reduce 0.2 s late; rank 0 notes what it was told it waited."""
    torch_waits = _torch_waits()
    told: list[float] = []

    def late_all_reduce() -> None:
        if rt.rank == 1:
            time.sleep(0.2)
        dist.all_reduce(torch.ones(1))

    with timed_waits(CPU, told.append) as timed:
        patched = _torch_waits() != torch_waits
        late_all_reduce()  # this thread: timed
        inside = list(told)
        other = threading.Thread(target=late_all_reduce)  # another thread's wait: not this step's
        other.start()
        other.join()
        after_thread = list(told)
    late_all_reduce()  # after the block: not timed
    with timed_waits(torch.device("cuda"), told.append) as on_gpu:  # no CUDA needed: nothing done
        gpu_untouched = _torch_waits() == torch_waits
    return {
        "timed": timed,
        "patched": patched,
        "inside": inside,
        "after_thread": after_thread,
        "after": list(told),
        "restored": _torch_waits() == torch_waits,
        "on_gpu": on_gpu,
        "gpu_untouched": gpu_untouched,
    }


def test_a_wait_is_timed_inside_the_block_on_its_thread_only_and_torch_is_restored():
    fast, slow = run_ranks(_waits_where_timed)
    assert fast["timed"] and fast["patched"] and fast["restored"]
    assert len(fast["inside"]) == 1 and fast["inside"][0] >= 0.15  # rank 1 came 0.2 s late
    assert fast["after_thread"] == fast["inside"] == fast["after"]
    assert len(slow["inside"]) == 1 and slow["inside"][0] < 0.1  # rank 0 was there already
    assert fast["on_gpu"] is False and fast["gpu_untouched"]


class _SlowOnRank1(torch.nn.Module):
    """Four linear layers; rank 1's forward sleeps `delay` seconds first."""

    def __init__(self, rank: int, delay: float):
        super().__init__()
        self.delay = delay if rank == 1 else 0.0
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))

    def forward(self, x):
        time.sleep(self.delay)
        return self.layers(x)


def _steps(rt, layout: str, delay: float) -> list:
    """Three steps of `layout` over the mesh of both ranks, timed by a StepClock as the loop times
    them (no gradient watched: the layout's collectives are its own), and the waits timed after."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = _SlowOnRank1(rt.rank, delay)
    mesh = init_device_mesh("cpu", (rt.world_size,))
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
        parallelize_module(
            model.layers, mesh, plan | {"2": ColwiseParallel(), "3": RowwiseParallel()}
        )
    with StepClock(CPU) as clock:  # the clock times the waits while it is open, as in the loop
        for _ in range(3):
            clock.lap("data")
            model(torch.ones(8, 64)).sum().backward()
            clock.lap_backward()
            clock.step_done()
    times = [t.phases for t in gather_times(rt, clock)]
    assert _torch_waits() == TORCH_WAITS  # the clock closed: torch's own again
    return times


def _both_layouts(rt, delay: float) -> dict:
    """_steps of FSDP, then of TP, in one pair of ranks (one start for both)."""
    return {layout: _steps(rt, layout, delay) for layout in ("fsdp", "tp")}


def test_under_fsdp_and_tp_the_fast_rank_waits_in_the_collectives_and_the_slow_one_computes():
    found = run_ranks(_both_layouts, 0.2)[0]
    for layout, (fast, slow) in found.items():
        # rank 1 slept 0.2 s in each forward; rank 0 waited for it in the layout's collectives
        assert slow["compute"] >= 0.2 and fast["comm"] >= 0.15, (layout, fast, slow)
        assert fast["compute"] < slow["compute"] - 0.1, (layout, fast, slow)
        assert slow["comm"] < fast["comm"] - 0.1, (layout, fast, slow)
