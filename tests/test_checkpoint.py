"""Checkpoint commit protocol on real files: round trip, manifest, `latest`, pruning, damage, crashes."""

import hashlib
import json
import os
import pickle
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lockstep.checkpoint.plain as ck
from lockstep.errors import CheckpointError
from lockstep.checkpoint.plain import (
    check_shapes, list_checkpoints, load_checkpoint, load_pickled_weights_only, resolve_resume, save_checkpoint,
    verify_checkpoint,
)
from lockstep.checkpoint.report import verify_report
from lockstep.checkpoint.verify import manifest_digest, quick_check, read_tensor_shapes


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
    state = {"step": 7, "cursor": {"epoch": 1, "offset": 123}, "config": {"model": {"hidden_size": 3}}, "world_size": 2}
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
    problems = verify_checkpoint(path)  # intact on disk: the content is what is refused, and verify says so
    assert len(problems) == 1 and problems[0].startswith("optimizer.pt: torch.load(weights_only=True) refuses it")
    assert "test_checkpoint._touch" in problems[0], problems
    with pytest.raises(CheckpointError, match="optimizer.pt: torch.load.weights_only=True. refuses it"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"weights_only allowlist \(UnpicklingError: global test_checkpoint._touch"):
        load_pickled_weights_only(path / "optimizer.pt", "cpu")
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
    del manifest["manifest_sha256"]  # as lockstep wrote format 1 (and 2): no checksum of its own
    (path / "manifest.json").write_text(_json.dumps(manifest))
    loaded = load_checkpoint(path).tensors
    assert all(torch.equal(loaded[k], new[k]) for k in new)


# ---- damage that only content checks see: the manifest re-sealed over the edited files -----------------------

def _reseal(path: Path) -> None:
    """Re-write the manifest for the files as they are now, as a tool (or a bug) that rewrote one would."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {name: ck.file_entry(path / name) for name in manifest["files"]}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _save_run_state(run, step):
    """A checkpoint as the trainer writes it: optimizer state, one RNG state per rank, the resume fields."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"step": step, "cursor": {"epoch": 0, "offset": 8 * step}, "scheduler": {"last_epoch": step},
             "world_size": 2, "grad_scaler": None, "config": {"model": {"kind": "custom"}}}
    rng = [{"torch": torch.get_rng_state(), "python": random.getstate()} for _ in range(2)]
    return save_checkpoint(run, step, model.state_dict(), opt.state_dict(), rng, state)


