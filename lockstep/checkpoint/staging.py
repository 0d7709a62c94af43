"""A state's copy in host memory, taken in the step path before a background thread writes it.

    copy_to_host(state)           a plain layout's copy (background.start_plain_save)
    host_stager(device, pinned)   where DCP's async_save copies a sharded layout's shards, kept
                                  by the BackgroundWriter from save to save
    tensors_in(state)             every tensor of a state dict

A sharded copy on a GPU: DCP's DefaultStager into pinned host memory (its storages kept and
reused) for disk saves; a GPU's memory snapshots keep DCP's default staging (unpinned, made at each
snapshot), as the GPU tier ran them: a second pinned copy kept per rank is host memory not yet
measured there. On a CPU: HostCopy. DCP's default (the staging of FileSystemWriter, a new writer
each save) built the whole copy again every time, deep-copying each DTensor, data and all, to throw
the data away; a 3-rank FSDP run taking a memory snapshot every step spent more time in that copy
than in its training steps (BENCHMARKS.md, "Memory snapshots: the copy kept"). HostCopy builds the
copy once and then copies the values into it; a state of another layout (the first save that holds
the optimizer's moments) builds it again.

A kept copy is safe because at most one save is in flight per BackgroundWriter, and the caller
waits for it before it stages the next (lockstep.checkpoint.background). It holds the host memory
of one copy between saves, which a save without it holds while it writes. DCP is imported only
when a sharded save stages (tests/unit/checkpoint/test_open.py: never for a plain checkpoint).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch


def layout(state: Any) -> tuple:
    """What a kept copy must match to take `state`'s values: each tensor's kind, shape and dtype,
    depth first (DCP's copy checks dict keys and list lengths itself)."""
    return tuple((type(t), t.shape, t.dtype) for t in tensors_in(state))


class HostCopy:
    """DCP's AsyncStager (blocking, as its BlockingAsyncStager) into one host copy kept from save
    to save, built again when the state's layout changes; CPU tensors, so nothing is pinned."""

    _synchronize_after_execute = False  # the copy is done when stage returns

    def __init__(self) -> None:
        self.copy: dict | None = None
        self.layout: tuple | None = None
        self.builds = 0

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        # DCP's own building blocks, as BlockingAsyncStager(cache_staged_state_dict=True) uses them
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        now = layout(state)
        if now != self.layout:
            self.copy, self.layout = _create_cpu_state_dict(state), now
            self.builds += 1
        return _copy_state_dict(state, self.copy)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage copies before it returns."""

    def close(self) -> None:
        self.copy = self.layout = None


def host_stager(device: torch.device, pinned: bool) -> Any:
    """The stager a BackgroundWriter keeps for the sharded saves of a rank on `device`: HostCopy on
    a CPU; on a GPU, DCP's DefaultStager into pinned memory where `pinned` (disk saves), else None:
    DCP's default staging, made at each save (memory snapshots)."""
    if device.type != "cuda":
        return HostCopy()
    if not pinned:
        return None
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=True,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=True,
    )
    return DefaultStager(options)


def copy_to_host(obj: Any) -> Any:
    """A deep copy of obj (a state dict: dicts, lists, tuples) with every tensor copied to host
    memory, pinned when it comes from a GPU. Views of one storage (tied weights) share one copy;
    other shared values stay shared, so the copy pickles to the same bytes as the original
    (torch.save memoizes by identity)."""
    memo: dict[
        int, Any
    ] = {}  # copy.deepcopy's: each tensor's copy is made here, the rest by deepcopy
    copies: dict[tuple, torch.Tensor] = {}
    for t in tensors_in(obj):
        d = t.detach()
        key = (
            d.device,
            d.untyped_storage().data_ptr(),
            d.storage_offset(),
            d.shape,
            d.stride(),
            d.dtype,
        )
        if key not in copies:
            if d.device.type == "cpu":
                copies[key] = d.clone()
            else:  # pinned: the copy is a DMA the GPU runs while this thread queues the next one
                host = torch.empty(d.shape, dtype=d.dtype, pin_memory=torch.cuda.is_available())
                copies[key] = host.copy_(d, non_blocking=host.is_pinned())
        memo[id(t)] = copies[key]
    if any(device.type == "cuda" for device, *_ in copies):
        torch.cuda.synchronize()  # the copies from the GPU were queued without waiting for them
    return copy.deepcopy(obj, memo)


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a state dict (dicts, lists, tuples), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
