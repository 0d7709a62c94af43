"""Checkpoint commit protocol on real files: round trip, manifest, `latest`, pruning, damage, crashes."""

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lockstep.checkpoint as ck
from lockstep.checkpoint import (
    CheckpointError, check_shapes, list_checkpoints, load_checkpoint, read_tensor_shapes, resolve_resume,
    save_checkpoint, verify_checkpoint,
)
from lockstep.checkpoint_report import verify_report


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"wte.weight": torch.randn(16, 8, generator=g), "ln.bias": torch.randn(8, generator=g)}


def _save(run, step, seed=None, keep_last=3, **kw):
    return save_checkpoint(run, step, _tensors(step if seed is None else seed), None, None,
                           {"step": step}, keep_last=keep_last, **kw)


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _latest(run) -> str:
    return (Path(run) / "checkpoints" / "latest").read_text().strip()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _truncate(file: Path, keep: int = 40) -> None:
    file.write_bytes(file.read_bytes()[:keep])


def test_round_trip(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    rng = [{"torch": torch.get_rng_state(), "python": random.getstate(), "rank": r} for r in range(2)]
    state = {"step": 7, "cursor": 123, "config": {"model": {"hidden_size": 3}}, "world_size": 2}
    path = save_checkpoint(tmp_path, 7, model.state_dict(), opt.state_dict(), rng, state,
                           extra={"tokenizer.json": b'{"v": 1}'})
    assert path == tmp_path / "checkpoints" / "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["model.safetensors", "optimizer.pt", "rng.pt", "state.json", "manifest.json", "tokenizer.json"])

    ckpt = load_checkpoint(path)
    assert ckpt.tensors.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(ckpt.tensors[k], v)
    want = opt.state_dict()
    assert ckpt.optimizer_state["param_groups"] == want["param_groups"]
    for i, s in want["state"].items():
        for k, v in s.items():
            assert torch.equal(ckpt.optimizer_state["state"][i][k], v)
    assert len(ckpt.rng_states) == 2 and torch.equal(ckpt.rng_states[1]["torch"], rng[1]["torch"])
    assert ckpt.rng_states[0]["python"] == rng[0]["python"]
    assert ckpt.state == state and ckpt.extra == {"tokenizer.json": b'{"v": 1}'}
    # The loaded optimizer state drives a fresh optimizer.
    torch.optim.AdamW(model.parameters(), lr=1e-3).load_state_dict(ckpt.optimizer_state)
    assert read_tensor_shapes(path) == {"0.weight": (3, 4), "0.bias": (3,), "1.weight": (2, 3), "1.bias": (2,)}


def test_optional_parts_absent(tmp_path):
    ckpt = load_checkpoint(_save(tmp_path, 1))
    assert ckpt.optimizer_state is None and ckpt.rng_states is None and ckpt.extra == {}


def test_tied_weights_save_and_reload(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied: one storage, two names
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    path = save_checkpoint(tmp_path, 1, model.state_dict(), None, None, {})
    ckpt = load_checkpoint(path)
    assert torch.equal(ckpt.tensors["emb.weight"], ckpt.tensors["head.weight"])
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
    fresh["head"].weight = fresh["emb"].weight
    fresh.load_state_dict(ckpt.tensors)
    assert fresh["head"].weight is fresh["emb"].weight and torch.equal(fresh["emb"].weight, emb.weight)


def test_manifest_checksums(tmp_path):
    path = save_checkpoint(tmp_path, 3, _tensors(), {"state": {}, "param_groups": []}, [{"a": 1}],
                           {"step": 3}, extra={"notes.txt": b"hello"})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["step"] == 3
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(path) == []


def test_latest_moves_and_keep_last_prunes(tmp_path):
    _save(tmp_path, 10)
    assert _latest(tmp_path) == "step_00000010"
    for step in (20, 30, 40, 50):
        _save(tmp_path, step, keep_last=2)
        assert _latest(tmp_path) == f"step_{step:08d}"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000050", "step_00000040"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000040", "step_00000050"]


def test_truncated_model_falls_back_and_touches_nothing(tmp_path):
    good, bad = _save(tmp_path, 100), _save(tmp_path, 120)
    _truncate(bad / "model.safetensors", 300)
    problems = verify_checkpoint(bad)
    size = json.loads((bad / "manifest.json").read_text())["files"]["model.safetensors"]["bytes"]
    assert problems == [f"model.safetensors: 300 bytes, manifest says {size} (truncated?)"]
    before = {p: _snapshot(p) for p in (good, bad)}
    logs = []
    assert resolve_resume(tmp_path, "auto", log=logs.append) == good
    assert len(logs) == 1 and "step_00000120 is damaged (model.safetensors: 300 bytes" in logs[0]
    assert logs[0].endswith("falling back to step_00000100")
    assert {p: _snapshot(p) for p in (good, bad)} == before
    assert _latest(tmp_path) == "step_00000120"


def test_checksum_mismatch_and_bad_contents_reported(tmp_path):
    path = _save(tmp_path, 1)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    (path / "model.safetensors").write_bytes(bytes(data))
    assert verify_checkpoint(path) == ["model.safetensors: checksum mismatch"]

    path = _save(tmp_path, 2)
    (path / "manifest.json").unlink()
    (path / "state.json").write_text("{not json")
    (path / "model.safetensors").write_bytes(b"\x00" * 7)
    problems = verify_checkpoint(path)
    assert any(p.startswith("manifest.json: missing") for p in problems)
    assert any(p.startswith("state.json: not JSON") for p in problems)
    assert any(p.startswith("model.safetensors: safetensors header unreadable") for p in problems)
    assert verify_checkpoint(tmp_path / "nope") == [f"{tmp_path / 'nope'}: no such directory"]


def test_stale_tmp_dir_ignored_then_removed(tmp_path):
    good = _save(tmp_path, 10)
    root = tmp_path / "checkpoints"
    dead = root / f".tmp-step_00000020-{_dead_pid()}"  # a crashed run's half-written save
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    live = root / f".tmp-step_00000020-{os.getppid()}"  # a (pretend) concurrent saver still alive
    live.mkdir()
    assert list_checkpoints(tmp_path) == [good]
    assert resolve_resume(tmp_path, "auto", log=pytest.fail) == good
    _save(tmp_path, 30)
    assert not dead.exists() and live.exists()


def test_latest_names_missing_dir(tmp_path):
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000030\n")
    logs = []
    assert resolve_resume(tmp_path, "auto", log=logs.append) == newest
    assert "'step_00000030', which does not exist" in logs[0]


def test_checkpoint_newer_than_latest_is_ignored(tmp_path):
    _save(tmp_path, 10)
    current = _save(tmp_path, 20)
    _save(tmp_path, 30)  # an abandoned timeline: `latest` is put back on 20 below
    (tmp_path / "checkpoints" / "latest").write_text("step_00000020\n")
    assert resolve_resume(tmp_path, "auto", log=pytest.fail) == current
    ok, report = verify_report(tmp_path)
    assert ok and "newer than `latest`" in report and "--resume auto would take: step_00000020" in report


def test_all_damaged_raises(tmp_path):
    for step in (10, 20):
        _truncate(_save(tmp_path, step) / "model.safetensors")
    logs = []
    with pytest.raises(CheckpointError) as e:
        resolve_resume(tmp_path, "auto", log=logs.append)
    msg = str(e.value)
    assert "step_00000010" in msg and "step_00000020" in msg and "--resume none" in msg
    assert len(logs) == 2 and logs[-1].endswith("no older checkpoint left")


def test_resolve_resume_modes(tmp_path):
    assert resolve_resume(tmp_path, "none") is None
    assert resolve_resume(tmp_path, "auto") is None  # nothing saved yet: start fresh
    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    assert resolve_resume("/ignored", str(first)) == first
    assert resolve_resume("/ignored", str(tmp_path)) == second  # a run dir behaves like auto
    assert resolve_resume("/ignored", str(tmp_path / "checkpoints")) == second
    _truncate(first / "state.json", 3)
    with pytest.raises(CheckpointError, match="or start fresh with --resume none"):
        resolve_resume("/ignored", str(first))
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume("/ignored", str(tmp_path / "missing"))
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="run dir has no checkpoints"):
        resolve_resume("/ignored", str(tmp_path / "empty"))


