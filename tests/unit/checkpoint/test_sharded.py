"""Sharded checkpoints on real gloo groups: saved by 2 FSDP ranks, loaded on 1 plain process and on 4 FSDP
ranks; a plain checkpoint loaded into FSDP (ddp -> fsdp); damage and crashes under the commit protocol."""

from __future__ import annotations

import copy
import gc
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import start_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

import lockstep.checkpoint.sharded as cs
from lockstep.checkpoint.commit import list_checkpoints
from lockstep.checkpoint.dcp_files import read_dcp_metadata
from lockstep.checkpoint.manifest import file_entry, is_sharded, manifest_digest
from lockstep.checkpoint.open import load_checkpoint, verify_checkpoint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.report import verify_report
from lockstep.checkpoint.resume import resolve_resume
from lockstep.checkpoint.sharded import save_sharded_checkpoint
from lockstep.checkpoint.sharded_load import (
    load_full_model_tensors,
    load_rng_states,
    load_sharded_checkpoint,
)
from lockstep.config import ModelConfig, OptimConfig
from lockstep.errors import CheckpointError
from lockstep.models.gpt import build_gpt
from lockstep.optim import build_optimizer
from lockstep.parallel.fsdp import apply_fsdp
from lockstep.runtime import Runtime, free_port, shutdown_runtime

CFG = ModelConfig(vocab_size=64, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16)
CRASH = 17  # exit code of the simulated power cut


def _state(step: int) -> dict:
    return {
        "step": step,
        "cursor": {"epoch": 0, "offset": 8 * step},
        "scheduler": {"last_epoch": step},
    }


def _train(model, optimizer, rank: int, world: int, seed: int) -> None:
    """One AdamW step on this rank's share of 8 random sequences."""
    data = torch.randint(
        0,
        CFG.vocab_size,
        (8, CFG.max_seq_length + 1),
        generator=torch.Generator().manual_seed(seed),
    )
    mine = data[rank * 8 // world : (rank + 1) * 8 // world]
    model(mine[:, :-1], mine[:, 1:])[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _fsdp_gpt(world: int, rank: int):
    rt = Runtime(rank, rank, world, world, 0, torch.device("cpu"), "gloo", "test", "localhost")
    torch.manual_seed(0)
    model = build_gpt(CFG)
    apply_fsdp(model, init_device_mesh("cpu", (world,)))
    return rt, model, build_optimizer(model, OptimConfig(), 1e-2, "cpu")


def _full(model, optimizer) -> dict:
    """Full weights and FQN-keyed optimizer state (collectives: every rank calls it)."""
    weights = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    optim = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True)
    )
    # copies: some entries (the scalar `step`) are the live optimizer's tensors, which later steps change
    return {"weights": weights, "optim": copy.deepcopy(optim)}