@pytest.mark.parametrize("field, value, reason", [
    ("cursor", 80, "cursor is 80 (int); it must be an object with int epoch and offset >= 0"),
    ("cursor", {"epoch": "0", "offset": 80}, "cursor.epoch is '0' (str); it must be an int >= 0"),
    ("cursor", {"epoch": 0, "offset": -8}, "cursor.offset is -8 (int); it must be an int >= 0"),
    ("cursor", {"epoch": 0}, "cursor.offset is None (NoneType); it must be an int >= 0"),
    ("step", "20", "step is '20' (str); it must be an int >= 0"),
    ("step", True, "step is True (bool); it must be an int >= 0"),
    ("step", 19, "step 19, manifest.json says 20"),
    ("scheduler", [20], "scheduler is [20] (list); it must be an object (its state_dict)"),
    ("grad_scaler", 1.0, "grad_scaler is 1.0 (float); it must be an object or null"),
    ("world_size", "2", "world_size is '2' (str); it must be an int >= 1 or null"),
    ("config", {"model": "gpt"}, "config.model is 'gpt' (str); it must be an object (the model's settings)"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_state_that_does_not_validate_is_damage_and_resume_falls_back(tmp_path, field, value, reason):
    good, bad = _save_run_state(tmp_path, 10), _save_run_state(tmp_path, 20)
    state = json.loads((bad / "state.json").read_text())
    state[field] = value
    (bad / "state.json").write_text(json.dumps(state))
    _reseal(bad)
    assert verify_checkpoint(bad) == [f"state.json: {reason}"]
    logs = []
    assert resolve_resume(tmp_path, "auto", log=logs.append) == good
    assert logs == [f"checkpoint step_00000020 is damaged (state.json: {reason}); falling back to step_00000010"]
    ok, report = verify_report(bad)
    assert not ok and f"problem: state.json: {reason}" in report and "verdict: DAMAGED" in report


def test_state_of_a_run_to_continue_needs_step_and_cursor(tmp_path):
    bad = _save_run_state(tmp_path, 20)
    state = json.loads((bad / "state.json").read_text())
    del state["cursor"]
    (bad / "state.json").write_text(json.dumps([state]))  # not even an object
    _reseal(bad)
    [problem] = verify_checkpoint(bad)
    assert problem.startswith("state.json: holds [{'config'") and problem.endswith("... (list), not a JSON object")
    (bad / "state.json").write_text(json.dumps(state))
    _reseal(bad)
    assert verify_checkpoint(bad) == ["state.json: has a scheduler but no 'cursor', which a resume continues from"]
    # a merged (weights-only) checkpoint has no scheduler and no cursor: nothing to continue, nothing missing
    merged = save_checkpoint(tmp_path / "merged", 3, _tensors(), None, None, {"step": 3, "merged_from": ["a", "b"]})
    assert verify_checkpoint(merged) == []


# A pickle the weights-only loader refuses: a global outside its allowlist.
@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt"])
def test_pickle_refused_by_the_weights_only_loader_is_damage(tmp_path, name):
    marker = tmp_path / "pwned"
    good, bad = _save_run_state(tmp_path / "run", 10), _save_run_state(tmp_path / "run", 20)
    payload = {"state": {}, "param_groups": [], "hook": Evil(str(marker))} if name == "optimizer.pt" else [Evil(str(marker))]
    torch.save(payload, bad / name)
    _reseal(bad)
    problems = verify_checkpoint(bad)
    assert problems == [f"{name}: torch.load(weights_only=True) refuses it (UnpicklingError: global "
                        "test_checkpoint._touch is outside its allowlist)"], problems
    logs = []
    assert resolve_resume(tmp_path / "run", "auto", log=logs.append) == good
    assert f"step_00000020 is damaged ({name}: torch.load(weights_only=True) refuses it" in logs[0]
    ok, report = verify_report(tmp_path / "run")
    assert not ok and "step_00000020  DAMAGED: " + name in report and "--resume auto would take: step_00000010" in report
    assert not marker.exists()


def test_pickles_of_the_wrong_shape_are_damage(tmp_path):
    path = _save_run_state(tmp_path, 20)
    torch.save([1, 2], path / "optimizer.pt")  # loads, but optimizer.load_state_dict needs state + param_groups
    torch.save([{"torch": torch.get_rng_state()}], path / "rng.pt")  # 1 rank's state, state.json says 2 ranks
    _reseal(path)
    assert verify_checkpoint(path) == [
        "optimizer.pt: holds [1, 2] (list), not an optimizer state_dict (state, param_groups)",
        "rng.pt: holds 1 ranks' RNG states, state.json says world_size 2"]
    (path / "optimizer.pt").write_bytes(pickle.dumps({"state": {}, "param_groups": []}))  # not torch.save's zip
    _reseal(path)
    assert verify_checkpoint(path)[0].startswith("optimizer.pt: torch.load(weights_only=True) refuses it (RuntimeError")


def _flip_bit(file: Path, inside: str, bit: int = 0x01) -> None:
    """Flip one bit of the first character of `inside` (a value the manifest records) in file."""
    raw = bytearray(file.read_bytes())
    i = raw.index(inside.encode())
    raw[i] ^= bit
    file.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["sha256", "bytes", "own checksum"])
def test_flipped_bit_in_the_manifest_blames_the_manifest(tmp_path, where):
    good, bad = _save_run_state(tmp_path, 10), _save_run_state(tmp_path, 20)
    manifest = json.loads((bad / "manifest.json").read_text())
    entry = manifest["files"]["optimizer.pt"]
    target = {"sha256": entry["sha256"], "bytes": str(entry["bytes"])[1:],  # not the leading digit: still JSON
              "own checksum": manifest["manifest_sha256"]}[where]
    _flip_bit(bad / "manifest.json", target)
    assert json.loads((bad / "manifest.json").read_text()) != manifest  # valid JSON, one value changed
    problems = verify_checkpoint(bad)
    assert problems == ["manifest.json damaged: its contents no longer match its own checksum (manifest_sha256), "
                        "so the files it lists cannot be checked against it"], problems
    assert quick_check(bad) == problems
    logs = []
    assert resolve_resume(tmp_path, "auto", log=logs.append) == good
    assert "step_00000020 is damaged (manifest.json damaged" in logs[0]


def test_manifests_without_their_own_checksum(tmp_path):
    path = _save_run_state(tmp_path, 20)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["manifest_sha256"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == ["manifest.json damaged: a format-3 manifest without its manifest_sha256"]
    manifest["format"] = 2  # written by lockstep before the manifest had a checksum of its own: still loads
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == [] and load_checkpoint(path).state["step"] == 20
    manifest["format"] = 7
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert verify_checkpoint(path) == ["manifest.json: not a format-1/2/3 manifest"]


def test_quick_check_reads_sizes_not_contents(tmp_path):
    path = _save_run_state(tmp_path, 20)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size: only a checksum sees it
    (path / "model.safetensors").write_bytes(bytes(data))
    assert quick_check(path) == [] and verify_checkpoint(path) == ["model.safetensors: checksum mismatch"]
    _truncate(path / "optimizer.pt", 10)
    assert quick_check(path) == [f"optimizer.pt: 10 bytes, manifest says "
                                 f"{json.loads((path / 'manifest.json').read_text())['files']['optimizer.pt']['bytes']}"
                                 " (truncated?)"]
    assert quick_check(tmp_path / "nope") == [f"{tmp_path / 'nope'}: no such directory"]


# ---- what a stopped run says it left (lockstep.checkpoint.report.stop_note) -----------------------------------

def _note(run, before, resume="auto") -> str:
    from lockstep.checkpoint.report import stop_note

    return re.sub(r", \d+ s ago\)", ", N s ago)", stop_note(run, before, resume))


def test_stop_note_reads_what_is_on_disk(tmp_path):
    from lockstep.checkpoint.report import mark_latest

    run = tmp_path / "run"
    nothing = mark_latest(run)
    assert _note(run, nothing) == ("this run committed no checkpoint; running the same command again starts over at "
                                   f"step 0 ({run / 'checkpoints'} holds no checkpoint)")
    _save(run, 10)
    takes_10 = ("to resume, run the same command again: --resume auto takes step_00000010 (step 10) and verifies its "
                "checksums before loading it")
    assert _note(run, nothing) == f"this run committed checkpoint step_00000010 (step 10, N s ago); {takes_10}"
    at_10 = mark_latest(run)
    assert _note(run, at_10) == ("this run committed no checkpoint (`latest` still names step_00000010, as when it "
                                 f"started); {takes_10}")
    _save(run, 10, seed=7)  # the same step saved again (a run resumed at 10 with --resume none): a new commit
    assert _note(run, at_10).startswith("this run committed checkpoint step_00000010 (step 10, N s ago); ")

    assert _note(run, at_10, "none").endswith("; checkpoint.resume is 'none', so the same command starts over at "
                                              "step 0; to continue from step_00000010 (step 10) run it with --resume "
                                              "auto instead")
    other = _save(tmp_path / "other", 5)
    assert _note(run, at_10, str(other)).endswith(f"; checkpoint.resume is {other}, so the same command starts from "
                                                  "there again; to continue from step_00000010 (step 10) run it with "
                                                  "--resume auto instead")
    assert _note(run, at_10, str(run)).endswith(f"; {takes_10}")  # --resume RUN_DIR of this run is auto

    newest = _save(run, 20)
    _truncate(newest / "model.safetensors")
    size = json.loads((newest / "manifest.json").read_text())["files"]["model.safetensors"]["bytes"]
    assert _note(run, at_10).endswith(f"; {takes_10} (it skips step_00000020: model.safetensors: 40 bytes, manifest "
                                      f"says {size} (truncated?))")
    _truncate(run / "checkpoints" / "step_00000010" / "model.safetensors")
    assert f"; no checkpoint in {run / 'checkpoints'} passes a quick check (step_00000020: " in _note(run, at_10)