def test_load_damaged_raises(tmp_path):
    path = _save(tmp_path, 1)
    _truncate(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)


def test_check_shapes_message(tmp_path):
    path = tmp_path / "checkpoints" / "step_00000100"
    check_shapes({"a": (2, 3)}, {"a": torch.zeros(2, 3)}, path)  # fits: no error
    with pytest.raises(CheckpointError) as e:
        check_shapes({"transformer.wte.weight": (256, 128), "old.bias": torch.zeros(3)},
                     {"transformer.wte.weight": torch.zeros(256, 64), "new.weight": torch.zeros(1)}, path)
    msg = str(e.value)
    assert f"checkpoint {path} was saved with transformer.wte.weight of shape (256, 128)" in msg
    assert "the model built from the config has (256, 64)" in msg
    assert "new.weight" in msg and "old.bias" in msg
    assert "state.json 'config'" in msg and "--resume none" in msg


def test_resave_same_step_replaces(tmp_path):
    _save(tmp_path, 10)
    path = _save(tmp_path, 20, seed=1)
    assert _save(tmp_path, 20, seed=2) == path
    assert torch.equal(load_checkpoint(path).tensors["wte.weight"], _tensors(2)["wte.weight"])
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000020", "step_00000010"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def _assert_unchanged(run, before, latest):
    assert _snapshot(run / "checkpoints" / latest) == before
    assert _latest(run) == latest
    assert resolve_resume(run, "auto", log=pytest.fail).name == latest


