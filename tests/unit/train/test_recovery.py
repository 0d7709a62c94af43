"""Where an attempt starts (lockstep/train/recovery.py), on real gloo groups of two "nodes" (ranks with their own
host names and snapshot directories): the newest snapshot any node holds, sent to the node that lacks it; the
disk when it is newer or memory holds nothing usable; memory never read but by --resume auto; and when
snapshots are taken at all."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from conftest import one_process, run_ranks

from lockstep.checkpoint.manifest import SNAPSHOT_MARK
from lockstep.checkpoint.memory import NodeSnapshots, fingerprint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import CheckpointConfig
from lockstep.data.sampler import Cursor
from lockstep.train.recovery import open_snapshots, recover
from lockstep.train.snapshots import MemorySnapshots

from .tiny import build_run, tiny_config

TENSORS = {"w": torch.arange(6.0)}
MODEL = fingerprint(TENSORS)
HOSTS = ("node-a", "node-b")


def _node(memory_dir: str, host: str) -> NodeSnapshots:
    return NodeSnapshots(Path(memory_dir), "run1", host)


def _write(node: NodeSnapshots, step: int) -> Path:
    state = {"step": step, "cursor": Cursor(0, 8 * step).to_dict(), SNAPSHOT_MARK: node.mark(MODEL)}
    tensors = {"w": TENSORS["w"] + step}
    return save_checkpoint(node.root, step, tensors, {"state": {}, "param_groups": []}, None, state)


def _recover_on(rt, memory_dir: str, run_dir: str, steps: dict, disk: str | None, resume: str):
    """Rank r is the only rank of host HOSTS[r]; it holds snapshots of `steps[r]` first."""
    rt = dataclasses.replace(rt, hostname=HOSTS[rt.rank])
    node = _node(memory_dir, rt.hostname)
    if rt.rank == 0:  # one rank writes them all before any rank looks
        for rank, held in steps.items():
            for step in held:
                _write(_node(memory_dir, HOSTS[rank]), step)
    torch.distributed.barrier()
    log = logging.getLogger("test.recovery")
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    snapshots = MemorySnapshots(node, rt, writes=True, interval=1, model=MODEL, log=log)
    checkpoint = CheckpointConfig(output_dir=run_dir, resume=resume)
    got = recover(snapshots, Path(disk) if disk else None, checkpoint, log)
    held = sorted(p.name for p in (node.root / "checkpoints").glob("step_*"))
    return (got.state["step"], got.tensors["w"].tolist()) if got else None, held, records


def test_the_newest_snapshot_is_sent_to_the_node_that_lacks_it(tmp_path):
    (run := tmp_path / "run").mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 6, "split": "train", "loss": 1.0}\n{"step": 7, "split": "train", "loss": 1.0}\n'
        '{"step": 7, "split": "eval", "loss": 1.0}\n{"step": 8, "spl'  # cut by the crash
    )
    disk = save_checkpoint(run, 4, TENSORS, None, None, {"step": 4})
    steps = {0: [3, 5], 1: []}  # node b joined (or lost its memory)
    out = run_ranks(_recover_on, str(tmp_path / "shm"), str(run), steps, str(disk), "auto")
    assert [o[0] for o in out] == [(5, [5.0, 6, 7, 8, 9, 10])] * 2
    assert [o[1] for o in out] == [["step_00000005"]] * 2  # node a dropped the older one
    assert out[0][2] == [
        "recovery: from memory, the snapshot of step 5 (held by node-a; sent to node-b); the newest "
        "disk checkpoint is step 4, so 1 step(s) are not trained again; 2 step(s) are (metrics.jsonl's "
        "last step: 7)"
    ]
    assert out[1][2] == []  # rank 0 says it


def test_a_damaged_newest_snapshot_falls_back_to_the_older_one_on_another_node(tmp_path):
    shm = tmp_path / "shm"
    bad = _write(_node(str(shm), "node-a"), 6)
    (bad / "model.safetensors").write_bytes(b"\0" * (bad / "model.safetensors").stat().st_size)
    out = run_ranks(_recover_on, str(shm), str(tmp_path / "run"), {1: [5]}, None, "auto")
    assert [o[0][0] for o in out] == [5, 5]
    assert out[0][1] == ["step_00000005"]  # the damaged one removed, the good one received
    assert out[0][2][0] == f"memory snapshot skipped: {bad}: model.safetensors: checksum mismatch"
    assert "the snapshot of step 5 (held by node-b; sent to node-a)" in out[0][2][1]
    assert (
        "the newest disk checkpoint is none, so 5 step(s) are not trained again; no step"
        in out[0][2][1]
    )


@pytest.mark.parametrize("resume", ["auto", "none"])
def test_the_disk_when_it_is_newer_or_memory_is_not_asked(tmp_path, resume):
    (run := tmp_path / "run").mkdir()
    newer = 9 if resume == "auto" else 2  # --resume none: memory is not read, however new
    disk = save_checkpoint(run, newer, TENSORS, None, None, {"step": newer})
    out = run_ranks(
        _recover_on, str(tmp_path / "shm"), str(run), {0: [5], 1: [5]}, str(disk), resume
    )
    assert [o[0] for o in out] == [None, None]
    assert [o[1] for o in out] == [[], []]  # another timeline's snapshots: cleared
    said = (
        "recovery: the newest memory snapshot (step 5) is older than the checkpoint of step 9; "
        "resuming from disk"
    )
    assert out[0][2] == ([said] if resume == "auto" else [])


def test_snapshots_are_taken_where_a_restart_can_read_them(tmp_path, corpus, token_cache):
    log = logging.getLogger("test.recovery")

    def opened(restarts: int, **sets):
        cfg = tiny_config(tmp_path / "run", corpus, token_cache, **sets)
        trainee, _ = build_run(cfg)
        trainee.rt = dataclasses.replace(one_process(), max_restarts=restarts)
        return open_snapshots(cfg, trainee, log)

    assert opened(0) is None  # auto, and nothing would restart the workers
    auto = opened(3, **{"checkpoint.memory_dir": str(tmp_path / "shm")})
    assert auto.interval is None and auto.writes and auto.node.node == "h"
    assert (
        auto.node.root == tmp_path / "shm" / (tmp_path / "run" / "run_id").read_text().strip() / "h"
    )
    # an attempt without snapshots forgets this node's: a later one must not read another timeline's
    stale = auto.node.root / "checkpoints"
    stale.mkdir(parents=True)
    off = {"checkpoint.memory_interval": 0, "checkpoint.memory_dir": str(tmp_path / "shm")}
    assert opened(3, **off) is None
    assert not auto.node.root.exists()
    every = opened(0, **{"checkpoint.memory_interval": 5})
    assert every.interval == 5 and every.model == auto.model


def _start_on(rt, memory_dir: str, run_dir: str, steps: dict):
    """start_point on rank r of host HOSTS[r], which holds snapshots of `steps[r]`: (the snapshot's
    step or None, the disk checkpoint's name or None, what rank 0 logged)."""
    from lockstep.train.recovery import start_point

    rt = dataclasses.replace(rt, hostname=HOSTS[rt.rank])
    if rt.rank == 0:
        for rank, held in steps.items():
            for step in held:
                _write(_node(memory_dir, HOSTS[rank]), step)
    torch.distributed.barrier()
    log = logging.getLogger(f"test.start.{rt.rank}")
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    snapshots = MemorySnapshots(
        _node(memory_dir, rt.hostname), rt, writes=True, interval=1, model=MODEL, log=log
    )
    got, disk = start_point(snapshots, CheckpointConfig(output_dir=run_dir), rt, log)
    return (got.state["step"] if got else None), (disk.name if disk else None), records


def _damage(path: Path) -> None:
    (path / "model.safetensors").write_bytes(b"\0" * (path / "model.safetensors").stat().st_size)


def test_memory_first_the_disk_is_not_verified_when_a_snapshot_is_as_new(tmp_path):
    """The only disk checkpoint damaged: verifying it would refuse to start over. Memory holds step 5,
    newer, so the disk is never read: the attempt starts from memory, naming step 4 as the disk's."""
    (run := tmp_path / "run").mkdir()
    _damage(save_checkpoint(run, 4, TENSORS, None, None, {"step": 4}))
    out = run_ranks(_start_on, str(tmp_path / "shm"), str(run), {0: [5], 1: [5]})
    assert [o[:2] for o in out] == [(5, "step_00000004")] * 2
    assert not any("damaged" in line for line in out[0][2])
    assert (
        "the newest disk checkpoint is step 4, so 1 step(s) are not trained again" in out[0][2][0]
    )


def test_a_newer_disk_is_verified_and_memory_still_wins_over_its_fallback(tmp_path):
    """Disk step 9 is newer than memory's 5, so it is verified: damaged, the fallback is step 3, and
    memory's step 5 is newer than that."""
    (run := tmp_path / "run").mkdir()
    save_checkpoint(run, 3, TENSORS, None, None, {"step": 3})
    _damage(save_checkpoint(run, 9, TENSORS, None, None, {"step": 9}))
    out = run_ranks(_start_on, str(tmp_path / "shm"), str(run), {0: [5], 1: []})
    assert [o[:2] for o in out] == [(5, "step_00000003")] * 2
    said = "\n".join(out[0][2])
    assert "checkpoint step_00000009 is damaged" in said and "falling back to step_00000003" in said
    assert "the snapshot of step 5 (held by node-a; sent to node-b)" in said


def test_a_newer_good_disk_wins_and_memory_is_cleared(tmp_path):
    (run := tmp_path / "run").mkdir()
    save_checkpoint(run, 9, TENSORS, None, None, {"step": 9})
    out = run_ranks(_start_on, str(tmp_path / "shm"), str(run), {0: [5], 1: [5]})
    assert [o[:2] for o in out] == [(None, "step_00000009")] * 2
    assert not any((tmp_path / "shm").rglob("step_*"))
