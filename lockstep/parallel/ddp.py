"""Data parallelism with DistributedDataParallel."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lockstep.runtime import Runtime


def apply_ddp(model: nn.Module, rt: Runtime, find_unused_parameters: bool = False,
              static_graph: bool = False) -> nn.Module:
    """Wrap `model` for data parallelism; returns the model itself on one process.

    Built once: the trainer keeps both the wrapper (for forward/backward and no_sync)
    and the unwrapped model (for the optimizer, clipping and checkpoints).
    """
    if not rt.distributed:
        return model
    return DDP(
        model,
        device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        # gradients live in the communication buckets: one less copy per step
        gradient_as_bucket_view=True,
    )
