"""The time a rank's training thread spends blocked on collectives, for the step clock: under FSDP
and TP the collectives run inside the layout's own hooks (FSDP2's all-gathers and reduce-scatters,
DTensor's all-reduces), and the time the thread waits in them is the communication that compute did
not hide, or the wait for a slower rank.

Written here because torch has no hook that reports it: `ProcessGroup._register_on_completion_hook`
is NCCL's alone and reports a collective's duration, not the caller's wait. So while timed_waits()
is open, the two functions through which Python code waits for a collective are timed:

- `torch.distributed.Work.wait`: FSDP2's all-gathers on a CPU (async, waited before the copy-out),
  every synchronous `torch.distributed` collective (the call waits in Python), PP's sends and
  receives;
- `torch.distributed._functional_collectives.wait_tensor`: DTensor's collectives (TP), waited when
  their result is first used (AsyncCollectiveTensor).

Only the thread that opened the block is timed (a background checkpoint's collectives are not the
step's); on a GPU the host does not block (waits are stream waits), so nothing is timed there and
the waits stay in compute (docs/architecture.md, "Step time by rank").
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# (owner, attribute): the two waits timed
_WAITS = ((dist.distributed_c10d.Work, "wait"), (funcol, "wait_tensor"))


def timed_wait(wait: Callable, thread: int, waited: Callable[[float], None]) -> Callable:
    """`wait`, and on `thread` its time told to waited(seconds)."""

    def timed(*args, **kwargs):
        if threading.get_ident() != thread:
            return wait(*args, **kwargs)
        start = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            waited(time.perf_counter() - start)

    return timed


@contextlib.contextmanager
def timed_waits(device: torch.device, waited: Callable[[float], None]) -> Iterator[bool]:
    """While open, each wait of this thread for a collective calls waited(seconds)
    (StepClock.waited). Yields whether waits are timed: not on a GPU (above). Torch's functions are
    back on exit."""
    if device.type == "cuda":
        yield False
        return
    thread = threading.get_ident()
    saved = [(owner, name, owner.__dict__[name]) for owner, name in _WAITS]
    for owner, name, wait in saved:
        setattr(owner, name, timed_wait(getattr(owner, name), thread, waited))
    try:
        yield True
    finally:
        for owner, name, wait in saved:
            setattr(owner, name, wait)
