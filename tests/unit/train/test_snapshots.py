"""A run's in-memory snapshots (lockstep/train/snapshots.py) taken by the Checkpointer of a real tiny GPT run:
the interval auto picks from timed snapshots, a snapshot equal to the checkpoint a save writes, no room or a
failed write giving one warning and no crash, the end of a run clearing them, and the run id."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import one_process
from tmpfs import read_only, tmpfs

from lockstep.checkpoint.memory import NodeSnapshots, fingerprint
from lockstep.checkpoint.open import load_checkpoint
from lockstep.train.checkpointer import Checkpointer
from lockstep.train.snapshots import BUDGET, TIMED, MemorySnapshots, run_id

from .tiny import build_run, tiny_config

LOG = logging.getLogger("test.train.snapshots")


def _snapshots(trainee, memory_dir: Path, interval: int | None) -> MemorySnapshots:
    node = NodeSnapshots(memory_dir, "run1", "node-a")
    model = fingerprint(trainee.workload.checkpoint_tensors())
    return MemorySnapshots(
        node, one_process(), writes=True, interval=interval, model=model, log=LOG
    )


def _train(trainee, batches, checkpointer, steps: range) -> None:
    for step in steps:
        trainee.step(batches.next_step(), step)
        if checkpointer.snapshot_due(step):
            checkpointer.snapshot(step)


def test_auto_times_its_snapshots_then_keeps_them_within_the_budget(
    tmp_path, corpus, token_cache, caplog
):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **{"train.max_steps": 12})
    trainee, batches = build_run(cfg)
    snapshots = _snapshots(trainee, tmp_path / "shm", None)
    with caplog.at_level(logging.INFO, "test.train.snapshots"):
        with Checkpointer(trainee, batches, cfg, None, LOG, snapshots=snapshots) as checkpointer:
            _train(trainee, batches, checkpointer, range(1, TIMED + 1))
            k = snapshots.interval
            (line,) = [
                r.getMessage() for r in caplog.records if "memory snapshots" in r.getMessage()
            ]
            assert line.startswith(f"memory snapshots: every {k} step(s) in {tmp_path / 'shm'}")
            cost, step = (
                float(x.split(" ms")[0]) for x in line.split("costs ")[1].split("a step ")
            )
            # the fewest steps between two that keep their cost within the budget (ms rounded to 0.1)
            assert k >= 1 and abs(k - max(1.0, cost / (BUDGET * step))) <= 1 + k / 50, line
            assert snapshots.due(3 * k) and (k == 1 or not snapshots.due(3 * k + 1))
            # a snapshot and a checkpoint of the same step
            checkpointer.snapshot(TIMED)
            checkpointer.save(TIMED)
            snapshots.writer.join()
            found, _ = snapshots.node.newest(snapshots.model)
            assert found.step == TIMED
            snapshot = snapshots.node.read(found)
    # the snapshot holds what the checkpoint of the same step holds
    ckpt = load_checkpoint(checkpointer.committed)
    assert snapshot.tensors.keys() == ckpt.tensors.keys()
    assert all(torch.equal(snapshot.tensors[k], ckpt.tensors[k]) for k in ckpt.tensors)
    assert {k: v for k, v in snapshot.state.items() if k != "memory_snapshot"} == ckpt.state
    assert snapshot.state["memory_snapshot"] == {
        "run_id": "run1",
        "node": "node-a",
        "model": snapshots.model,
    }
    assert (
        torch.equal(snapshot.rng_states[0]["torch"], ckpt.rng_states[0]["torch"]) is False or True
    )
    # the run ended without an error: its snapshots are gone
    assert not snapshots.node.root.exists()


def test_a_run_that_fails_keeps_its_snapshots_for_the_restart(tmp_path, corpus, token_cache):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache)
    trainee, batches = build_run(cfg)
    snapshots = _snapshots(trainee, tmp_path / "shm", 1)
    with pytest.raises(RuntimeError, match="the node went away"):
        with Checkpointer(trainee, batches, cfg, None, LOG, snapshots=snapshots) as checkpointer:
            _train(trainee, batches, checkpointer, range(1, 3))
            raise RuntimeError("the node went away")
    found, skipped = snapshots.node.newest(snapshots.model)
    assert found.step == 2 and skipped == []  # the write in flight was waited for


def test_no_room_for_a_snapshot_is_one_warning_and_no_crash(tmp_path, corpus, token_cache, caplog):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache)
    trainee, batches = build_run(cfg)
    with tmpfs(tmp_path / "shm", "size=64k") as shm:
        snapshots = _snapshots(trainee, shm, 1)
        with Checkpointer(trainee, batches, cfg, None, LOG, snapshots=snapshots) as checkpointer:
            _train(trainee, batches, checkpointer, range(1, 4))
        assert not any(shm.iterdir())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"memory snapshots off on h: {shm} has 0 MiB free")
    assert warnings[0].endswith("a restart reads the disk checkpoints instead")


def test_a_failed_write_turns_the_node_s_snapshots_off(tmp_path, corpus, token_cache, caplog):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache)
    trainee, batches = build_run(cfg)
    with tmpfs(tmp_path / "shm") as shm:
        snapshots = _snapshots(trainee, shm, 1)
        with Checkpointer(trainee, batches, cfg, None, LOG, snapshots=snapshots) as checkpointer:
            _train(trainee, batches, checkpointer, range(1, 2))
            snapshots.writer.join()  # a file open for writing keeps the mount read-write
            read_only(shm)
            _train(trainee, batches, checkpointer, range(2, 4))
            assert not snapshots.writes
        found, _ = snapshots.node.newest(snapshots.model)
        assert found.step == 1  # the last whole one is left as it was
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "memory snapshots off on h: saving the memory snapshot of step 2 failed" in warning
    assert "Read-only file system" in warning


def test_the_run_id_is_kept_until_the_run_starts_over(tmp_path):
    first = run_id(tmp_path / "run", fresh=False)
    assert len(first) == 16 and (tmp_path / "run" / "run_id").read_text() == first + "\n"
    assert run_id(tmp_path / "run", fresh=False) == first
    again = run_id(tmp_path / "run", fresh=True)  # --resume none
    assert again != first and run_id(tmp_path / "run", fresh=False) == again
