"""Tensor parallelism for the built-in GPT (Megatron-style), on a 1-D tensor-parallel device mesh.

Per block, attention and the MLP each become a column-parallel matmul followed by a row-parallel one:

    attn.qkv, mlp.fc     ColwiseParallel   weight rows split: each rank computes its heads / its 4C/tp slice
    attn.proj, mlp.proj  RowwiseParallel   weight columns split: partial sums all-reduced into the residual

so each half-block costs one all-reduce forward and one backward. attn.qkv is packed head-major in
lockstep.models.gpt, so the row split hands each rank whole heads.

Token and position embeddings, the LayerNorms and the tied head stay whole on every rank, as Replicate
DTensors: every parameter is then a DTensor, which fused AdamW and torch.nn.utils.clip_grad_norm_ need
(they refuse lists that mix DTensors and plain tensors). Their gradients come out identical on all ranks:
the backward of each column-parallel layer all-reduces the partial gradients of its input before they
reach the replicated layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from lockstep.models.gpt import GPT


class _Replicated(ParallelStyle):
    """Parameters become Replicate DTensors (copied from the mesh's rank 0); the module still takes and
    returns plain tensors, which hold the same values on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_to_replicate, output_fn=_to_local)


def _to_replicate(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
        else t
        for t in inputs
    )


def _to_local(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def apply_tp(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Split every block's attention heads and MLP across the ranks of the 1-D `tp_mesh`, in place.

    Weights are copied from the mesh's rank 0, so the other ranks' initial values do not matter.
    Build the optimizer afterwards: every parameter becomes a DTensor (split ones hold this rank's
    shard), with the unsplit model's names and full shapes. All ranks of `tp_mesh` must see the same
    batch and draw the same dropout masks (same torch seed).
    """
    tp = tp_mesh.size()
    if model.cfg.attention_heads % tp:
        raise ValueError(
            f"model.attention_heads ({model.cfg.attention_heads}) is not divisible by the tensor-parallel "
            f"degree ({tp}): each rank must hold whole heads; pick a degree that divides {model.cfg.attention_heads}"
        )
    replicated = _Replicated()
    for block in model.blocks:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
                "ln_1": replicated,
                "ln_2": replicated,
            },
        )
    parallelize_module(
        model, tp_mesh, {"tok_emb": replicated, "pos_emb": replicated, "ln_f": replicated}
    )
    # distributing tok_emb registered a new Parameter; tie the head to it again before distributing the
    # head, which then only gains the input/output conversion (an existing DTensor is left as it is)
    model.head.weight = model.tok_emb.weight
    parallelize_module(model.head, tp_mesh, replicated)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights, gathered from every tensor-parallel rank, keyed as in the plain model."""
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
