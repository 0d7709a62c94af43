"""lockstep.plan.formula: a rank's memory by formula, checked against its arithmetic on a model of
known shape: the exact parts from the shards, the rules of thumb for activations and logits."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lockstep.plan.formula import LOGIT_COPIES, PER_HIDDEN, PER_INTERMEDIATE, formula_memory
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
    assert fsdp["gradients"] == trainable  # a shard's: the model is whole on this CPU "rank"
    shards = _shard(_model())
    args = dict(act_bytes=2, checkpointing=False, data_parallel="fsdp", dp=4)
    sharded = formula_memory(shards, SHAPE, 3, **args)
    accumulating = formula_memory(shards, SHAPE, 3, **args, accumulating=True)
    # no reduce-scatter before the last micro-batch: its gradients are whole meanwhile
    assert sharded["gradients"] == trainable // 4 and accumulating["gradients"] == trainable


class _Shard(torch.Tensor):
    """A parameter's quarter as a DTensor shows it: the whole shape, a quarter's local tensor."""

    @staticmethod
    def __new__(cls, whole: torch.Tensor):
        return torch.Tensor._make_subclass(cls, whole, whole.requires_grad)

    def to_local(self) -> torch.Tensor:
        return torch.Tensor(self).detach().flatten()[: self.numel() // 4]


def _shard(model: nn.Module) -> nn.Module:
    for module in model:
        for name, p in list(module.named_parameters(recurse=False)):
            module._parameters[name] = nn.Parameter(_Shard(p.data), p.requires_grad)
    return model


def test_activations_and_logits_follow_the_rules_of_thumb():
    tokens = 3 * 10
    block = tokens * (PER_HIDDEN * 8 + PER_INTERMEDIATE * 32) * 2
    kept = formula_memory(
        _model(), SHAPE, 3, act_bytes=2, checkpointing=False, data_parallel="ddp", dp=1
    )
    assert kept["activations"] == 2 * block
    # float32 logits, their log-probabilities and gradient
    assert kept["temporary"] == LOGIT_COPIES * tokens * 100 * 4 == 36_000
    recomputed = formula_memory(
        _model(), SHAPE, 3, act_bytes=2, checkpointing=True, data_parallel="ddp", dp=1
    )
    # the layers' inputs; a block's recompute (16,800 bytes) is no peak beside the logits
    assert recomputed["activations"] == 2 * tokens * 8 * 2 and block < 36_000
    wide = ModelShape(hidden=8, layers=2, intermediate=320, logits=10, tokens_per_sample=10)
    recomputed = formula_memory(
        _model(), wide, 3, act_bytes=2, checkpointing=True, data_parallel="ddp", dp=1
    )
    wide_block = tokens * (PER_HIDDEN * 8 + PER_INTERMEDIATE * 320) * 2
    assert recomputed["activations"] == 2 * tokens * 8 * 2 + wide_block - 3 * tokens * 10 * 4


def test_an_encoder_decoder_s_layers_read_their_own_stack_s_tokens_and_logits_its_labels():
    whisper = ModelShape(
        hidden=8, layers=2, intermediate=32, logits=100, tokens_per_sample=10 + 4,
        targets_per_sample=4, layer_tokens=10 + 4,
    )  # fmt: skip
    parts = formula_memory(
        _model(), whisper, 3, act_bytes=2, checkpointing=False, data_parallel="ddp", dp=1
    )
    assert parts["activations"] == 3 * 14 * (PER_HIDDEN * 8 + PER_INTERMEDIATE * 32) * 2
    assert parts["temporary"] == LOGIT_COPIES * 3 * 4 * 100 * 4


def test_lora_adapters_keep_their_dropped_out_input_its_mask_and_their_middle():
    import peft

    base = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8))
    config = peft.LoraConfig(r=4, target_modules=["0", "1"], lora_dropout=0.1)
    lora = peft.get_peft_model(base, config)
    args = dict(act_bytes=2, checkpointing=False, data_parallel="ddp", dp=1)
    plain = formula_memory(nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8)), SHAPE, 3, **args)
    adapted = formula_memory(lora, SHAPE, 3, **args)
    per_token = (8 + 32) * (2 + 1) + 2 * 4 * 2  # inputs and masks, and the rank-4 middles
    assert adapted["activations"] - plain["activations"] == 3 * 10 * per_token
    # a module that reads half a sample's tokens (ModelShape.token_shares, by a name in its path)
    halved = dataclasses.replace(SHAPE, token_shares=(("1", 0.5),))
    second = 32 * 3 + 4 * 2
    assert (
        formula_memory(lora, halved, 3, **args)["activations"]
        == adapted["activations"] - 3 * 10 * second // 2
    )
    no_dropout = peft.get_peft_model(
        nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8)),
        peft.LoraConfig(r=4, target_modules=["0", "1"], lora_dropout=0.0),
    )
    assert (
        formula_memory(no_dropout, SHAPE, 3, **args)["activations"] - plain["activations"]
        == 3 * 10 * 2 * 4 * 2
    )
