"""`lockstep verify` and `lockstep train --resume auto` on a real run whose newest checkpoints are damaged in ways only
content checks see (the manifest re-sealed over the edit), or whose manifest itself lost a bit: verify says
DAMAGED with the reason, and the resume falls back to an older checkpoint instead of stopping with a traceback.

Each kind of damage goes through the library calls that `verify` and the resume use; one real `lockstep train`
then resumes past two damaged checkpoints at once."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_lockstep, run_main

from lockstep.checkpoint.manifest import file_entry, manifest_digest
from lockstep.checkpoint.report import verify_report
from lockstep.checkpoint.resume import resolve_resume

pytestmark = pytest.mark.slow


def _args(run: Path, corpus: Path, cache: Path, steps: int) -> list[str]:
    return [
        "train",
        "--data",
        str(corpus),
        "--output-dir",
        str(run),
        *TINY,
        "--global-batch-size",
        "8",
        "--max-steps",
        str(steps),
        "--save-interval",
        "2",
        "--set",
        f"data.cache_dir={cache}",
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus, token_cache) -> Path:
    """A 1-process run with checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("fallback") / "run"
    run_lockstep(*_args(run, corpus, token_cache, 6))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    return run


def _reseal(ckpt: Path) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {name: file_entry(ckpt / name) for name in manifest["files"]}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _edit_state(ckpt: Path, **fields) -> None:
    state = json.loads((ckpt / "state.json").read_text())
    state.update(fields)
    (ckpt / "state.json").write_text(json.dumps(state))
    _reseal(ckpt)


def _touch(path):
    Path(path).write_text("executed")


class _Evil:
    def __reduce__(self):
        return (_touch, (os.environ.get("PWNED_MARKER", "/nonexistent/pwned"),))


def _evil_optimizer(ckpt: Path) -> None:
    torch.save({"state": {}, "param_groups": [], "hook": _Evil()}, ckpt / "optimizer.pt")
    _reseal(ckpt)


def _evil_compression(ckpt: Path) -> None:
    # PowerSGD's state: a 1-process run keeps none, so it is added and listed in the manifest
    torch.save({"kind": "powersgd", "hook": _Evil()}, ckpt / "grad_compression.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["grad_compression.pt"] = {}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    _reseal(ckpt)


def _flip_bit_in_recorded_sha256(ckpt: Path) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    raw = bytearray((ckpt / "manifest.json").read_bytes())
    i = raw.index(manifest["files"]["optimizer.pt"]["sha256"].encode())
    raw[i] ^= 0x01  # one bit: a hex digit becomes its neighbour, still valid JSON
    (ckpt / "manifest.json").write_bytes(bytes(raw))


DAMAGE = {
    # item: how the newest checkpoint is damaged, what verify says about it
    "cursor-type": (
        lambda c: _edit_state(c, cursor=32),
        "state.json: cursor is 32 (int); it must be an object with int epoch and offset >= 0",
    ),
    "step-type": (
        lambda c: _edit_state(c, step="4"),
        "state.json: step is '4' (str); it must be an int >= 0",
    ),
    "optimizer-pickle": (
        _evil_optimizer,
        "optimizer.pt: torch.load(weights_only=True) refuses it (UnpicklingError: "
        f"global {_touch.__module__}._touch is outside its allowlist)",
    ),
    "compression-pickle": (
        _evil_compression,
        "grad_compression.pt: torch.load(weights_only=True) refuses it (UnpicklingError: global "
        f"{_touch.__module__}._touch is outside its allowlist)",
    ),
    "manifest-bit": (
        _flip_bit_in_recorded_sha256,
        "manifest.json damaged: its contents no longer match its own checksum (manifest_sha256), so the "
        "files it lists cannot be checked against it",
    ),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_verify_says_damaged_and_resume_falls_back(trained, tmp_path, kind):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    damage, reason = DAMAGE[kind]
    damage(run / "checkpoints" / "step_00000006")

    ok, report = verify_report(run)  # what `lockstep verify RUN` prints
    assert not ok and f"step_00000006  DAMAGED: {reason}" in report, report
    assert "step_00000004  OK" in report and "--resume auto would take: step_00000004" in report
    assert "optimizer.pt: checksum mismatch" not in report  # the flipped bit is the manifest's
    notes: list[str] = []
    assert resolve_resume(run, "auto", log=notes.append) == run / "checkpoints" / "step_00000004"
    assert notes == [
        f"checkpoint step_00000006 is damaged ({reason}); falling back to step_00000004"
    ]


def test_training_resumes_past_damaged_checkpoints(trained, tmp_path, corpus, token_cache, capsys):
    # the two ways the resume itself used to fail: a TypeError from the sampler, and a refused unpickle
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    DAMAGE["optimizer-pickle"][0](run / "checkpoints" / "step_00000006")
    DAMAGE["cursor-type"][0](run / "checkpoints" / "step_00000004")
    assert run_main(capsys, "verify", run)[0] == 1  # `lockstep verify RUN`'s exit code

    marker = tmp_path / "pwned"
    resumed = run_lockstep(
        *_args(run, corpus, token_cache, 8), env={"PWNED_MARKER": str(marker)}, check=False
    )
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    for step, kind in ((6, "optimizer-pickle"), (4, "cursor-type")):
        assert (
            f"checkpoint step_{step:08d} is damaged ({DAMAGE[kind][1]}); falling back to step_{step - 2:08d}"
            in resumed.stderr
        ), resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in resumed.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    assert not marker.exists()  # the refused pickle never ran
