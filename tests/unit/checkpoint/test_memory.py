"""In-memory snapshots (lockstep/checkpoint/memory.py) on real files: the newest whole one of this run and
model is found, a damaged, foreign or other-shaped one is skipped with the reason and never read, a copy
sent to another node verifies, and no reader of checkpoints takes a snapshot for a committed one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint.manifest import SNAPSHOT_MARK
from lockstep.checkpoint.memory import Found, NodeSnapshots, fingerprint
from lockstep.checkpoint.open import load_checkpoint, verify_checkpoint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.report import verify_report
from lockstep.checkpoint.resume import resolve_resume
from lockstep.data.sampler import Cursor
from lockstep.errors import CheckpointError

TENSORS = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}
MODEL = fingerprint(TENSORS)


def _write(node: NodeSnapshots, step: int, *, model: str = MODEL, keep_last: int = 3) -> Path:
    tensors = {k: v + step for k, v in TENSORS.items()}
    state = {"step": step, "cursor": Cursor(0, 8 * step).to_dict(), SNAPSHOT_MARK: node.mark(model)}
    return save_checkpoint(
        node.root,
        step,
        tensors,
        {"state": {}, "param_groups": []},
        None,
        state,
        keep_last=keep_last,
    )


@pytest.fixture
def node(tmp_path) -> NodeSnapshots:
    return NodeSnapshots(tmp_path / "shm", "run1", "node-a")


def test_the_newest_whole_snapshot_is_found_and_read(node):
    _write(node, 4)
    newest = _write(node, 6)
    found, skipped = node.newest(MODEL)
    assert found == Found(6, newest) and skipped == []
    assert newest == node.memory_dir / "run1" / "node-a" / "checkpoints" / "step_00000006"
    ckpt = node.read(found)
    assert ckpt.state["step"] == 6 and torch.equal(ckpt.tensors["w"], TENSORS["w"] + 6)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_snapshot_is_skipped_for_the_one_before(node, damage):
    _write(node, 4)
    newest = _write(node, 6)
    data = bytearray((newest / "model.safetensors").read_bytes())
    if damage == "flip":
        data[-3] ^= 0x10  # one bit of a weight
    else:
        data = data[:-5]
    (newest / "model.safetensors").write_bytes(bytes(data))
    found, skipped = node.newest(MODEL)
    assert found.step == 4
    why = "checksum mismatch" if damage == "flip" else "(truncated?)"
    assert len(skipped) == 1 and str(newest) in skipped[0] and why in skipped[0], skipped


def test_a_snapshot_of_another_run_or_model_shape_is_never_used(node, tmp_path):
    other_run = NodeSnapshots(node.memory_dir, "run2", "node-a")
    _write(other_run, 9)
    # another run's directory is not even looked at
    assert node.newest(MODEL) == (None, [])
    # a snapshot that says it belongs elsewhere, found in this run's directory, is refused
    (node.root / "checkpoints").mkdir(parents=True)
    (other_run.root / "checkpoints" / "step_00000009").rename(
        node.root / "checkpoints" / "step_00000009"
    )
    found, skipped = node.newest(MODEL)
    assert found is None and "a snapshot of run 'run2', not of this run (run1)" in skipped[0]
    _write(node, 10, model="0123456789abcdef")
    found, skipped = node.newest(MODEL)
    assert found is None
    assert (
        f"a model of another shape (fingerprint 0123456789abcdef, this one {MODEL})" in skipped[0]
    )


def test_the_fingerprint_is_the_shape_not_the_values():
    assert fingerprint({k: v * 3 for k, v in TENSORS.items()}) == MODEL
    assert fingerprint({**TENSORS, "b": torch.ones(5)}) != MODEL
    assert fingerprint({**TENSORS, "b": torch.ones(4, dtype=torch.float16)}) != MODEL


def test_verify_sample_export_and_resume_refuse_a_snapshot(node, tmp_path):
    path = _write(node, 6)
    problems = verify_checkpoint(path)
    assert problems == [
        "an in-memory snapshot of run run1 (lockstep.checkpoint.memory), not a committed "
        "checkpoint: only a restart of its run reads it; use a checkpoint under RUN/checkpoints"
    ]
    ok, report = verify_report(path)  # `lockstep verify`
    assert not ok and report.splitlines()[-2:] == [
        f"  problem: {problems[0]}",
        "verdict: NOT A CHECKPOINT (an in-memory snapshot)",
    ]
    with pytest.raises(CheckpointError, match="an in-memory snapshot of run run1"):
        load_checkpoint(path)  # what sample and export open a checkpoint with
    with pytest.raises(CheckpointError, match="an in-memory snapshot of run run1"):
        resolve_resume(tmp_path, str(path))
    # and a committed checkpoint is not taken for a snapshot
    ckpt = save_checkpoint(tmp_path / "run", 3, TENSORS, None, None, {"step": 3})
    assert verify_checkpoint(ckpt) == []
    assert NodeSnapshots(tmp_path, "x", "y").problem(ckpt, MODEL) == (
        "state.json: not an in-memory snapshot (no 'memory_snapshot' entry)"
    )


def test_a_copy_sent_to_another_node_verifies_and_reads_the_same(node):
    sent = _write(node, 6)
    other = NodeSnapshots(node.memory_dir, "run1", "node-b")
    _write(other, 2)  # what the joining node had: older, replaced
    path = other.receive(6, node.files(Found(6, sent)))
    found, skipped = other.newest(MODEL)
    assert found == Found(6, path) and skipped == []
    assert [p.name for p in (other.root / "checkpoints").iterdir()] == ["latest", "step_00000006"]
    assert torch.equal(other.read(found).tensors["w"], node.read(Found(6, sent)).tensors["w"])
    assert json.loads((path / "state.json").read_text())[SNAPSHOT_MARK]["node"] == "node-a"
    with pytest.raises(ValueError, match="without its manifest.json"):
        other.receive(7, {"model.safetensors": b""})


def test_keep_only_and_clear(node):
    for step in (4, 6, 8):
        _write(node, step)
    node.keep_only(6)
    assert [p.name for p in (node.root / "checkpoints").glob("step_*")] == ["step_00000006"]
    other = NodeSnapshots(node.memory_dir, "run1", "node-b")
    _write(other, 2)
    node.clear()
    assert not node.root.exists() and other.root.exists()
    other.clear()  # the last node's snapshots gone: the run's directory goes too
    assert not (node.memory_dir / "run1").exists() and node.memory_dir.exists()


def test_free_bytes_reads_the_nearest_existing_directory(node):
    assert not node.memory_dir.exists()
    assert node.free_bytes() > 0
