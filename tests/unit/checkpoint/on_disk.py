"""Small real checkpoints for the checkpoint tests, and the ways they damage them (helpers, no tests)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint.manifest import file_entry, manifest_digest
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.resume import resolve_resume


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"wte.weight": torch.randn(16, 8, generator=g), "ln.bias": torch.randn(8, generator=g)}


def save(run, step, seed=None, keep_last=3, **kw):
    """A plain checkpoint of `step` with tensors(seed or step) and state {"step": step}."""
    return save_checkpoint(
        run,
        step,
        tensors(step if seed is None else seed),
        None,
        None,
        {"step": step},
        keep_last=keep_last,
        **kw,
    )


def save_run_state(run, step, compression: bool = False):
    """A checkpoint as the trainer writes it: optimizer state, one RNG state per rank, the resume
    fields; with `compression`, PowerSGD's state of 2 ranks too (grad_compression.pt)."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {
        "step": step,
        "cursor": {"epoch": 0, "offset": 8 * step},
        "scheduler": {"last_epoch": step},
        "world_size": 2,
        "grad_scaler": None,
        "config": {"model": {"kind": "custom"}},
    }
    rng = [{"torch": torch.get_rng_state(), "python": random.getstate()} for _ in range(2)]
    return save_checkpoint(
        run,
        step,
        model.state_dict(),
        opt.state_dict(),
        rng,
        state,
        compression=powersgd_state(2, step) if compression else None,
    )


def powersgd_state(world_size: int, step: int) -> dict:
    """grad_compression.pt as lockstep.train.setup.save_compression_state gathers it for a
    Linear(4, 2): Q for its weight (the same on every rank), each rank's own error feedback."""
    g = torch.Generator().manual_seed(step)
    return {
        "format": 1,
        "kind": "powersgd",
        "world_size": world_size,
        "iter": step,
        "q": {"weight": torch.randn(4, generator=g)},
        "errors": [
            {"weight": torch.randn(8, generator=g), "bias": torch.randn(2, generator=g)}
            for _ in range(world_size)
        ],
    }


def snapshot(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def latest_name(run) -> str:
    return (Path(run) / "checkpoints" / "latest").read_text().strip()


def assert_unchanged(run, before, latest):
    """The checkpoint `latest` still holds the bytes of `before`, `latest` names it, and a resume takes it."""
    assert snapshot(run / "checkpoints" / latest) == before
    assert latest_name(run) == latest
    assert resolve_resume(run, "auto", log=pytest.fail).name == latest


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def truncate(file: Path, keep: int = 40) -> None:
    file.write_bytes(file.read_bytes()[:keep])


def reseal(path: Path) -> None:
    """Re-write the manifest for the files as they are now, as a tool (or a bug) that rewrote one would."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {name: file_entry(path / name) for name in manifest["files"]}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2))