def test_crash_in_writer_keeps_previous(tmp_path, monkeypatch):
    prev = _save(tmp_path, 10)
    before = _snapshot(prev)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 20)
    _assert_unchanged(tmp_path, before, prev.name)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", prev.name]


def test_crash_at_rename_keeps_previous(tmp_path, monkeypatch):
    prev = _save(tmp_path, 10)
    before = _snapshot(prev)
    real_rename = os.rename

    def rename(src, dst):  # fail the rename that would bring the new dir in
        if Path(str(src)).name.startswith(".tmp-step_"):
            raise OSError("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="power cut"):
        _save(tmp_path, 20)
    _assert_unchanged(tmp_path, before, prev.name)
    with pytest.raises(OSError, match="power cut"):  # re-saving the same step: the old one is put back
        _save(tmp_path, 10, seed=5)
    _assert_unchanged(tmp_path, before, prev.name)


def test_invalid_inputs_write_nothing(tmp_path):
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(tmp_path, 1, _tensors(), None, None, {"bad": object()})
    with pytest.raises(CheckpointError, match="not allowed"):
        save_checkpoint(tmp_path, 1, _tensors(), None, None, {}, extra={"state.json": b"x"})
    with pytest.raises(CheckpointError, match="keep_last"):
        save_checkpoint(tmp_path, 1, _tensors(), None, None, {}, keep_last=0)
    assert not (tmp_path / "checkpoints").exists()


def test_verify_report(tmp_path):
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    ok, report = verify_report(tmp_path)
    assert ok and "step_00000010  OK" in report and "latest -> step_00000020" in report
    assert "--resume auto would take: step_00000020" in report

    ok, report = verify_report(newest)
    assert ok and "model.safetensors" in report and "bytes" in report and "verdict: OK" in report

    _truncate(newest / "model.safetensors")
    ok, report = verify_report(tmp_path)
    assert not ok and "step_00000020  DAMAGED: model.safetensors" in report
    assert "--resume auto would take: step_00000010" in report
    ok, report = verify_report(newest)
    assert not ok and "truncated?" in report and "verdict: DAMAGED" in report

    ok, report = verify_report(tmp_path / "bogus")
    assert not ok and "does not exist" in report and "run dir" in report
    (tmp_path / "plain").mkdir()
    ok, report = verify_report(tmp_path / "plain")
    assert not ok and "neither a run dir nor a checkpoint dir" in report


# A pickle payload that would create a file if torch.load ever executed it.
def _touch(path):
    Path(path).write_text("executed")


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


def test_optimizer_pickle_payload_rejected(tmp_path):
    marker = tmp_path / "pwned"
    path = save_checkpoint(tmp_path / "run", 1, _tensors(), {"state": {}, "hook": Evil(str(marker))}, None, {})
    assert verify_checkpoint(path) == []  # intact on disk; it is the content that is refused
    with pytest.raises(CheckpointError, match="weights_only allowlist"):
        load_checkpoint(path)
    assert not marker.exists()


def test_format_1_gpt_checkpoints_are_converted_to_the_head_major_qkv(tmp_path):
    # before format 2 the GPT packed attn.qkv as [q | k | v]; loading such a checkpoint must give the same model
    import json as _json

    from lockstep.config import ModelConfig, config_to_dict, Config
    from lockstep.models.gpt import build_gpt

    cfg = Config(model=ModelConfig(hidden_size=32, attention_heads=4, layers=2, max_seq_length=16))
    model = build_gpt(cfg.model)
    new = {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}
    old = {k: (v.reshape(4, 3, -1, *v.shape[1:]).transpose(0, 1).reshape(v.shape)
               if "attn.qkv" in k else v) for k, v in new.items()}
    assert not torch.equal(old["blocks.0.attn.qkv.weight"], new["blocks.0.attn.qkv.weight"])
    path = save_checkpoint(tmp_path, 1, old, None, None, {"step": 1, "config": config_to_dict(cfg)})
    manifest = _json.loads((path / "manifest.json").read_text())
    manifest["format"] = 1
    (path / "manifest.json").write_text(_json.dumps(manifest))
    loaded = load_checkpoint(path).tensors
    assert all(torch.equal(loaded[k], new[k]) for k in new)
