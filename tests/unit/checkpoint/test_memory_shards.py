"""A sharded layout's in-memory snapshots (lockstep/checkpoint/memory_shards.py) on real gloo groups of
FSDP ranks on three "nodes" (ranks with host names of their own, each node a snapshot directory): each
node holds its shards and the previous node's; with any one node lost the survivors load the state of
the snapshot's step exactly, at another world size; a damaged shard is not offered, and the step
before is taken; with two neighbours lost they fall back to disk."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_ranks

from lockstep.checkpoint.memory_shards import room_needed, writers

from ..train.tiny import build_run, tiny_config

# ranks 0, 1 on node-a; 2 on node-b; 3 on node-c: the ring a -> b -> c -> a
HOSTS = ["node-a", "node-a", "node-b", "node-c"]


def test_the_ring_is_the_nodes_in_the_order_of_their_lowest_rank():
    assert writers(HOSTS) == [0, 2, 3]
    assert writers(["x", "y", "x", "y"]) == [0, 1]
    # each node holds its ranks' shards and the previous node's
    assert room_needed(HOSTS, [10, 20, 40, 80]) == {"node-a": 110, "node-b": 70, "node-c": 120}
    assert room_needed(["x", "x"], [5, 6]) == {"x": 11}  # one node: no copy elsewhere


def _config(base: Path, corpus, token_cache, **sets):
    return tiny_config(
        base / "run",
        Path(corpus),
        Path(token_cache),
        **{
            "parallel.data_parallel": "fsdp",
            "train.max_steps": 8,
            "checkpoint.save_interval": 100,
            "checkpoint.memory_interval": 2,
            "checkpoint.memory_dir": str(base / "shm"),
            **sets,
        },
    )


def _full_state(trainee) -> dict[str, torch.Tensor]:
    """Every rank: the model's and the optimizer's state, whole (gathered), by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model, optim = get_state_dict(trainee.model, trainee.optimizer, options=options)
    state = {f"model.{k}": v.clone() for k, v in model.items()}
    for k, per in optim["state"].items():
        state.update({f"optim.{k}.{n}": v.clone() for n, v in per.items() if torch.is_tensor(v)})
    return state


def _train_with_snapshots(rt, base: str, corpus: str, token_cache: str) -> dict:
    """4 FSDP ranks on 3 nodes, a snapshot every 2 steps, 5 steps; the run then fails (its
    snapshots stay): the whole state at step 4, the newest snapshot."""
    from lockstep.train.checkpointer import Checkpointer
    from lockstep.train.recovery import open_snapshots

    rt = dataclasses.replace(rt, hostname=HOSTS[rt.rank])
    cfg = _config(Path(base), corpus, token_cache)
    trainee, batches = build_run(cfg, rt)
    log, said = _recorded(f"test.memory_shards.train.{rt.rank}")
    snapshots = open_snapshots(cfg, trainee, log)
    with pytest.raises(RuntimeError, match="the node failed"):
        with Checkpointer(trainee, batches, cfg, None, log, snapshots=snapshots) as checkpointer:
            for step in range(1, 6):
                trainee.step(batches.next_step(), step)
                if step == 4:
                    at_4 = _full_state(trainee)
                if checkpointer.snapshot_due(step):
                    checkpointer.snapshot(step)
            checkpointer.hold_snapshot()
            raise RuntimeError("the node failed")  # a run that fails keeps its snapshots
    return (at_4 if rt.rank == 0 else {}), said


def _recorded(name: str) -> tuple[logging.Logger, list[str]]:
    """A logger and the messages it logs."""
    log, said = logging.getLogger(name), []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return log, said