def _expect_error(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "no CheckpointError"


# ---- 2 ranks: save, fail, crash --------------------------------------------------------------------------


def _save_worker(rank: int, port: int, run: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rt, model, optimizer = _fsdp_gpt(2, rank)
    result = {}
    _train(model, optimizer, rank, 2, seed=1)
    save_sharded_checkpoint(
        rt, run, 1, model, optimizer, [f"rng{r}" for r in range(2)], _state(1), {}, keep_last=3
    )
    _train(model, optimizer, rank, 2, seed=2)
    path = save_sharded_checkpoint(
        rt,
        run,
        2,
        model,
        optimizer,
        [f"rng{r}" for r in range(2)],
        _state(2),
        {"tokenizer.json": b'{"v": 2}'},
        keep_last=3,
    )
    result["path"] = str(path)
    result["step2"] = _full(model, optimizer)
    _train(model, optimizer, rank, 2, seed=3)

    # rank 1 cannot write its shards: every rank raises, nothing is committed
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    real_write = FileSystemWriter.write_data
    if rank == 1:

        def disk_full(self, plan, planner):
            raise OSError("disk full")

        FileSystemWriter.write_data = disk_full
    result["shard_error"] = _expect_error(
        lambda: save_sharded_checkpoint(
            rt, run, 3, model, optimizer, None, _state(3), {}, keep_last=3
        )
    )
    FileSystemWriter.write_data = real_write

    # rank 0 fails between the shard writes and the commit
    real_seal = cs.seal
    if rank == 0:

        def power_cut(*args, **kwargs):
            raise OSError("power cut")

        cs.seal = power_cut
    result["commit_error"] = _expect_error(
        lambda: save_sharded_checkpoint(
            rt, run, 3, model, optimizer, None, _state(3), {}, keep_last=3
        )
    )
    cs.seal = real_seal
    result["tmp_left"] = sorted(
        p.name for p in (Path(run) / "checkpoints").iterdir() if p.name.startswith(".tmp")
    )
    if rank == 0:
        torch.save(result, out)

    # a real crash at the same point: rank 0 dies after all shards are on disk (rank 1 is then killed)
    if rank == 0:
        cs.seal = lambda *args, **kwargs: os._exit(CRASH)
    save_sharded_checkpoint(rt, run, 3, model, optimizer, None, _state(3), {}, keep_last=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(run dir with sharded checkpoints of steps 1 and 2 and a crashed save of step 3, the workers' results)."""
    base = tmp_path_factory.mktemp("sharded")
    run, out = base / "run", base / "result.pt"
    with pytest.raises(mp.ProcessExitedException) as crash:
        start_ranks(_save_worker, free_port(), str(run), str(out), nprocs=2)
    assert crash.value.exit_code == CRASH, crash.value  # not some earlier failure
    return run, torch.load(out, weights_only=True)


def test_saved_layout_and_manifest(saved):
    run, result = saved
    path = Path(result["path"])
    assert path == run / "checkpoints" / "step_00000002" and is_sharded(path)
    assert not is_sharded(
        save_checkpoint(run.parent / "plain", 1, {"w": torch.ones(2)}, None, None, {})
    )
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted(
        [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "manifest.json",
            "rng.pt",
            "state.json",
            "tokenizer.json",
        ]
    )
    assert verify_checkpoint(path) == []
    assert load_rng_states(path) == ["rng0", "rng1"]


def test_loads_on_one_process_without_fsdp(saved):
    run, result = saved
    torch.manual_seed(1)  # other weights than the saved ones
    model = build_gpt(CFG)
    optimizer = build_optimizer(model, OptimConfig(), 1e-3, "cpu")
    state = load_sharded_checkpoint(result["path"], model, optimizer)
    assert state == _state(2)  # state.json, cursor dict included, round-trips
    assert model.head.weight is model.tok_emb.weight  # still tied after the load
    _assert_equal(_full(model, optimizer), result["step2"])
    # the saved hyperparameters, not the fresh optimizer's
    assert optimizer.param_groups[0]["lr"] == 1e-2
    wider = build_gpt(
        ModelConfig(vocab_size=64, hidden_size=48, attention_heads=2, layers=2, max_seq_length=16)
    )
    with pytest.raises(CheckpointError, match=r"saved with tok_emb.weight of shape \(64, 32\)"):
        load_sharded_checkpoint(result["path"], wider)


def test_load_full_model_tensors(saved):
    run, result = saved
    tensors = load_full_model_tensors(result["path"])
    # FQNs, as a plain checkpoint has them
    assert sorted(tensors) == sorted(result["step2"]["weights"])
    for name, t in result["step2"]["weights"].items():
        assert torch.equal(tensors[name], t), name
    # the plain loader gives the full weights of a sharded checkpoint too
    ckpt = load_checkpoint(result["path"])
    assert (
        ckpt.optimizer_state is None
        and ckpt.state == _state(2)
        and ckpt.extra == {"tokenizer.json": b'{"v": 2}'}
    )
    assert all(torch.equal(ckpt.tensors[k], t) for k, t in tensors.items())
    plain = save_checkpoint(run.parent / "plain2", 5, tensors, None, None, {})
    assert all(torch.equal(load_full_model_tensors(plain)[k], t) for k, t in tensors.items())


def test_failed_shard_write_raises_on_every_rank(saved):
    _, result = saved
    assert "rank 1: " in result["shard_error"] and "disk full" in result["shard_error"], result[
        "shard_error"
    ]
    assert "previous checkpoint is untouched" in result["shard_error"]
    assert "power cut" in result["commit_error"], result["commit_error"]
    assert result["tmp_left"] == []


def test_crash_before_commit_keeps_latest(saved):
    run, _ = saved
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert [p.name for p in list_checkpoints(run)] == ["step_00000002", "step_00000001"]
    stale = [p for p in root.iterdir() if p.name.startswith(".tmp-step_00000003")]
    # the shards were written, never committed
    assert len(stale) == 1 and (stale[0] / "__1_0.distcp").is_file()
    assert resolve_resume(run, "auto", log=pytest.fail) == root / "step_00000002"
    ok, report = verify_report(run)
    assert ok and "unfinished: .tmp-step_00000003" in report, report


def test_missing_shard_named_and_resume_falls_back(saved, tmp_path):
    run, result = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    step2 = copy / "checkpoints" / "step_00000002"
    (step2 / "__1_0.distcp").unlink()
    ok, report = verify_report(step2)
    assert not ok and "problem: __1_0.distcp: missing" in report, report
    ok, report = verify_report(copy)
    assert not ok and "step_00000002  DAMAGED: __1_0.distcp: missing" in report, report
    logged = []
    assert resolve_resume(copy, "auto", log=logged.append) == copy / "checkpoints" / "step_00000001"
    assert "__1_0.distcp: missing" in logged[0] and "falling back to step_00000001" in logged[0]
    model = build_gpt(CFG)
    with pytest.raises(CheckpointError, match="__1_0.distcp: missing"):
        load_sharded_checkpoint(step2, model)
    with pytest.raises(CheckpointError, match="__1_0.distcp: missing"):
        load_full_model_tensors(step2)
    # a shard replaced with garbage of the same size: the checksum names it
    step1 = copy / "checkpoints" / "step_00000001"
    shard = step1 / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    assert "__0_0.distcp: checksum mismatch" in verify_checkpoint(step1)


def test_metadata_pickle_payload_rejected(saved, tmp_path):
    run, result = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(result["path"], ckpt)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    _reseal(ckpt)  # a consistent manifest: only content checks see it
    assert any("posix.system is not allowed" in p for p in verify_checkpoint(ckpt)), (
        verify_checkpoint(ckpt)
    )
    with pytest.raises(CheckpointError, match="not allowed"):
        load_sharded_checkpoint(ckpt, build_gpt(CFG))
    with pytest.raises(CheckpointError, match="not allowed"):
        load_full_model_tensors(ckpt)
    assert not (tmp_path / "owned").exists()


def test_next_save_removes_the_crashed_tmp_dir(saved, tmp_path):
    run, result = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    model = build_gpt(CFG)
    load_sharded_checkpoint(result["path"], model)
    rt = Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "localhost")
    # one process
    path = save_sharded_checkpoint(rt, copy, 3, model, None, None, _state(3), {}, keep_last=2)
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == [
        "latest",
        "step_00000002",
        "step_00000003",
    ]
    assert (
        verify_checkpoint(path) == []
        and load_full_model_tensors(path).keys() == result["step2"]["weights"].keys()
    )
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_sharded_checkpoint(path, model, build_optimizer(model, OptimConfig(), 1e-3, "cpu"))


# ---- 4 ranks: reshard 2 -> 4, and a plain (ddp) checkpoint into FSDP --------------------------------------


def _load_worker(rank: int, port: int, sharded: str, plain: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    result = {}
    _, model, optimizer = _fsdp_gpt(4, rank)
    result["state"] = load_sharded_checkpoint(sharded, model, optimizer)
    result["sharded"] = _full(model, optimizer)
    _, model, optimizer = _fsdp_gpt(4, rank)
    result["plain_state"] = load_sharded_checkpoint(plain, model, optimizer)
    result["plain"] = _full(model, optimizer)
    result["tied"] = model.head.weight is model.tok_emb.weight
    if rank == 0:
        torch.save(result, out)
    # drop everything that holds the group's tensors first: a gloo thread left at exit can abort the process
    del model, optimizer, result
    gc.collect()
    shutdown_runtime()  # collects the DDP/FSDP garbage first: see its docstring


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory):
    """A plain checkpoint as the DDP trainer writes it (rank 0, safetensors + optimizer.state_dict())."""
    torch.manual_seed(2)
    model = build_gpt(CFG)
    optimizer = build_optimizer(model, OptimConfig(), 3e-3, "cpu")
    _train(model, optimizer, 0, 1, seed=5)
    run = tmp_path_factory.mktemp("plain")
    path = save_checkpoint(run, 1, model.state_dict(), optimizer.state_dict(), None, _state(1))
    return path, _full(model, optimizer)


@pytest.fixture(scope="module")
def four_ranks(saved, plain_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("four") / "result.pt"
    start_ranks(_load_worker, free_port(), saved[1]["path"], str(plain_ckpt[0]), str(out), nprocs=4)
    return torch.load(out, weights_only=True)


def test_two_rank_checkpoint_loads_on_four_ranks(saved, four_ranks):
    assert four_ranks["state"] == _state(2)
    _assert_equal(four_ranks["sharded"], saved[1]["step2"])


def test_plain_checkpoint_loads_into_fsdp(plain_ckpt, four_ranks):
    assert four_ranks["plain_state"] == _state(1)
    assert four_ranks["tied"]
    _assert_equal(four_ranks["plain"], plain_ckpt[1])


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, t in want["weights"].items():
        assert torch.equal(got["weights"][name], t), name
    assert (
        sorted(got["optim"]["state"]) == sorted(want["optim"]["state"]) and want["optim"]["state"]
    )
    for fqn, entry in want["optim"]["state"].items():
        assert (
            sorted(got["optim"]["state"][fqn]) == sorted(entry) == ["exp_avg", "exp_avg_sq", "step"]
        )
        for key, value in entry.items():
            assert torch.equal(got["optim"]["state"][fqn][key], value), (fqn, key)

    def hyper(
        group: dict,
    ) -> dict:  # gathering a full state dict across ranks turns tuples (betas) into lists
        return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}

    for g_got, g_want in zip(
        got["optim"]["param_groups"], want["optim"]["param_groups"], strict=True
    ):
        assert hyper(g_got) == hyper(g_want)


def test_plain_checkpoint_with_trainable_tensors_only(tmp_path):
    """A LoRA-style plain checkpoint (frozen tensors left out) loads through the same call; names are checked."""
    torch.manual_seed(3)
    model = build_gpt(CFG)
    model.pos_emb.weight.requires_grad_(False)  # "frozen base", not in the checkpoint
    optimizer = build_optimizer(model, OptimConfig(), 1e-3, "cpu")
    _train(model, optimizer, 0, 1, seed=6)
    trainable = {k: v for k, v in model.state_dict().items() if k != "pos_emb.weight"}
    path = save_checkpoint(tmp_path, 4, trainable, optimizer.state_dict(), None, _state(4))

    torch.manual_seed(4)
    fresh = build_gpt(CFG)
    fresh.pos_emb.weight.requires_grad_(False)
    pos = fresh.pos_emb.weight.detach().clone()
    fresh_opt = build_optimizer(fresh, OptimConfig(), 1e-3, "cpu")
    assert load_sharded_checkpoint(path, fresh, fresh_opt) == _state(4)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in trainable.items())
    # the frozen tensor kept what the model was built with
    assert torch.equal(fresh.pos_emb.weight, pos)
    assert torch.equal(
        fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )

    other = build_gpt(
        ModelConfig(vocab_size=64, hidden_size=32, attention_heads=2, layers=1, max_seq_length=16)
    )
    with pytest.raises(CheckpointError, match="has tensors the model lacks: blocks.1"):
        load_sharded_checkpoint(path, other)


def test_format_1_gpt_checkpoints_resume_into_a_sharded_layout_converted(tmp_path):
    # a sharded layout (FSDP / TP / PP) resumes a plain checkpoint through load_sharded_checkpoint
    from lockstep.config import Config, ModelConfig, config_to_dict
    from lockstep.models.gpt import build_gpt
    from lockstep.train.old_formats import load_sharded_checkpoint

    cfg = Config(model=ModelConfig(hidden_size=32, attention_heads=4, layers=1, max_seq_length=16))
    new = {k: v.clone() for k, v in build_gpt(cfg.model).state_dict().items()}
    old = {
        k: (
            v.reshape(4, 3, -1, *v.shape[1:]).transpose(0, 1).reshape(v.shape)
            if "attn.qkv" in k
            else v
        )
        for k, v in new.items()
    }
    path = save_checkpoint(tmp_path, 1, old, None, None, {"step": 1, "config": config_to_dict(cfg)})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = 1
    del manifest["manifest_sha256"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    into = build_gpt(cfg.model)
    load_sharded_checkpoint(path, into)
    assert all(torch.equal(into.state_dict()[k], new[k]) for k in new)


# ---- content checks of a sharded checkpoint: what the resume loads, as it loads it ----------------------------


def _reseal(ckpt: Path) -> None:
    """Re-write the manifest for the files as they are now (its own checksum too)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {name: file_entry(ckpt / name) for name in manifest["files"]}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _touch(path):
    Path(path).write_text("executed")


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


TOUCH = f"{_touch.__module__}._touch"  # the global the payload names, as the refusals quote it


def test_sharded_manifest_has_its_own_checksum(saved, tmp_path):
    run, result = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    step2 = copy / "checkpoints" / "step_00000002"
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert manifest["layout"] == "sharded" and manifest["manifest_sha256"] == manifest_digest(
        manifest
    )
    raw = (step2 / "manifest.json").read_bytes()
    i = raw.index(manifest["files"]["__1_0.distcp"]["sha256"].encode())
    # one bit, in a shard's sha256
    (step2 / "manifest.json").write_bytes(raw[:i] + bytes([raw[i] ^ 1]) + raw[i + 1 :])
    problems = verify_checkpoint(step2)
    assert len(problems) == 1 and problems[0].startswith("manifest.json damaged:"), problems
    assert (
        resolve_resume(copy, "auto", log=lambda _: None) == copy / "checkpoints" / "step_00000001"
    )
    with pytest.raises(CheckpointError, match="manifest.json damaged"):
        load_sharded_checkpoint(step2, build_gpt(CFG))


def test_sharded_rng_refused_by_the_weights_only_loader_is_damage(saved, tmp_path):
    run, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    step2 = copy / "checkpoints" / "step_00000002"
    torch.save([_Evil(str(tmp_path / "pwned"))] * 2, step2 / "rng.pt")
    _reseal(step2)
    assert verify_checkpoint(step2) == [
        "rng.pt: torch.load(weights_only=True) refuses it (UnpicklingError: global "
        f"{TOUCH} is outside its allowlist)"
    ]
    assert (
        resolve_resume(copy, "auto", log=lambda _: None) == copy / "checkpoints" / "step_00000001"
    )
    assert not (tmp_path / "pwned").exists()


def test_sharded_value_refused_by_the_weights_only_loader_is_damage(saved, tmp_path):
    """A non-tensor value inside a shard (an optimizer hyperparameter) that the resume's weights-only load refuses."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    run, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    step2 = copy / "checkpoints" / "step_00000002"
    meta = read_dcp_metadata(step2)
    index = next(i for i in meta.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    shard = step2 / meta.storage_data[index].relative_path
    payload = io.BytesIO()
    torch.save(_Evil(str(tmp_path / "pwned")), payload)
    offset = shard.stat().st_size
    # the value now lives at the end of the shard file, and the index says so
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    meta.storage_data[index] = _StorageInfo(shard.name, offset, len(payload.getvalue()))
    (step2 / ".metadata").write_bytes(pickle.dumps(meta))
    _reseal(step2)
    assert verify_checkpoint(step2) == [
        f"{shard.name}: value optimizer.param_groups.0.lr is refused by torch.load(weights_only=True) "
        f"(UnpicklingError: global {TOUCH} is outside its allowlist)"
    ]
    assert (
        resolve_resume(copy, "auto", log=lambda _: None) == copy / "checkpoints" / "step_00000001"
    )
    assert not (tmp_path / "pwned").exists()
