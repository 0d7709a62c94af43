"""Small collectives the trainer needs, each a no-op on one process.

They run on CPU tensors over `rt.control_group` (gloo), never on the GPU stream, and
exist so that a failure on one rank becomes a clear error on every rank instead of a
hang: each rank reports whether its part worked, and all agree.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lockstep.runtime import Runtime


def all_reduce_sum(rt: Runtime, values: list[float] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float64).clone()
    if rt.distributed:
        dist.all_reduce(t, group=rt.control_group)
    return t


def all_reduce_max(rt: Runtime, value: float) -> float:
    return all_reduce_max_each(rt, [value])[0]


def all_reduce_max_each(rt: Runtime, values: list[float]) -> list[float]:
    """Each value's largest over the ranks, in one collective."""
    t = torch.tensor(values, dtype=torch.float64)
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.control_group)
    return t.tolist()


def failed_ranks(rt: Runtime, ok: bool) -> list[int]:
    """Every rank says whether its part worked; returns the ranks that failed (same list everywhere)."""
    flags = torch.zeros(rt.world_size, dtype=torch.float64)
    flags[rt.rank] = 0.0 if ok else 1.0
    flags = all_reduce_sum(rt, flags)
    return [r for r in range(rt.world_size) if flags[r] > 0]


def broadcast_object(rt: Runtime, obj: Any, src: int = 0) -> Any:
    if not rt.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=rt.control_group)
    return box[0]


def gather_objects(rt: Runtime, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (small objects only: RNG states)."""
    if not rt.distributed:
        return [obj]
    out: list[Any] = [None] * rt.world_size
    dist.all_gather_object(out, obj, group=rt.control_group)
    return out


def gather_to_main(rt: Runtime, obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on global rank 0 only (None elsewhere): for state only rank 0 writes, which
    would cost every rank world_size times its size if all-gathered (PowerSGD's error feedback)."""
    if not rt.distributed:
        return [obj]
    out: list[Any] | None = [None] * rt.world_size if rt.is_main else None
    dist.gather_object(obj, out, dst=0, group=rt.control_group)
    return out


def run_on_main(rt: Runtime, fn: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """fn() on global rank 0 alone; every rank gets (its result, None) or (None, the exception it raised).

    The one way lockstep lets rank 0 do something for everyone (write a checkpoint, pick one, tokenize):
    whatever happens there, every rank leaves the broadcast knowing it, so none waits forever.
    """
    outcome: tuple[Any, Exception | None] = (None, None)
    if rt.is_main:
        try:
            outcome = (fn(), None)
        except Exception as e:  # sent to the other ranks below
            try:
                pickle.dumps(e)
            except Exception:  # an exception that cannot travel is sent as its text
                e = RuntimeError(f"{type(e).__name__}: {e}")
            outcome = (None, e)
    return broadcast_object(rt, outcome)


def computed_once(rt: Runtime, fn: Callable[[], Any]) -> Any:
    """fn() run on global rank 0 alone, its result sent to every rank (moderate sizes: it is pickled).

    For preparation every rank would otherwise repeat against the same files (tokenizing a chat corpus,
    probing audio headers). An exception on rank 0 is raised again on every rank.
    """
    result, error = run_on_main(rt, fn)
    if error is not None:
        raise error
    return result
