"""lockstep.plan.models: the GPT on fake tensors as train builds it, and the kinds it refuses."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.models.gpt import build_gpt
from lockstep.plan.models import build_fake_model

SMALL = {"model.hidden_size": 64, "model.attention_heads": 4, "model.layers": 2}


def test_the_gpt_on_fake_tensors_is_train_s_gpt_with_a_batch_and_its_loss():
    cfg = load_config(None, {**SMALL, "model.max_seq_length": 32})
    with FakeTensorMode():
        built = build_fake_model(cfg)
        x, y = built.batch(3)
        loss = built.loss(built.model, (x, y))
    real = build_gpt(cfg.model)
    assert [(n, p.shape) for n, p in built.model.named_parameters()] == [
        (n, p.shape) for n, p in real.named_parameters()
    ]
    assert all(isinstance(p, FakeTensor) for p in built.model.parameters())
    assert x.shape == y.shape == (3, 32) and x.dtype == torch.int64
    assert isinstance(loss, FakeTensor) and loss.shape == ()
    assert built.flops_per_token == real.flops_per_token() and built.tokens_per_sample == 32
    assert built.uses_all_parameters


def test_other_kinds_are_refused_saying_what_plan_simulates():
    cfg = load_config(None, SMALL)
    cfg.model.kind = "hf"
    with pytest.raises(ConfigError, match="simulates model.kind = 'gpt' today, not 'hf'"):
        build_fake_model(cfg)
