"""parallel.grad_compression through `lockstep train --world-size 2`: PowerSGD's state in the checkpoint and an exact
resume from it, and --check-grads on the decompressed gradients. The settings refused before
training starts (compression under FSDP): tests/unit/parallel/test_mesh.py, in-process."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY, run_lockstep
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def _args(run, corpus, token_cache, *extra):
    return (
        "train",
        "--world-size",
        "2",
        "--output-dir",
        run,
        *TINY,
        "--data",
        corpus,
        "--global-batch-size",
        "8",
        "--max-steps",
        "12",
        "--save-interval",
        "6",
        "--eval-interval",
        "0",
        "--mixed-precision",
        "no",
        "--set",
        f"data.cache_dir={token_cache}",
        "--grad-compression",
        "powersgd",
        "--set",
        "parallel.powersgd_rank=2",
        "--set",
        "parallel.powersgd_start_step=3",
        # small buckets: several per step, rebuilt by DDP after its first step, in the resumed run too
        "--set",
        "parallel.bucket_cap_mb=0.01",
        *extra,
    )


def _weights(run, step):
    return load_file(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus, token_cache):
    """The 12-step run and what it printed, read by both resume tests (read only: each resumes into
    a run directory of its own). --check-grads only hashes the gradients: the exact resume below,
    which runs without it, ends with this run's weights bit for bit."""
    run = tmp_path_factory.mktemp("powersgd") / "straight"
    return run, run_lockstep(*_args(run, corpus, token_cache, "--check-grads"))


def test_powersgd_resumes_exactly_from_its_checkpoint(tmp_path, corpus, token_cache, uninterrupted):
    (straight, proc), resumed = uninterrupted, tmp_path / "resumed"
    assert "grad compression: powersgd (torch's powerSGD_hook: rank 2" in proc.stderr
    # every rank ends each step with the same decompressed gradients, which --check-grads hashes
    assert (
        "parallel.check_grads: gradients were identical on all 2 ranks after each of 12 steps"
        in proc.stderr
    )

    ckpt = straight / "checkpoints" / "step_00000006"
    saved = torch.load(ckpt / "grad_compression.pt", weights_only=True)
    assert saved["kind"] == "powersgd" and saved["world_size"] == 2 and saved["iter"] == 6
    assert len(saved["errors"]) == 2 and saved["errors"][0].keys() == saved["errors"][1].keys()
    assert any(
        not torch.equal(saved["errors"][0][k], saved["errors"][1][k]) for k in saved["errors"][0]
    )  # per rank
    assert "grad_compression.pt" in json.loads((ckpt / "manifest.json").read_text())["files"]
    assert run_lockstep("verify", straight).returncode == 0

    run_lockstep(*_args(resumed, corpus, token_cache, "--resume", ckpt))
    a, b = _weights(straight, 12), _weights(resumed, 12)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resuming with PowerSGD's state"


def test_resume_without_its_error_feedback_is_not_exact(
    tmp_path, corpus, token_cache, uninterrupted
):
    # the state is what makes the resume exact: the same resume, its error feedback zeroed, ends elsewhere
    (straight, _), resumed = uninterrupted, tmp_path / "resumed"
    ckpt = straight / "checkpoints" / "step_00000006"
    saved = torch.load(ckpt / "grad_compression.pt", weights_only=True)
    saved["errors"] = [{k: torch.zeros_like(v) for k, v in e.items()} for e in saved["errors"]]
    copy = tmp_path / "step_00000006"
    copy.mkdir()
    for f in ckpt.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    torch.save(saved, copy / "grad_compression.pt")
    manifest = json.loads((copy / "manifest.json").read_text())
    from lockstep.checkpoint.manifest import file_entry, manifest_digest  # reseal the edited copy

    manifest["files"]["grad_compression.pt"] = file_entry(copy / "grad_compression.pt")
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    run_lockstep(*_args(resumed, corpus, token_cache, "--resume", copy))
    a, b = _weights(straight, 12), _weights(resumed, 12)
    assert any(not torch.equal(a[name], b[name]) for name in a)
