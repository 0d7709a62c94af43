"""In-memory snapshots: a node's copy of the run's state in host memory that outlives its workers.

A snapshot is a plain checkpoint (lockstep.checkpoint.plain: the same files, manifest, checksums and
commit) written under MEMORY_DIR/RUN_ID/NODE/checkpoints, MEMORY_DIR a tmpfs (/dev/shm/lockstep by
default): it survives the worker processes, dies with the node, and costs no disk. Its state.json says
it is one (`memory_snapshot`: the run id, the node, the model's fingerprint), and the checks every
reader of checkpoints runs (lockstep.checkpoint.verify) refuse it unless asked for a snapshot: verify,
sample, export and --resume never take one for a committed checkpoint. Only a restart of its own run
reads it back (lockstep.train.recovery, docs/architecture.md, "In-memory snapshots").

File I/O under one node's snapshot directory; no process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from lockstep.checkpoint.commit import commit_dir, list_checkpoints, move_latest, start_save
from lockstep.checkpoint.manifest import MANIFEST, MODEL, SNAPSHOT_MARK, STATE, step_of
from lockstep.checkpoint.plain import Checkpoint, read_checkpoint
from lockstep.checkpoint.verify import checkpoint_problems

DEFAULT_DIR = "/dev/shm/lockstep"
RUN_ID = "run_id"  # RUN/run_id: which snapshots under MEMORY_DIR are this run's


def held_here(run_dir: Path, memory_dir: Path, node: str) -> Path | None:
    """The newest snapshot of the run at `run_dir` that this node's memory still holds (not
    verified), or None."""
    try:
        rid = (Path(run_dir) / RUN_ID).read_text().strip()
    except OSError:  # a run that never took a snapshot
        return None
    held = list_checkpoints(Path(memory_dir) / rid / node) if rid else []
    return held[0] if held else None


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """The model's shape: a hash of its tensors' names, shapes and dtypes (not their values)."""
    return fingerprint_of((k, list(t.shape), str(t.dtype)) for k, t in tensors.items())


def fingerprint_of(listed) -> str:
    """fingerprint() of (name, shape, dtype) triples: a sharded layout's, gathered from its ranks."""
    return hashlib.sha256(json.dumps(sorted(listed)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Found:
    """A whole, verified snapshot of this run and this model on this node."""

    step: int
    path: Path


@dataclass(frozen=True)
class NodeSnapshots:
    """One node's snapshots of one run: MEMORY_DIR/RUN_ID/NODE."""

    memory_dir: Path
    run_id: str
    node: str

    @property
    def root(self) -> Path:
        return self.memory_dir / self.run_id / self.node

    def mark(self, model: str) -> dict:
        """What a snapshot's state.json carries under SNAPSHOT_MARK: whose it is, and the model's fingerprint."""
        return {"run_id": self.run_id, "node": self.node, "model": model}

    def free_bytes(self) -> int:
        """Space left on the filesystem that holds MEMORY_DIR (its nearest existing parent)."""
        path = self.memory_dir
        while not path.exists() and path != path.parent:
            path = path.parent
        stat = os.statvfs(path)
        return stat.f_bavail * stat.f_frsize

    def newest(self, model: str) -> tuple[Found | None, list[str]]:
        """(the newest snapshot here that verifies, belongs to this run and has this model's shape;
        why each newer one was skipped). A damaged one (a flipped bit, a truncated file) fails its
        manifest's checksums and is never loaded."""
        skipped = []
        for path in list_checkpoints(self.root):
            why = self.problem(path, model)
            if why is None:
                return Found(step_of(path), path), skipped
            skipped.append(f"{path}: {why}")
        return None, skipped

    def problem(self, path: Path, model: str) -> str | None:
        """Why the snapshot at `path` cannot be used by this run and model, or None."""
        problems = checkpoint_problems(path, snapshot=True)
        if problems:
            return "; ".join(problems)
        return self.mark_problem(path, model)

    def mark_problem(self, path: Path, model: str) -> str | None:
        """Why the snapshot at `path`, by its state.json, is not this run's or this model's, or None."""
        mark = json.loads((path / STATE).read_text()).get(SNAPSHOT_MARK) or {}
        if mark.get("run_id") != self.run_id:
            return f"a snapshot of run {mark.get('run_id')!r}, not of this run ({self.run_id})"
        if mark.get("model") != model:
            return f"a model of another shape (fingerprint {mark.get('model')}, this one {model})"
        return None

    def read(self, found: Found) -> Checkpoint:
        """A snapshot newest() found, read (verified there: snapshots are not opened as checkpoints)."""
        return read_checkpoint(found.path, load_file(found.path / MODEL))

    def files(self, found: Found) -> dict[str, bytes]:
        """Every file of a snapshot, to send to a node that lacks it."""
        return {p.name: p.read_bytes() for p in sorted(found.path.iterdir()) if p.is_file()}

    def receive(self, step: int, files: dict[str, bytes]) -> Path:
        """Commit a snapshot a peer sent (its files, manifest included) as this node's newest."""
        if MANIFEST not in files:
            raise ValueError(f"a snapshot of step {step} without its {MANIFEST}")
        tmp, final = start_save(self.root, step)
        for name, data in files.items():
            (tmp / Path(name).name).write_bytes(data)
        # a stale copy of the same step is replaced as a re-save replaces one
        commit_dir(tmp, final)
        move_latest(final, keep_last=1)
        return final

    def keep_only(self, step: int) -> None:
        """Remove every snapshot here but the one of `step` (newer ones are damaged or abandoned)."""
        for path in list_checkpoints(self.root):
            if step_of(path) != step:
                shutil.rmtree(path, ignore_errors=True)

    def clear(self) -> None:
        """Remove this node's snapshots of the run (and the run's directory once no node has any)."""
        shutil.rmtree(self.root, ignore_errors=True)
        try:
            self.root.parent.rmdir()
        except OSError:  # another node's snapshots are still there, or it is gone already
            pass
