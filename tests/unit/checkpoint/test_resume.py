"""Which checkpoint a run resumes from (lockstep/checkpoint/resume.py), on real files: `latest` and the timeline
it names, the fall-back past damaged checkpoints (touching none of them), and --resume none | auto |
CHECKPOINT_DIR | RUN_DIR."""

from __future__ import annotations

import json

import pytest

from lockstep.checkpoint.open import verify_checkpoint
from lockstep.checkpoint.report import verify_report
from lockstep.checkpoint.resume import auto_resume, resolve_resume, resume_order
from lockstep.errors import CheckpointError

from .on_disk import latest_name, save, snapshot, truncate


def test_truncated_model_falls_back_and_touches_nothing(tmp_path):
    good, bad = save(tmp_path, 100), save(tmp_path, 120)
    truncate(bad / "model.safetensors", 300)
    problems = verify_checkpoint(bad)
    size = json.loads((bad / "manifest.json").read_text())["files"]["model.safetensors"]["bytes"]
    assert problems == [f"model.safetensors: 300 bytes, manifest says {size} (truncated?)"]
    before = {p: snapshot(p) for p in (good, bad)}
    logs = []
    assert resolve_resume(tmp_path, "auto", log=logs.append) == good
    assert len(logs) == 1 and "step_00000120 is damaged (model.safetensors: 300 bytes" in logs[0]
    assert logs[0].endswith("falling back to step_00000100")
    assert {p: snapshot(p) for p in (good, bad)} == before
    assert latest_name(tmp_path) == "step_00000120"


def test_latest_names_missing_dir(tmp_path):
    save(tmp_path, 10)
    newest = save(tmp_path, 20)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000030\n")
    logs = []
    assert resolve_resume(tmp_path, "auto", log=logs.append) == newest
    assert "'step_00000030', which does not exist" in logs[0]


def test_checkpoint_newer_than_latest_is_ignored(tmp_path):
    save(tmp_path, 10)
    current = save(tmp_path, 20)
    save(tmp_path, 30)  # an abandoned timeline: `latest` is put back on 20 below
    (tmp_path / "checkpoints" / "latest").write_text("step_00000020\n")
    assert resolve_resume(tmp_path, "auto", log=pytest.fail) == current
    ok, report = verify_report(tmp_path)
    assert (
        ok
        and "newer than `latest`" in report
        and "--resume auto would take: step_00000020" in report
    )


def test_all_damaged_raises(tmp_path):
    for step in (10, 20):
        truncate(save(tmp_path, step) / "model.safetensors")
    logs = []
    with pytest.raises(CheckpointError) as e:
        resolve_resume(tmp_path, "auto", log=logs.append)
    msg = str(e.value)
    assert "step_00000010" in msg and "step_00000020" in msg and "--resume none" in msg
    assert len(logs) == 2 and logs[-1].endswith("no older checkpoint left")


def test_resolve_resume_modes(tmp_path):
    assert resolve_resume(tmp_path, "none") is None
    assert resolve_resume(tmp_path, "auto") is None  # nothing saved yet: start fresh
    first, second = save(tmp_path, 1), save(tmp_path, 2)
    assert resolve_resume("/ignored", str(first)) == first
    assert resolve_resume("/ignored", str(tmp_path)) == second  # a run dir behaves like auto
    assert resolve_resume("/ignored", str(tmp_path / "checkpoints")) == second
    truncate(first / "state.json", 3)
    with pytest.raises(CheckpointError, match="or start fresh with --resume none"):
        resolve_resume("/ignored", str(first))
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume("/ignored", str(tmp_path / "missing"))
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="run dir has no checkpoints"):
        resolve_resume("/ignored", str(tmp_path / "empty"))


def test_resume_order_follows_latest(tmp_path):
    assert resume_order(tmp_path) == ([], None, None)  # nothing saved yet
    c10, c20, c30 = (save(tmp_path, step) for step in (10, 20, 30))
    assert resume_order(tmp_path) == ([c30, c20, c10], "step_00000030", None)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000020\n")
    assert resume_order(tmp_path) == ([c20, c10], "step_00000020", None)
    (tmp_path / "checkpoints" / "latest").unlink()
    assert resume_order(tmp_path) == ([c30, c20, c10], None, "`latest` is missing")
    logs = []
    assert resolve_resume(tmp_path, "auto", log=logs.append) == c30
    assert logs == ["`latest` is missing; falling back to the newest checkpoint, step_00000030"]


def test_auto_resume_asks_its_verify_newest_first(tmp_path):
    c10, c20 = save(tmp_path, 10), save(tmp_path, 20)
    asked, logs = [], []

    def verify(ckpt):
        asked.append(ckpt.name)
        return ["it said no"] if ckpt == c20 else []

    assert auto_resume(tmp_path, logs.append, verify=verify) == c10
    assert asked == ["step_00000020", "step_00000010"]
    assert logs == [
        "checkpoint step_00000020 is damaged (it said no); falling back to step_00000010"
    ]
    # no checkpoints: start fresh
    assert auto_resume(tmp_path / "elsewhere", pytest.fail, verify=pytest.fail) is None
