"""Fully sharded data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each rank of the data-parallel mesh holds 1/N of every parameter, gradient and optimizer state
(DTensors sharded on dim 0). Forward all-gathers one unit (a transformer block) at a time; backward
reduce-scatters its gradients. Units: the built-in GPT's `model.blocks`, a Hugging Face model's
`_no_split_modules` classes (its decoder layers), then the root, which takes what is left
(embeddings, final norm, the tied output head).

Trainer order: build model -> apply_fsdp -> build_optimizer (over the sharded parameters) -> load
checkpoint. Gradient accumulation: `set_gradient_sync(model, False)` before every micro-batch but
the last (or run those inside `with no_sync(model):`), so only the last backward reduce-scatters;
with apply_fsdp's reduce_every_micro_batch each one does (a shard's gradients held, not all).
Clip with `clip_grad_norm` (the norm of sharded gradients is a DTensor; this returns a plain tensor).
Every rank must run every forward (each one all-gathers): evaluation too, with equal batch counts.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
from torch import nn

from lockstep.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# torch.distributed.fsdp (and the DTensor it brings) is imported inside apply_fsdp only: importing it costs
# about 1 s per process (measured: 1.0-1.2 s on the 2-core CPUs here), which every plain-DDP or one-process run
# would pay through the training loop's use of clip_grad_norm and no_sync. Those two recognise FSDP modules and
# DTensors by their methods instead.


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that get their own fully_shard call (each one all-gather in forward), in order.

    Hugging Face (possibly peft-wrapped): every module whose class is in the model's
    `_no_split_modules`; the built-in GPT: `model.blocks`; anything else: none (the root alone).
    """
    no_split = set(_no_split_modules(model))
    if no_split:
        units: list[nn.Module] = []
        # an outer unit already holds these; fully_shard must not take them twice
        inside: set[int] = set()
        for m in model.modules():  # pre-order: an outer layer comes before what it contains
            # the MRO, not the class name: fully_shard renames a sharded class to FSDP<name>
            if (
                m is not model
                and id(m) not in inside
                and any(c.__name__ in no_split for c in type(m).__mro__)
            ):
                units.append(m)
                inside.update(id(d) for d in m.modules())
        return units
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        # a pipeline stage holds None for other stages' blocks
        return [b for b in blocks if b is not None]
    return []


def _no_split_modules(model: nn.Module) -> list[str]:
    # peft: PeftModel.base_model (LoraModel).model is the transformers model that names its layers
    inner = getattr(getattr(model, "base_model", None), "model", None)
    for candidate in (model, inner):
        names = getattr(candidate, "_no_split_modules", None) if candidate is not None else None
        if names:
            return list(names)
    return []


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    unused_parameters: bool = False,
    *,
    reduce_every_micro_batch: bool = False,
) -> None:
    """Shard `model` in place over the 1-D mesh `dp_mesh`: each unit of `fsdp_units`, then the root.

    param_dtype (e.g. torch.bfloat16): parameters are all-gathered and computed in that dtype while
    the sharded master copy, the optimizer and the gradient reduction stay float32.
    reshard_after_forward: free each unit's gathered parameters after its forward (memory ~ 1/N
    of the model, one more all-gather per unit in backward); False keeps them until backward.
    unused_parameters: a step may leave trainable parameters without a gradient on some ranks (a branch
    the data decides). FSDP2 reduce-scatters only the gradients a rank has, so the ranks' collectives
    would differ in size (a gloo abort, or a hang); with this, a missing gradient is sent as zeros, as
    DDP's find_unused_parameters does (torch >= 2.13; a parameter no rank used then gets a zero gradient).
    reduce_every_micro_batch: `no_sync(model)` leaves gradient sync on, so every micro-batch's
    backward reduce-scatters (parallel.fsdp_reduce_every_micro_batch): a rank holds its gradient
    shard between micro-batches instead of the whole model's unsharded gradients, for grad_accum
    times the reduce-scatter bytes.
    Tied weights (GPT's head.weight is tok_emb.weight) stay one parameter: both live in the root unit.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if dp_mesh.ndim != 1:
        raise ValueError(
            f"apply_fsdp takes a 1-D data-parallel mesh, got {dp_mesh.ndim}-D {dp_mesh}; "
            "pass mesh['dp'] of a multi-dimensional mesh"
        )
    policy = (
        MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if param_dtype is not None
        else MixedPrecisionPolicy()
    )
    units = fsdp_units(model)
    for i, unit in enumerate(units):
        # the last unit's parameters are needed again at once by backward: freeing them would only re-gather
        fully_shard(
            unit,
            mesh=dp_mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward and i < len(units) - 1,
        )
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    model.lockstep_reduce_every_micro_batch = reduce_every_micro_batch  # read by no_sync
    if unused_parameters:
        if not hasattr(model, "set_reduce_scatter_unused_params"):
            raise ConfigError(
                f"parallel.data_parallel: fsdp for a model whose forward may skip parameters needs "
                f"torch >= 2.13 (FSDPModule.set_reduce_scatter_unused_params); this is torch "
                f"{torch.__version__}: upgrade torch, or use parallel.data_parallel: ddp"
            )
        model.set_reduce_scatter_unused_params(True)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters gradients (False: accumulate them unsharded locally).

    For gradient accumulation: False before every micro-batch but the last, True before the last.
    A no-op on a model that apply_fsdp did not shard (one process).
    """
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDPModule
        model.set_requires_gradient_sync(enabled)  # recurses into every unit


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """DDP's `no_sync()` for an FSDP model: forward and backward inside it do not reduce gradients
    (unless apply_fsdp was told to reduce every micro-batch's: then it changes nothing)."""
    if getattr(model, "lockstep_reduce_every_micro_batch", False):
        yield
        return
    set_gradient_sync(model, False)
    try:
        yield
    finally:
        set_gradient_sync(model, True)


def clip_grad_norm(
    parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Total gradient norm over all ranks' shards (before clipping), as a plain tensor; scales grads to max_norm.

    max_norm <= 0 or inf only measures. Works for plain and DTensor gradients alike: with FSDP the
    norm of sharded gradients is a replicated DTensor, turned into a plain tensor here.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    if hasattr(total, "full_tensor"):  # a DTensor
        total = total.full_tensor()  # (), the same on every rank
    if max_norm > 0 and math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
