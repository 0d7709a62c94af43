"""The commit protocol on real files (lockstep/checkpoint/commit.py): the manifest sealed and renamed into place,
`latest` moved, keep-last pruning (newer dirs of an abandoned timeline left alone), unfinished temporary dirs
ignored then removed, a step saved again, crashes before the seal and at the rename, arguments refused before the
disk is touched, and a run dir that cannot be written."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tmpfs import read_only, tmpfs

from lockstep.checkpoint.commit import (
    check_save_args,
    explain_write_errors,
    list_checkpoints,
    move_latest,
    seal,
    start_save,
    write_file,
)
from lockstep.checkpoint.manifest import FORMAT, manifest_digest
from lockstep.checkpoint.open import load_checkpoint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.resume import resolve_resume
from lockstep.errors import CheckpointError
from lockstep.runtime import Runtime

from .on_disk import assert_unchanged, dead_pid, latest_name, save, snapshot, tensors


@pytest.fixture
def mount(tmp_path):
    """A fresh tmpfs at tmp_path/mnt, writable until `read_only(mnt)`; unmounted afterwards."""
    with tmpfs(tmp_path / "mnt") as mnt:
        yield mnt


def test_latest_moves_and_keep_last_prunes(tmp_path):
    save(tmp_path, 10)
    assert latest_name(tmp_path) == "step_00000010"
    for step in (20, 30, 40, 50):
        save(tmp_path, step, keep_last=2)
        assert latest_name(tmp_path) == f"step_{step:08d}"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000050", "step_00000040"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step_00000040",
        "step_00000050",
    ]


def test_stale_tmp_dir_ignored_then_removed(tmp_path):
    good = save(tmp_path, 10)
    root = tmp_path / "checkpoints"
    dead = root / f".tmp-step_00000020-{dead_pid()}"  # a crashed run's half-written save
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    live = root / f".tmp-step_00000020-{os.getppid()}"  # a (pretend) concurrent saver still alive
    live.mkdir()
    assert list_checkpoints(tmp_path) == [good]
    assert resolve_resume(tmp_path, "auto", log=pytest.fail) == good
    save(tmp_path, 30)
    assert not dead.exists() and live.exists()


def test_resave_same_step_replaces(tmp_path):
    save(tmp_path, 10)
    path = save(tmp_path, 20, seed=1)
    assert save(tmp_path, 20, seed=2) == path
    assert torch.equal(load_checkpoint(path).tensors["wte.weight"], tensors(2)["wte.weight"])
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000020", "step_00000010"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_crash_at_rename_keeps_previous(tmp_path, monkeypatch):
    prev = save(tmp_path, 10)
    before = snapshot(prev)
    real_rename = os.rename

    def rename(src, dst):  # fail the rename that would bring the new dir in
        if Path(str(src)).name.startswith(".tmp-step_"):
            raise OSError("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="power cut"):
        save(tmp_path, 20)
    assert_unchanged(tmp_path, before, prev.name)
    # re-saving the same step: the old one is put back
    with pytest.raises(OSError, match="power cut"):
        save(tmp_path, 10, seed=5)
    assert_unchanged(tmp_path, before, prev.name)


def test_invalid_inputs_write_nothing(tmp_path):
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(tmp_path, 1, tensors(), None, None, {"bad": object()})
    with pytest.raises(CheckpointError, match="not allowed"):
        save_checkpoint(tmp_path, 1, tensors(), None, None, {}, extra={"state.json": b"x"})
    with pytest.raises(CheckpointError, match="keep_last"):
        save_checkpoint(tmp_path, 1, tensors(), None, None, {}, keep_last=0)
    assert not (tmp_path / "checkpoints").exists()


def test_checkpoint_save_into_a_read_only_directory(mount):
    run = mount / "run"
    first = save_checkpoint(run, 1, {"w": torch.ones(2)}, None, None, {"step": 1})
    read_only(mount)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(run, 2, {"w": torch.zeros(2)}, None, None, {"step": 2})
    assert str(e.value).startswith(
        f"cannot write the checkpoint of step 2 under {run / 'checkpoints'} "
        "(Read-only file system: "
    ), e.value
    assert str(e.value).endswith(
        "its filesystem is mounted read-only: remount it read-write, or pass another "
        "--output-dir (checkpoint.output_dir); then run again to resume"
    )
    assert list_checkpoints(run) == [first]

    from lockstep.checkpoint.sharded import save_sharded_checkpoint

    rt = Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "localhost")
    with pytest.raises(
        CheckpointError,
        match=r"failed on rank 0 \(CheckpointError: cannot write the checkpoint of "
        r"step 2 .*Read-only file system.*remount it read-write",
    ):
        save_sharded_checkpoint(
            rt, run, 2, torch.nn.Linear(2, 2), None, None, {"step": 2}, {}, keep_last=2
        )
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", first.name]


def test_seal_lists_every_file_and_takes_known_entries_as_given(tmp_path):
    tmp, final = start_save(tmp_path, 4)
    assert final == tmp_path / "checkpoints" / "step_00000004"
    assert tmp == final.with_name(f".tmp-step_00000004-{os.getpid()}") and tmp.is_dir()
    write_file(tmp / "a.bin", lambda f: f.write(b"abc"))
    (tmp / "shard").write_bytes(b"xyz")
    known = {"shard": {"bytes": 3, "sha256": "hashed by the rank that wrote it"}}
    seal(tmp, final, 4, known, layout="sharded")
    assert not tmp.exists() and sorted(p.name for p in final.iterdir()) == [
        "a.bin",
        "manifest.json",
        "shard",
    ]
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["files"] == {
        "a.bin": {"bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()},
        "shard": known["shard"],
    }
    assert (manifest["format"], manifest["step"], manifest["layout"]) == (FORMAT, 4, "sharded")
    assert manifest["manifest_sha256"] == manifest_digest(manifest)
    assert list_checkpoints(tmp_path) == [final]
    assert not (
        tmp_path / "checkpoints" / "latest"
    ).exists()  # committed; `latest` moves in move_latest
    move_latest(final, keep_last=1)
    assert latest_name(tmp_path) == "step_00000004"


# A writer that dies after its writes and before seal: the power cut between the two, in a real process.
CRASH_BEFORE_SEAL = """
import os, sys
from lockstep.checkpoint.commit import check_save_args, start_save, write_meta_files
state_json, extra = check_save_args(20, 3, {"step": 20}, {"tokenizer.json": b"{}"})
tmp, final = start_save(sys.argv[1], 20)
write_meta_files(tmp, None, state_json, extra)
(tmp / "model.safetensors").write_bytes(b"half of the weights")
os._exit(9)
"""


def test_a_crash_before_seal_leaves_the_previous_checkpoint_and_latest(tmp_path):
    prev = save(tmp_path, 10)
    before = snapshot(prev)
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_BEFORE_SEAL, str(tmp_path)], stderr=subprocess.PIPE
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 9, err.decode()
    left = tmp_path / "checkpoints" / f".tmp-step_00000020-{proc.pid}"
    assert sorted(p.name for p in left.iterdir()) == [
        "model.safetensors",
        "state.json",
        "tokenizer.json",
    ]
    assert list_checkpoints(tmp_path) == [prev]
    assert_unchanged(tmp_path, before, prev.name)
    save(tmp_path, 30)  # the next save removes what the dead writer left
    assert not left.exists() and latest_name(tmp_path) == "step_00000030"


def test_pruning_leaves_newer_dirs_of_an_abandoned_timeline(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step)
    # resumed at 10: 20 and 30 abandoned
    (tmp_path / "checkpoints" / "latest").write_text("step_00000010\n")
    save(tmp_path, 15, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_00000030",
        "step_00000020",
        "step_00000015",
    ]
    assert latest_name(tmp_path) == "step_00000015"
    assert resolve_resume(tmp_path, "auto", log=pytest.fail).name == "step_00000015"
    # this timeline reaches 20: its dir replaces the abandoned one
    again = save(tmp_path, 20, seed=99, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000030", "step_00000020"]
    assert torch.equal(load_checkpoint(again).tensors["wte.weight"], tensors(99)["wte.weight"])


def test_save_arguments_refused_with_the_rule():
    for step in (-1, True, 2.0, "3"):
        with pytest.raises(
            CheckpointError,
            match=rf"^step {re.escape(repr(step))} is not a non-negative int; pass ",
        ):
            check_save_args(step, 3, {}, None)
    with pytest.raises(CheckpointError, match=r"^keep_last True must be an int >= 1; set how many"):
        check_save_args(1, True, {}, None)
    for name, data in (
        (".hidden", b""),
        ("__0_0.distcp", b""),
        ("sub/file", b""),
        ("", b""),
        ("rng.pt", b""),
        ("notes.txt", "text, not bytes"),
    ):
        with pytest.raises(
            CheckpointError,
            match=rf"^extra file {re.escape(repr(name))} \({type(data).__name__}\) "
            "is not allowed: pass bytes under a plain file name",
        ):
            check_save_args(1, 3, {}, {name: data})
    assert check_save_args(1, 3, {"b": 1, "a": [None]}, {"notes.txt": b"x"}) == (
        b'{\n  "a": [\n    null\n  ],\n  "b": 1\n}',
        {"notes.txt": b"x"},
    )


@pytest.mark.skipif(
    not Path("/dev/full").exists(), reason="needs /dev/full, a device that is always full"
)
def test_write_errors_a_user_can_fix_say_how(tmp_path):
    with pytest.raises(CheckpointError) as e:
        with explain_write_errors(tmp_path, 3):
            write_file(Path("/dev/full"), lambda f: f.write(b"weights"))
    assert str(e.value).startswith(
        f"cannot write the checkpoint of step 3 under {tmp_path / 'checkpoints'} "
        "(No space left on device: "
    )
    assert str(e.value).endswith(
        "the disk is full: free space there, or pass another --output-dir "
        "(checkpoint.output_dir); then run again to resume"
    )
    with pytest.raises(FileNotFoundError):  # not the disk's fault: passed on as it is
        with explain_write_errors(tmp_path, 3):
            write_file(tmp_path / "no-such-dir" / "x", lambda f: f.write(b""))