def _recover_on(rt, hosts: list[str], base: str, corpus: str, token_cache: str):
    """A restart on `hosts`: (the step it starts from, its whole state, what rank 0 logged)."""
    from lockstep.train.recovery import open_snapshots, start_point

    rt = dataclasses.replace(rt, hostname=hosts[rt.rank])
    cfg = _config(Path(base), corpus, token_cache)
    trainee, _ = build_run(cfg, rt)
    log, records = _recorded(f"test.memory_shards.recover.{rt.rank}")
    snapshots = open_snapshots(cfg, trainee, log)
    snapshot, disk = start_point(snapshots, cfg.checkpoint, rt, log)
    start = trainee.load_state(snapshot or disk, cfg.train.seed, log)
    return start.step, (_full_state(trainee) if snapshot else {}), records


@pytest.mark.slow
def test_any_one_lost_node_loses_no_shard_and_two_neighbours_fall_back_to_disk(
    tmp_path, corpus, token_cache
):
    (tmp_path / "run").mkdir()
    ranks = run_ranks(
        _train_with_snapshots, str(tmp_path), str(corpus), str(token_cache), world_size=4
    )
    at_4 = ranks[0][0]
    assert [said for _, said in ranks] == [[]] * 4  # no warning: every snapshot was written
    (rid,) = [p.name for p in (tmp_path / "shm").iterdir()]
    nodes = tmp_path / "shm" / rid
    # each node: its own shards and the previous node's, beside the index and state of all
    shards = {
        n.name: sorted(p.name for p in n.glob("checkpoints/step_00000004/__*"))
        for n in nodes.iterdir()
    }
    assert shards == {
        "node-a": ["__0_0.distcp", "__1_0.distcp", "__3_0.distcp"],
        "node-b": ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"],
        "node-c": ["__2_0.distcp", "__3_0.distcp"],
    }
    for node in nodes.iterdir():
        held = sorted(p.name for p in node.glob("checkpoints/step_*"))
        assert held == ["step_00000002", "step_00000004"]  # the one before goes at the next
    shutil.copytree(tmp_path / "shm", tmp_path / "kept")

    # node-b lost: its rank 2's shards are on node-c; a and c restart as 2 ranks
    shutil.rmtree(nodes / "node-b")
    step, state, said = run_ranks(
        _recover_on, ["node-a", "node-c"], str(tmp_path), str(corpus), str(token_cache)
    )[0]
    assert step == 4 and state.keys() == at_4.keys()
    assert all(torch.equal(state[k], at_4[k]) for k in at_4)
    assert said[-2].startswith(
        "recovery: from memory, the snapshot of step 4 (held by node-a, node-c; sent to node-a, "
        "node-c); the newest disk checkpoint is none, so 4 step(s) are not trained again"
    ), said
    for node in ("node-a", "node-c"):  # each node's copy is whole now, the older one gone
        assert sorted(p.name for p in (nodes / node).glob("checkpoints/step_*")) == [
            "step_00000004"
        ]

    # node-b lost and node-c's copy of rank 2's shards of step 4 damaged: step 2 it is
    shutil.rmtree(tmp_path / "shm")
    shutil.copytree(tmp_path / "kept", tmp_path / "shm")
    shutil.rmtree(nodes / "node-b")
    shard = nodes / "node-c" / "checkpoints" / "step_00000004" / "__2_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 1
    shard.write_bytes(bytes(damaged))
    step, _, said = run_ranks(
        _recover_on, ["node-a", "node-c"], str(tmp_path), str(corpus), str(token_cache)
    )[0]
    assert step == 2, said
    assert any(line.startswith("recovery: from memory, the snapshot of step 2") for line in said)

    # node-b and node-c lost: node-a holds its own and node-c's shards, not node-b's
    shutil.rmtree(tmp_path / "shm")
    shutil.move(tmp_path / "kept", tmp_path / "shm")
    shutil.rmtree(nodes / "node-b")
    shutil.rmtree(nodes / "node-c")
    step, state, said = run_ranks(
        _recover_on, ["node-a", "node-a"], str(tmp_path), str(corpus), str(token_cache)
    )[0]
    assert step == 0 and state == {}
    assert not any("recovery: from memory" in line for line in said), said
