"""What a committed checkpoint dir holds (lockstep/checkpoint/manifest.py): step dir names, the caller's extra
files, which kind of checkpoint it is, and the manifest: every file's size and sha256, its own checksum, the
formats it reads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import one_process

from lockstep.checkpoint.manifest import (
    STEP_DIR,
    file_entry,
    is_extra,
    is_sharded,
    manifest_digest,
    read_manifest,
    step_of,
)
from lockstep.checkpoint.open import load_checkpoint, verify_checkpoint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.resume import resolve_resume
from lockstep.checkpoint.verify import quick_check

from .on_disk import save, save_run_state, tensors


def test_manifest_checksums(tmp_path):
    path = save_checkpoint(
        tmp_path,
        3,
        tensors(),
        {"state": {}, "param_groups": []},
        [{"a": 1}],
        {"step": 3},
        extra={"notes.txt": b"hello"},
    )
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 3 and manifest["step"] == 3
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # its own checksum: sha256 of the canonical JSON (sorted keys, no spaces) of everything else in it
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    assert manifest["manifest_sha256"] == hashlib.sha256(canonical).hexdigest()
    assert verify_checkpoint(path) == [] and quick_check(path) == []


def _flip_bit(file: Path, inside: str, bit: int = 0x01) -> None:
    """Flip one bit of the first character of `inside` (a value the manifest records) in file."""
    raw = bytearray(file.read_bytes())
    i = raw.index(inside.encode())
    raw[i] ^= bit
    file.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["sha256", "bytes", "own checksum"])
def test_flipped_bit_in_the_manifest_blames_the_manifest(tmp_path, where):
    good, bad = save_run_state(tmp_path, 10), save_run_state(tmp_path, 20)
    manifest = json.loads((bad / "manifest.json").read_text())
    entry = manifest["files"]["optimizer.pt"]
    target = {
        "sha256": entry["sha256"],
        "bytes": str(entry["bytes"])[1:],  # not the leading digit: still JSON
        "own checksum": manifest["manifest_sha256"],
    }[where]
    _flip_bit(bad / "manifest.json", target)
    # valid JSON, one value changed
    assert json.loads((bad / "manifest.json").read_text()) != manifest
    problems = verify_checkpoint(bad)
    assert problems == [
        "manifest.json damaged: its contents no longer match its own checksum (manifest_sha256), "
        "so the files it lists cannot be checked against it"
    ], problems
    assert quick_check(bad) == problems
    logs = []
    assert resolve_resume(tmp_path, "auto", log=logs.append) == good
    assert "step_00000020 is damaged (manifest.json damaged" in logs[0]


def test_manifests_without_their_own_checksum(tmp_path):
    path = save_run_state(tmp_path, 20)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["manifest_sha256"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == [
        "manifest.json damaged: a format-3 manifest without its manifest_sha256"
    ]
    # written by lockstep before the manifest had a checksum of its own: still loads
    manifest["format"] = 2
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == [] and load_checkpoint(path).state["step"] == 20
    manifest["format"] = 7
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == ["manifest.json: not a format-1/2/3 manifest"]


def test_step_dirs_are_named_by_their_step(tmp_path):
    assert step_of(Path("runs/a/checkpoints/step_00000042")) == 42
    assert step_of(Path("step_123456789")) == 123456789  # past 10^8 steps the name grows a digit
    for name in (
        "step_0000042",
        "step_00000042.old",
        ".tmp-step_00000042-7",
        "step_-0000042",
        "latest",
    ):
        assert STEP_DIR.match(name) is None, name
    assert step_of(save(tmp_path, 7)) == 7  # the name a save gives its dir reads back as its step


def test_extra_files_are_the_callers_own(tmp_path):
    names = [
        "tokenizer.json",
        "notes.txt",
        "model.safetensors",
        "optimizer.pt",
        "rng.pt",
        "state.json",
        "manifest.json",
        ".metadata",
        "__0_0.distcp",
    ]
    assert [name for name in names if is_extra(name)] == ["tokenizer.json", "notes.txt"]
    path = save_run_state(tmp_path, 3)
    save_checkpoint(
        tmp_path, 4, tensors(), None, None, {"step": 4}, extra={"tokenizer.json": b"{}"}
    )
    listed = json.loads((tmp_path / "checkpoints" / "step_00000004" / "manifest.json").read_text())[
        "files"
    ]
    assert [name for name in listed if is_extra(name)] == ["tokenizer.json"]
    assert not any(
        is_extra(name) for name in json.loads((path / "manifest.json").read_text())["files"]
    )


def test_manifest_digest_is_the_sha256_of_its_canonical_json():
    manifest = {"step": 5, "format": 3, "files": {"a": {"sha256": "00", "bytes": 1}}}
    digest = manifest_digest(manifest)
    assert (
        digest
        == hashlib.sha256(
            b'{"files":{"a":{"bytes":1,"sha256":"00"}},"format":3,"step":5}'
        ).hexdigest()
    )
    assert manifest_digest(dict(reversed(manifest.items()))) == digest  # key order does not matter
    # its own checksum is left out
    assert manifest_digest({**manifest, "manifest_sha256": "its own"}) == digest
    assert manifest_digest({**manifest, "step": 6}) != digest


def test_file_entry_hashes_a_file_larger_than_one_chunk(tmp_path):
    data = bytes(range(256)) * 9000  # 2.3 MB: three 1 MiB reads
    (tmp_path / "big.bin").write_bytes(data)
    assert file_entry(tmp_path / "big.bin") == {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def _sharded_linear(run) -> Path:
    from lockstep.checkpoint.sharded import save_sharded_checkpoint

    return save_sharded_checkpoint(
        one_process(), run, 1, torch.nn.Linear(2, 2), None, None, {"step": 1}, {}, keep_last=1
    )


def test_is_sharded_from_the_manifest_or_dcp_index(tmp_path):
    plain = save(tmp_path / "plain", 1)
    sharded = _sharded_linear(tmp_path / "sharded")
    assert not is_sharded(plain) and is_sharded(sharded)
    assert json.loads((sharded / "manifest.json").read_text())["layout"] == "sharded"
    (
        sharded / "manifest.json"
    ).unlink()  # the manifest gone: DCP's index (and no model.safetensors) still says it
    (plain / "manifest.json").unlink()
    assert is_sharded(sharded) and not is_sharded(plain)
    assert not is_sharded(tmp_path / "nope")


def test_read_manifest_says_what_is_wrong(tmp_path):
    path = save(tmp_path, 3)
    manifest, problem = read_manifest(path)
    assert (
        problem is None
        and manifest["step"] == 3
        and sorted(manifest["files"]) == ["model.safetensors", "state.json"]
    )
    (path / "manifest.json").write_text("[1, 2]")
    assert read_manifest(path) == (None, "manifest.json: holds a list, not a manifest")
    (path / "manifest.json").write_text("{cut off")
    manifest, problem = read_manifest(path)
    assert manifest is None and problem.startswith(
        "manifest.json: unreadable (Expecting property name"
    ), problem
    (path / "manifest.json").unlink()
    assert read_manifest(path) == (None, "manifest.json: missing (the save never finished)")
