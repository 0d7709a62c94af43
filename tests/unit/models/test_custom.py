"""lockstep.models.custom: building the model and loss from the user's factories, calling the model, finding the loss."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from conftest import USER_MODULE, Batch, Pair
from torch import nn

from lockstep.config import ModelConfig
from lockstep.errors import ConfigError
from lockstep.models.custom import build_custom_loss, build_custom_model, call_model, extract_loss


def test_build_custom_model_and_loss(write_module):
    mod = write_module(USER_MODULE)
    cfg = ModelConfig(kind="custom", factory=f"{mod}:build_model", loss=f"{mod}:my_loss")
    assert isinstance(build_custom_model(cfg), nn.Linear)
    assert build_custom_loss(cfg)(torch.ones(3), None).item() == 1.0
    assert build_custom_loss(ModelConfig(kind="custom", factory=f"{mod}:build_model")) is None
    with pytest.raises(
        ConfigError,
        match=r"returned a tuple of 2 \(a Linear, a NoneType\), not a torch\.nn\."
        r"Module; make it return the model itself",
    ):
        build_custom_model(ModelConfig(kind="custom", factory=f"{mod}:build_pair"))


class Recorder(nn.Module):
    def forward(self, *args, **kwargs):
        return args, kwargs


def test_call_model_variants():
    model, t = Recorder(), torch.ones(2)
    assert call_model(model, {"input_ids": t, "labels": t}) == ((), {"input_ids": t, "labels": t})
    assert call_model(model, (t, 1)) == ((t, 1), {})
    assert call_model(model, [t, 1]) == ((t, 1), {})
    pair = Pair(t, "a")
    args, kwargs = call_model(model, pair)
    assert len(args) == 1 and args[0] is pair and not kwargs
    dc = Batch(x=t, extras=[])
    assert call_model(model, dc)[0][0] is dc
    assert call_model(model, t)[0][0] is t


def test_extract_loss_variants():
    scalar = torch.tensor(2.5)
    assert extract_loss(scalar, None) is scalar
    assert extract_loss(SimpleNamespace(loss=scalar, logits=torch.ones(3)), None) is scalar
    assert extract_loss({"loss": scalar, "logits": torch.ones(3)}, None) is scalar

    @dataclass
    class Out:
        logits: torch.Tensor
        loss: torch.Tensor | None = None

    assert extract_loss(Out(torch.ones(3), scalar), None) is scalar
    batch = {"y": torch.tensor([1.0, 3.0])}
    loss = extract_loss(torch.zeros(2), batch, loss_fn=lambda out, b: (out - b["y"]).pow(2).mean())
    assert loss.item() == 5.0


def test_extract_loss_errors():
    logits, loss = torch.ones(2, 3), torch.tensor(1.0)
    with pytest.raises(
        ConfigError,
        match=r"model's output, a tuple of 2 \(a Tensor of shape \(2, 3\), a Tensor "
        r"of shape \(\)\); return a scalar tensor.*model\.loss = 'module:function'",
    ):
        extract_loss((logits, loss), None)
    with pytest.raises(ConfigError, match=r"a dict with keys \['logits'\]"):
        extract_loss({"logits": logits}, None)
    with pytest.raises(ConfigError, match=r"a Tensor of shape \(2, 3\); return a scalar"):
        extract_loss(logits, None)

    @dataclass
    class Out:
        logits: torch.Tensor
        loss: torch.Tensor | None = None

    with pytest.raises(
        ConfigError,
        match=r"an? Out with fields \['logits', 'loss'\] \(its loss is None: .*'labels'",
    ):
        extract_loss(Out(logits), None)
    with pytest.raises(
        ConfigError, match=r"the loss from model\.loss has shape \(2, 3\), not a scalar.*\.mean\(\)"
    ):
        extract_loss(logits, None, loss_fn=lambda out, batch: out)
    with pytest.raises(ConfigError, match=r"the loss from output\.loss has shape \(4,\)"):
        extract_loss(SimpleNamespace(loss=torch.ones(4)), None)
    with pytest.raises(ConfigError, match=r"the loss from model\.loss is a float, not a tensor"):
        extract_loss(logits, None, loss_fn=lambda out, batch: 0.5)
