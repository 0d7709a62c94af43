"""A state's copy in host memory (lockstep/checkpoint/staging.py): a plain layout's copy, and the
copy DCP's async_save takes of a real 2-rank FSDP state through HostCopy, built once and refreshed
at every save, as a sharded background save and a memory snapshot use it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import run_ranks

from lockstep.checkpoint.staging import HostCopy, copy_to_host, host_stager, layout, tensors_in
from lockstep.config import ModelConfig, OptimConfig
from lockstep.models.gpt import build_gpt
from lockstep.optim import build_optimizer

CFG = ModelConfig(vocab_size=64, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16)


def test_copy_to_host_copies_every_tensor_once_and_keeps_the_structure():
    weight = torch.arange(6.0).reshape(2, 3)
    live = {
        "emb": weight,
        "head": weight.detach(),
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": weight * 2}},
        "groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}],
        "note": None,
    }
    host = copy_to_host(live)
    assert host["emb"] is host["head"]  # one storage under two names (tied weights) stays one copy
    assert host["emb"].data_ptr() != weight.data_ptr()
    assert host["groups"] == live["groups"] and host["groups"][0] is not live["groups"][0]
    assert isinstance(host["groups"][0]["betas"], tuple) and host["note"] is None
    weight.add_(100)
    live["state"][0]["step"].add_(1)
    live["groups"][0]["params"].append(2)
    assert (
        torch.equal(host["emb"], torch.arange(6.0).reshape(2, 3))
        and host["state"][0]["step"].item() == 3.0
    )
    assert torch.equal(host["state"][0]["exp_avg"], torch.arange(6.0).reshape(2, 3) * 2)
    assert host["groups"][0]["params"] == [0, 1]


def _fsdp_gpt(seed: int):
    from torch.distributed.device_mesh import init_device_mesh

    from lockstep.parallel.fsdp import apply_fsdp

    torch.manual_seed(seed)
    model = build_gpt(CFG)
    apply_fsdp(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, build_optimizer(model, OptimConfig(), 1e-2, "cpu")


def _step(model, optimizer, seed: int) -> None:
    """One AdamW step on this rank's half of 8 random sequences."""
    data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(seed))
    mine = data.chunk(dist.get_world_size())[dist.get_rank()]
    model(mine[:, :-1], mine[:, 1:])[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _local(state: dict) -> list[torch.Tensor]:
    return [getattr(t, "_local_tensor", t) for t in tensors_in(state)]


def _saves_through_one_kept_copy(rt, run: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from lockstep.checkpoint.sharded import saved_state, shard_writer

    model, optimizer = _fsdp_gpt(0)
    stager, out, saved = host_stager(rt.device, pinned=False), {}, []
    for step in (1, 2):
        _step(model, optimizer, seed=step)
        live = saved_state(model, optimizer)
        written = dcp.async_save(
            live, storage_writer=shard_writer(f"{run}/{step}"), async_stager=stager
        )
        written.result()
        saved.append([t.clone() for t in _local(live)])
    kept = _local(stager.copy)
    out["builds"] = stager.builds
    out["own_memory"] = all(k.data_ptr() != t.data_ptr() for k, t in zip(kept, _local(live)))
    out["kept_is_step_2"] = all(torch.equal(k, t) for k, t in zip(kept, saved[1]))
    # each checkpoint read back into a model of another seed holds its own step's values
    for step in (1, 2):
        other, other_optimizer = _fsdp_gpt(7)
        _step(other, other_optimizer, seed=9)  # its optimizer's moments exist: the same layout
        into = saved_state(other, other_optimizer)
        dcp.load(into, checkpoint_id=f"{run}/{step}")
        got = _local(into)
        out[f"step_{step}_read_back"] = all(torch.equal(g, w) for g, w in zip(got, saved[step - 1]))
    out["steps_differ"] = not all(torch.equal(a, b) for a, b in zip(*saved))
    # the model alone is another layout: the copy is built again
    stager.stage(saved_state(model, None))
    out["builds_after_model_only"] = stager.builds
    stager.close()
    out["closed"] = stager.copy is None
    return out


def test_a_kept_copy_is_built_once_and_each_save_writes_its_own_step(tmp_path):
    for rank in run_ranks(_saves_through_one_kept_copy, str(tmp_path)):
        assert rank == {
            "builds": 1,
            "own_memory": True,
            "kept_is_step_2": True,
            "step_1_read_back": True,
            "step_2_read_back": True,
            "steps_differ": True,
            "builds_after_model_only": 2,
            "closed": True,
        }


def test_a_layout_is_each_tensor_s_kind_shape_and_dtype_in_order():
    state = {"a": torch.zeros(2, 3), "opt": {"state": {0: {"step": torch.tensor(1.0)}}}, "lr": 0.1}
    assert layout(state) == (
        (torch.Tensor, torch.Size([2, 3]), torch.float32),
        (torch.Tensor, torch.Size([]), torch.float32),
    )
    # values and non-tensors are not part of it; a shape or dtype is
    assert layout({**state, "a": torch.ones(2, 3), "lr": 0.5}) == layout(state)
    assert layout({**state, "a": torch.zeros(3, 2)}) != layout(state)
    assert layout({**state, "a": torch.zeros(2, 3, dtype=torch.bfloat16)}) != layout(state)


def test_a_cpu_rank_keeps_a_host_copy_that_dcp_takes_as_its_own_stager():
    # (a GPU rank's, DCP's DefaultStager into pinned memory, needs CUDA to be built: tests/gpu)
    from torch.distributed.checkpoint.staging import AsyncStager

    cpu = host_stager(torch.device("cpu"), pinned=True)
    assert isinstance(cpu, HostCopy) and isinstance(cpu, AsyncStager)
    assert not cpu.should_synchronize_after_execute  # stage copies before it returns
    assert (cpu.copy, cpu.layout, cpu.builds) == (None, None, 0)
    # a GPU's memory snapshots: DCP's own staging, made at each snapshot
    assert host_stager(torch.device("cuda", 0), pinned=False) is None
