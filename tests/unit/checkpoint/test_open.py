"""Either kind of checkpoint through one door (lockstep/checkpoint/open.py): verify_checkpoint and load_checkpoint
on a plain and on a sharded checkpoint, the DCP content check only where the checkpoint is sharded, and DCP
imported only then."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import one_process

from lockstep.checkpoint.open import load_checkpoint, verify_checkpoint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.sharded import save_sharded_checkpoint
from lockstep.checkpoint.verify import checkpoint_problems
from lockstep.errors import CheckpointError

from .on_disk import reseal, save, truncate


def test_load_damaged_raises(tmp_path):
    path = save(tmp_path, 1)
    truncate(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)


def _trained_linear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _both_kinds(tmp_path):
    """(a plain checkpoint, a sharded one written by one process, the model's weights in both)."""
    model, optimizer = _trained_linear()
    meta = (["rng0"], {"step": 2}, {"tokenizer.json": b"{}"})
    plain = save_checkpoint(
        tmp_path / "plain", 2, model.state_dict(), optimizer.state_dict(), *meta
    )
    sharded = save_sharded_checkpoint(
        one_process(), tmp_path / "sharded", 2, model, optimizer, *meta, keep_last=1
    )
    return plain, sharded, {k: v.clone() for k, v in model.state_dict().items()}


def test_load_checkpoint_opens_either_kind(tmp_path):
    plain, sharded, weights = _both_kinds(tmp_path)
    for path in (plain, sharded):
        assert verify_checkpoint(path) == []
        ckpt = load_checkpoint(path)
        assert ckpt.path == path and ckpt.tensors.keys() == weights.keys()
        assert all(torch.equal(ckpt.tensors[k], v) for k, v in weights.items()), path
        assert (
            ckpt.state == {"step": 2}
            and ckpt.rng_states == ["rng0"]
            and ckpt.extra == {"tokenizer.json": b"{}"}
        )
    assert sorted(load_checkpoint(plain).optimizer_state) == ["param_groups", "state"]
    # sharded: only load_sharded_checkpoint restores it
    assert load_checkpoint(sharded).optimizer_state is None


def test_the_dcp_content_check_runs_on_a_sharded_checkpoint_only(tmp_path):
    plain, sharded, _ = _both_kinds(tmp_path)
    # a file that verify hashes, re-sealed: only a content check sees it
    for path in (plain, sharded):
        (path / "rng.pt").write_bytes(b"not a pickle")
        reseal(path)
    (sharded / ".metadata").write_bytes(b"not DCP's index")
    reseal(sharded)
    # the common check knows no DCP
    assert checkpoint_problems(sharded) == [checkpoint_problems(plain)[0]]
    problems = verify_checkpoint(sharded)
    assert len(problems) == 2 and problems[0].startswith(".metadata: unreadable ("), problems
    assert problems[1] == checkpoint_problems(plain)[0] == verify_checkpoint(plain)[0]
    assert problems[1].startswith("rng.pt: torch.load(weights_only=True) refuses it")
    for path in (plain, sharded):
        with pytest.raises(CheckpointError, match=rf"^checkpoint {path} is damaged \("):
            load_checkpoint(path)


# Which modules `verify_checkpoint` and `load_checkpoint` import, in a fresh process.
IMPORTED = """
import sys
from lockstep.checkpoint.open import load_checkpoint, verify_checkpoint
assert verify_checkpoint(sys.argv[1]) == []
load_checkpoint(sys.argv[1])
print("torch.distributed.checkpoint" in sys.modules)
"""


def test_dcp_is_imported_for_a_sharded_checkpoint_only(tmp_path):
    plain, sharded, _ = _both_kinds(tmp_path)
    for path, imported in ((plain, "False"), (sharded, "True")):
        proc = subprocess.run(
            [sys.executable, "-c", IMPORTED, str(path)], capture_output=True, text=True, timeout=120
        )
        assert (proc.returncode, proc.stdout.strip()) == (0, imported), proc.stderr[-3000:]
