"""Buffers under data parallelism: what a forward changes besides gradients; do ranks agree.

A forward in train mode changes more than autograd's graph. BatchNorm updates its running mean and
variance and counts its batches (`num_batches_tracked`); a model may count its own forwards (a plain
int attribute, or a buffer) or keep an EMA. Two consequences:

- A forward that is not a training step must leave none of that behind. The DDP check runs the
  first steps' micro-batches before training does (lockstep.parallel.ddp_check); `no_trace` undoes
  what those forwards changed, so the model sees each micro-batch once, as with `check_steps: 0`.
- Ranks see different micro-batches, so their buffers differ. DDP's `broadcast_buffers` (on by
  default) sends rank 0's buffers to every rank before each forward; each rank then updates them
  from its own batch, so after the forward they differ again, and a checkpoint keeps rank 0's.
  With `broadcast_buffers` off they drift apart for the whole run. torch's SyncBatchNorm computes
  the statistics over the global batch instead (CUDA only). `differing_buffers` names the buffers
  that differ between ranks and `explain_buffers` says why (README.md, "DDP and buffers").
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lockstep.collectives import gather_objects
from lockstep.errors import ConfigError
from lockstep.runtime import Runtime

# what nn.Module keeps for itself (hooks, _parameters, _buffers, _modules, training)
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _snapshot(value: Any) -> tuple[Any, Any]:
    """(the object, a copy of its contents where it can change in place) of one module attribute."""
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return value, value.detach().clone()
    if isinstance(value, (list, dict, set)):
        return value, value.copy()
    return value, None  # immutable (int, float, str, tuple) or an object: rebinding it restores it


def _restore(value: Any, saved: Any) -> Any:
    if saved is None:
        return value
    if isinstance(value, torch.Tensor):
        value.copy_(saved)
    elif isinstance(value, list):
        value[:] = saved
    else:  # dict or set
        value.clear()
        value.update(saved)
    return value


@contextlib.contextmanager
def no_trace(model: nn.Module) -> Iterator[None]:
    """Run forwards that are not training steps: on exit every module's buffers and plain attributes
    hold what they held on entry, in the same tensor and container objects.

    Buffers (BatchNorm statistics and counts, EMAs, counters) are copied back in place; a buffer a
    forward rebound or registered is put back or dropped; plain attributes (an int counting
    forwards,
    a list, a tensor that is not a buffer) are restored the same way, and ones a forward added are
    removed. Parameters are not copied: a forward does not change them (an optimizer step does).
    What an attribute object mutates inside itself (a custom class instance) is out of reach.
    """
    saved = []
    for module in model.modules():
        buffers = {name: _snapshot(b) for name, b in module._buffers.items() if b is not None}
        attrs = {k: _snapshot(v) for k, v in vars(module).items() if k not in _MODULE_INTERNALS}
        saved.append((module, dict(module._buffers), buffers, attrs))
    try:
        yield
    finally:
        with torch.no_grad():
            for module, registered, buffers, attrs in saved:
                module._buffers.clear()
                module._buffers.update(registered)
                for name, (tensor, copy) in buffers.items():
                    _restore(tensor, copy)
                for key in [
                    k for k in vars(module) if k not in _MODULE_INTERNALS and k not in attrs
                ]:
                    del module.__dict__[key]
                for key, (value, copy) in attrs.items():
                    module.__dict__[key] = _restore(value, copy)


def buffer_digests(model: nn.Module) -> dict[str, str]:
    """name -> 16-hex-digit hash of the bytes of each floating or integer buffer."""
    out = {}
    for name, b in model.named_buffers():
        data = b.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        out[name] = hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()
    return out


def differing_buffers(rt: Runtime, model: nn.Module) -> list[str]:
    """Every rank together: the buffers whose bytes differ between ranks, in model order."""
    every = gather_objects(rt, buffer_digests(model))
    names = list(every[0])
    return [n for n in names if len({d.get(n) for d in every}) > 1]


def explain_buffers(names: list[str], broadcast_buffers: bool, limit: int = 4) -> str:
    """Which buffers differ between ranks and why, for a log line or `lockstep check`'s report."""
    shown = ", ".join(names[:limit]) + (
        f" and {len(names) - limit} more" if len(names) > limit else ""
    )
    if broadcast_buffers:
        why = (
            "each rank updates them in its forward from its own micro-batches; DDP sends "
            "rank 0's to every rank before each forward (parallel.broadcast_buffers), so they "
            "differ only by the last forward, and checkpoints keep rank 0's"
        )
    else:
        why = (
            "each rank updates them from its own micro-batches and parallel.broadcast_buffers "
            "is off, so they drift apart for the whole run; checkpoints keep rank 0's"
        )
    fix = "for BatchNorm statistics over the global batch use parallel.sync_batchnorm: true (CUDA)"
    return f"{len(names)} buffer(s) differ between ranks ({shown}): {why}; {fix}"


def check_sync_batchnorm(
    sync_batchnorm: bool, data_parallel: str, device: torch.device, world_size: int
) -> None:
    """torch's SyncBatchNorm all-reduces batch statistics on CUDA only: refuse it elsewhere.
    One process has nothing to synchronise: the setting is then harmless on any device."""
    if not sync_batchnorm or world_size == 1:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"parallel.sync_batchnorm: true needs CUDA devices (torch's SyncBatchNorm refuses "
            f"{device.type} tensors across ranks); on CPU drop it: DDP's "
            "parallel.broadcast_buffers gives every rank rank 0's statistics before each forward"
        )
    if data_parallel != "ddp":
        raise ConfigError(
            f"parallel.sync_batchnorm: true with parallel.data_parallel: {data_parallel}: lockstep "
            "converts BatchNorm for DDP only; use data_parallel: ddp, or drop "
            "parallel.sync_batchnorm"
        )


def convert_sync_batchnorm(model: nn.Module) -> int:
    """Turn every BatchNorm submodule of `model` into torch's SyncBatchNorm, in place; how many.

    The converted layers keep the same Parameter objects and buffers, so the optimizer built before
    and checkpoints of runs without it still fit. A model that is itself one BatchNorm layer is
    refused: it would have to be replaced, not converted."""
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        raise ConfigError(
            "parallel.sync_batchnorm: the model is a single BatchNorm layer; wrap it in a "
            "module of your own, or drop parallel.sync_batchnorm"
        )
    count = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model  # the root is not a BatchNorm: its children were replaced in place
    return count
