"""lockstep.plan.choose: the candidates lockstep can train with, the fixes for a plan too big."""

from __future__ import annotations

from dataclasses import replace

from lockstep.plan.build import make_plan
from lockstep.plan.choose import _fitting, candidates, fixes
from lockstep.plan.profiles import load_profile

from .test_build import config


def _shape(c):
    p = c.parallel
    return (
        p.data_parallel,
        p.tensor_parallel,
        p.pipeline_parallel,
        p.fsdp_reshard_after_forward,
        c.model.gradient_checkpointing,
    )


def test_the_candidates_are_what_lockstep_trains_with_at_that_world():
    shapes = {_shape(c) for c in candidates(config(), 4, 4)}
    # 4 heads, 4 layers, 4 devices a node: TP 2 and 4 beside FSDP, 2 stages with 2 DDP replicas
    # each or TP 2 inside, a 4-stage pipeline
    layouts = {s[:4] for s in shapes}
    assert layouts == {
        ("ddp", 1, 1, True),
        ("fsdp", 1, 1, True),
        ("fsdp", 1, 1, False),
        ("fsdp", 2, 1, True),
        ("fsdp", 4, 1, True),
        ("ddp", 1, 2, True),
        ("ddp", 2, 2, True),
        ("ddp", 1, 4, True),
    }
    assert len(shapes) == 2 * len(layouts)  # each with and without activation checkpointing
    assert {c.parallel.tensor_parallel for c in candidates(config(), 4, 2)} == {
        1,
        2,
    }  # TP stays inside a node


BIG = {"model.hidden_size": 256, "train.micro_batch_size": 8, "train.batch_size": 64}


def test_a_device_too_small_for_ddp_is_offered_fsdp_and_a_smaller_micro_batch():
    cfg = config(**BIG)
    h100 = load_profile("h100-80gb")
    fsdp = make_plan(config(**{**BIG, "parallel.data_parallel": "fsdp"}), 8, 8, h100, other=False)
    # room for FSDP's peak, and no more
    small = replace(h100, memory_gib=h100.reserve_gib + fsdp.peak * 1.001 / 2**30)
    plan = make_plan(cfg, 8, 8, small, other=False)
    assert not plan.fits
    found = fixes(plan)
    assert [f.split(":")[0] for f in found] == [
        "parallel.data_parallel=fsdp",
        "model.gradient_checkpointing=true",
        "train.micro_batch_size=4 (the global batch kept)",
    ]
    assert found[0].endswith(" (fits)")  # FSDP over 8 ranks: an eighth of the weights
    # --choose's candidate DDP halves its micro-batch (the global batch kept) until it fits, or is 1
    halved = _fitting(cfg, 8, 8, small)
    assert halved.batch.global_batch == 64 and halved.batch.micro_batch < 8
    assert halved.fits or halved.batch.micro_batch == 1
    assert halved.batch.micro_batch * halved.batch.grad_accum == 8


def test_an_accumulating_fsdp_plan_too_big_is_offered_a_reduce_scatter_every_micro_batch():
    sets = {**BIG, "parallel.data_parallel": "fsdp", "train.micro_batch_size": 4}
    h100 = load_profile("h100-80gb")
    plan = make_plan(config(**sets), 8, 8, h100, other=False)
    assert plan.batch.grad_accum == 2
    small = replace(h100, memory_gib=h100.reserve_gib + plan.peak * 0.999 / 2**30)
    found = fixes(make_plan(config(**sets), 8, 8, small, other=False))
    # a shard of the gradients between the micro-batches instead of the whole model's
    assert found[0].startswith("parallel.fsdp_reduce_every_micro_batch=true: peak ")
    assert found[0].endswith(" (fits)")
