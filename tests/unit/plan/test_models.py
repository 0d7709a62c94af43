"""lockstep.plan.models: the GPT on fake tensors as train builds it."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lockstep.config import load_config
from lockstep.models.gpt import build_gpt
from lockstep.plan.models import fake_gpt

SMALL = {"model.hidden_size": 64, "model.attention_heads": 4, "model.layers": 2}


def test_the_gpt_on_fake_tensors_is_train_s_gpt_with_a_batch_and_its_loss():
    cfg = load_config(None, {**SMALL, "model.max_seq_length": 32})
    with FakeTensorMode():
        built = fake_gpt(cfg)
        x, y = built.batch(3)
        loss = built.loss(built.model, (x, y))
    real = build_gpt(cfg.model)
    assert [(n, p.shape) for n, p in built.model.named_parameters()] == [
        (n, p.shape) for n, p in real.named_parameters()
    ]
    assert all(isinstance(p, FakeTensor) for p in built.model.parameters())
    assert x.shape == y.shape == (3, 32) and x.dtype == torch.int64
    assert isinstance(loss, FakeTensor) and loss.shape == ()
    assert built.flops_per_token == real.flops_per_token() and built.shape.tokens_per_sample == 32
    assert built.uses_all_parameters

    assert built.shape.logits == 256 and built.shape.tied_embedding == 256 * 64
