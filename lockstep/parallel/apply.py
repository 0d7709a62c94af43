"""Parallelism applied to a built model, in a fixed order: tensor parallel, pipeline stage, FSDP.

    mesh (pp, dp, tp) -> apply_tp(model, mesh["tp"]) -> build_pipeline(model, mesh["pp"]) -> apply_fsdp(model, mesh["dp"])

A pipeline's stages take their data-parallel replicas (mesh["dp"]) with them: build_pipeline
averages their gradients; FSDP does not shard pipeline stages (lockstep.parallel.mesh refuses it).

DDP comes last and separately (lockstep.parallel.ddp), after the DDP check has looked at the bare
model. Every function changes the model in place; the model code itself never sees a process group.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from lockstep.config import ParallelConfig
from lockstep.parallel.mesh import Layout, build_mesh
from lockstep.runtime import Runtime


def apply_parallelism(
    model: nn.Module,
    layout: Layout,
    rt: Runtime,
    cfg: ParallelConfig,
    mixed_precision: str,
    autocast: contextlib.AbstractContextManager,
    grad_accum: int,
    uses_all_parameters: bool = False,
):
    """Shard `model` as `layout` says; returns the Pipeline when this rank runs a pipeline stage, else None.

    `uses_all_parameters`: every forward reaches every trainable parameter (the built-in GPT); otherwise FSDP
    sends zeros for the gradients a rank's step left out, unless parallel.find_unused_parameters says otherwise.
    """
    mesh = build_mesh(layout, rt.device.type) if rt.distributed else None
    if mesh is None:
        return None
    pipeline = None
    if layout.tp > 1:
        from lockstep.parallel.tp import apply_tp

        apply_tp(model, mesh["tp"])
    if layout.pp > 1:
        from lockstep.parallel.pp import build_pipeline

        # the pipeline's micro-batches are the step's grad_accum micro-batches of this data-parallel rank
        dp_mesh = mesh["dp"] if layout.dp > 1 else None  # each stage's replicas
        pipeline = build_pipeline(
            model, mesh["pp"], cfg.pipeline_schedule, grad_accum, autocast=autocast, dp_mesh=dp_mesh
        )
    if layout.data_parallel == "fsdp":
        from lockstep.parallel.fsdp import apply_fsdp

        param_dtype = torch.bfloat16 if mixed_precision == "bf16" else None
        unused = (
            not uses_all_parameters
            if cfg.find_unused_parameters == "auto"
            else cfg.find_unused_parameters == "true"
        )
        apply_fsdp(
            model,
            mesh["dp"],
            param_dtype,
            cfg.fsdp_reshard_after_forward,
            unused,
            reduce_every_micro_batch=cfg.fsdp_reduce_every_micro_batch,
        )
    return pipeline
