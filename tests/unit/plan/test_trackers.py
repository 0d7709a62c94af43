"""lockstep.plan.trackers: torch's memory tracker over a model with frozen parameters (which torch's
own refuses), and the same peak as torch's own where both can track."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from lockstep.plan.trackers import step_tracker


def _step(tracker_of, frozen: bool = False) -> int:
    """One AdamW step of an MLP on fake tensors under tracker_of(model, optimizer): its peak."""
    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32))
        model[0].requires_grad_(not frozen)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        tracker = tracker_of(model, optimizer)
        with tracker:
            model(torch.randn(64, 32)).square().sum().backward()
            optimizer.step()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _torch_s(model, optimizer):
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def _ours(model, optimizer):
    return step_tracker(model, optimizer, fsdp=False)


def test_the_peak_is_torch_s_own():
    assert _step(_ours) == _step(_torch_s) > 2 * (32 * 256 * 2 + 256 + 32) * 4


def test_a_frozen_parameter_is_tracked_without_a_gradient_hook():
    with pytest.raises(RuntimeError, match="cannot register a hook"):
        _step(_torch_s, frozen=True)
    # no gradient and no AdamW moments for the first layer's 32 x 256 + 256 elements
    assert _step(_ours, frozen=True) <= _step(_ours) - 3 * (8192 + 256) * 4
