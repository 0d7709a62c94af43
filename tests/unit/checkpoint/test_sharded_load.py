"""lockstep/checkpoint/sharded_load.py on one process: a sharded checkpoint loaded back into a model and its
optimizer, its full tensors read without a model, its RNG states, a plain checkpoint through the same loader,
and the refusals (a shard gone, a model of other shapes) with the checkpoint and the fix. Resharding across
2 and 4 ranks: tests/unit/checkpoint/test_sharded.py."""

from __future__ import annotations

import pytest
import torch
from conftest import one_process

from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.sharded import save_sharded_checkpoint
from lockstep.checkpoint.sharded_load import (
    load_full_model_tensors,
    load_rng_states,
    load_sharded_checkpoint,
)
from lockstep.errors import CheckpointError


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()  # state to save: exp_avg, exp_avg_sq, step
    return model, optimizer


@pytest.fixture
def saved(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    path = save_sharded_checkpoint(
        one_process(),
        tmp_path,
        3,
        model,
        optimizer,
        ["rng of rank 0"],
        {"step": 3, "marker": "x"},
        {},
        keep_last=2,
    )
    return path, model, optimizer


def test_a_sharded_checkpoint_loads_back_into_a_fresh_model_and_optimizer(saved):
    path, model, optimizer = saved
    into, into_opt = _model_and_optimizer(1)
    assert not torch.equal(into[0].weight, model[0].weight)
    state = load_sharded_checkpoint(path, into, into_opt)
    assert state["step"] == 3 and state["marker"] == "x"
    assert all(
        torch.equal(a, b) for a, b in zip(into.state_dict().values(), model.state_dict().values())
    )
    want, got = optimizer.state_dict()["state"], into_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[i]["exp_avg"], want[i]["exp_avg"]) for i in want)
    full = load_full_model_tensors(path)  # without a model: the full tensors, by name
    assert full.keys() == model.state_dict().keys()
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
    assert load_rng_states(path) == ["rng of rank 0"]


def test_a_plain_checkpoint_loads_through_the_same_loader(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    path = save_checkpoint(
        tmp_path, 1, model.state_dict(), optimizer.state_dict(), [None], {"step": 1}
    )
    into, into_opt = _model_and_optimizer(1)
    assert load_sharded_checkpoint(path, into, into_opt)["step"] == 1
    assert all(
        torch.equal(a, b) for a, b in zip(into.state_dict().values(), model.state_dict().values())
    )


def test_a_missing_shard_or_other_shapes_are_refused_with_the_fix(saved):
    path, _, _ = saved
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    with pytest.raises(CheckpointError) as e:
        load_sharded_checkpoint(path, other)
    assert "0.weight" in str(e.value) and "(3, 4)" in str(e.value).replace("[", "(").replace(
        "]", ")"
    )
    shard = next(path.glob("*.distcp"))
    shard.unlink()
    with pytest.raises(
        CheckpointError, match=rf"checkpoint {path} is damaged \({shard.name}: missing"
    ):
        load_sharded_checkpoint(
            path, torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        )
    with pytest.raises(CheckpointError, match=r"lockstep verify RUN_DIR"):
        load_full_model_tensors(path)
