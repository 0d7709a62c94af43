"""lockstep.plan.formula: a rank's memory by formula, checked against its arithmetic on a model of
known shape: the exact parts from the shards, the rules of thumb for activations and logits."""

from __future__ import annotations

import torch
from torch import nn

from lockstep.plan.formula import PER_HIDDEN, PER_INTERMEDIATE, formula_memory
from lockstep.plan.models import ModelShape

SHAPE = ModelShape(hidden=8, layers=2, intermediate=32, logits=100, tokens_per_sample=10)


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8, bias=False))
    model[0].requires_grad_(False)  # a frozen base layer
    return model.to(torch.bfloat16)


def test_the_exact_parts_come_from_the_shards_and_ddp_keeps_gradients_in_buckets():
    model = _model()
    frozen, trainable = (8 * 32 + 32) * 2, 32 * 8 * 2  # bytes in bfloat16
    ddp = formula_memory(
        model, SHAPE, 3, act_bytes=2, checkpointing=False, data_parallel="ddp", dp=4
    )
    assert ddp["parameters"] == frozen + trainable
    assert ddp["ddp buckets"] == trainable and "gradients" not in ddp
    assert ddp["optimizer"] == 2 * trainable
    alone = formula_memory(
        model, SHAPE, 3, act_bytes=2, checkpointing=False, data_parallel="ddp", dp=1
    )
    assert alone["gradients"] == trainable and "ddp buckets" not in alone
    fsdp = formula_memory(
        model, SHAPE, 3, act_bytes=2, checkpointing=False, data_parallel="fsdp", dp=4
    )
    assert fsdp["gathered parameters"] == 2 * (8 * 32 + 32 + 32 * 8) // 2 * 2  # two blocks


def test_activations_and_logits_follow_the_rules_of_thumb():
    tokens = 3 * 10
    block = tokens * (PER_HIDDEN * 8 + PER_INTERMEDIATE * 32) * 2
    kept = formula_memory(
        _model(), SHAPE, 3, act_bytes=2, checkpointing=False, data_parallel="ddp", dp=1
    )
    assert kept["activations"] == 2 * block
    assert kept["temporary"] == 2 * tokens * 100 * 4  # float32 logits and their gradient
    recomputed = formula_memory(
        _model(), SHAPE, 3, act_bytes=2, checkpointing=True, data_parallel="ddp", dp=1
    )
    assert recomputed["activations"] == 2 * tokens * 8 * 2 + block
