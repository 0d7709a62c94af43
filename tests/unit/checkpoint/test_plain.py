"""Plain checkpoints (lockstep/checkpoint/plain.py) on real files: rank 0's safetensors file with the optimizer
state, RNG states, state.json and extra files round-trips; tied, viewed and non-contiguous tensors; shapes
checked against a model; a crash in the writer; format-1 tensors upgraded by the model's conversion only."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import one_process

import lockstep.checkpoint.plain as ck
from lockstep.checkpoint.open import load_checkpoint
from lockstep.checkpoint.plain import (
    check_shapes,
    load_plain_checkpoint,
    save_checkpoint,
    tensor_device,
)
from lockstep.checkpoint.verify import read_tensor_shapes
from lockstep.errors import CheckpointError

from .on_disk import assert_unchanged, save, snapshot


def test_round_trip(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    rng = [
        {"torch": torch.get_rng_state(), "python": random.getstate(), "rank": r} for r in range(2)
    ]
    state = {
        "step": 7,
        "cursor": {"epoch": 1, "offset": 123},
        "config": {"model": {"hidden_size": 3}},
        "world_size": 2,
    }
    path = save_checkpoint(
        tmp_path,
        7,
        model.state_dict(),
        opt.state_dict(),
        rng,
        state,
        extra={"tokenizer.json": b'{"v": 1}'},
    )
    assert path == tmp_path / "checkpoints" / "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [
            "model.safetensors",
            "optimizer.pt",
            "rng.pt",
            "state.json",
            "manifest.json",
            "tokenizer.json",
        ]
    )

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
    assert read_tensor_shapes(path) == {
        "0.weight": (3, 4),
        "0.bias": (3,),
        "1.weight": (2, 3),
        "1.bias": (2,),
    }


def test_optional_parts_absent(tmp_path):
    ckpt = load_checkpoint(save(tmp_path, 1))
    assert ckpt.optimizer_state is None and ckpt.rng_states is None and ckpt.extra == {}


def test_tied_weights_save_and_reload(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied: one storage, two names
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    path = save_checkpoint(tmp_path, 1, model.state_dict(), None, None, {})
    ckpt = load_checkpoint(path)
    assert torch.equal(ckpt.tensors["emb.weight"], ckpt.tensors["head.weight"])
    fresh = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)}
    )
    fresh["head"].weight = fresh["emb"].weight
    fresh.load_state_dict(ckpt.tensors)
    assert fresh["head"].weight is fresh["emb"].weight and torch.equal(
        fresh["emb"].weight, emb.weight
    )


def test_check_shapes_message(tmp_path):
    path = tmp_path / "checkpoints" / "step_00000100"
    check_shapes({"a": (2, 3)}, {"a": torch.zeros(2, 3)}, path)  # fits: no error
    with pytest.raises(CheckpointError) as e:
        check_shapes(
            {"transformer.wte.weight": (256, 128), "old.bias": torch.zeros(3)},
            {"transformer.wte.weight": torch.zeros(256, 64), "new.weight": torch.zeros(1)},
            path,
        )
    msg = str(e.value)
    assert f"checkpoint {path} was saved with transformer.wte.weight of shape (256, 128)" in msg
    assert "the model built from the config has (256, 64)" in msg
    assert "new.weight" in msg and "old.bias" in msg
    assert "state.json 'config'" in msg and "--resume none" in msg


def test_crash_in_writer_keeps_previous(tmp_path, monkeypatch):
    prev = save(tmp_path, 10)
    before = snapshot(prev)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 20)
    assert_unchanged(tmp_path, before, prev.name)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", prev.name]


def test_format_1_gpt_checkpoints_are_converted_to_the_head_major_qkv(tmp_path):
    # before format 2 the GPT packed attn.qkv as [q | k | v]; loading such a checkpoint must give the same model
    import json as _json

    from lockstep.config import Config, ModelConfig, config_to_dict
    from lockstep.models.gpt import build_gpt, upgrade_format_1
    from lockstep.tools.export import load_verified_checkpoint
    from lockstep.train.old_formats import load_checkpoint as load_for_resume

    cfg = Config(model=ModelConfig(hidden_size=32, attention_heads=4, layers=2, max_seq_length=16))
    model = build_gpt(cfg.model)
    new = {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}
    old = {
        k: (
            v.reshape(4, 3, -1, *v.shape[1:]).transpose(0, 1).reshape(v.shape)
            if "attn.qkv" in k
            else v
        )
        for k, v in new.items()
    }
    assert not torch.equal(old["blocks.0.attn.qkv.weight"], new["blocks.0.attn.qkv.weight"])
    path = save_checkpoint(tmp_path, 1, old, None, None, {"step": 1, "config": config_to_dict(cfg)})
    manifest = _json.loads((path / "manifest.json").read_text())
    manifest["format"] = 1
    del manifest["manifest_sha256"]  # as lockstep wrote format 1 (and 2): no checksum of its own
    (path / "manifest.json").write_text(_json.dumps(manifest))
    loaded = load_checkpoint(path, upgrade=upgrade_format_1).tensors
    assert all(torch.equal(loaded[k], new[k]) for k in new)
    # train's resume and the tools pass the GPT's upgrade; without one, the old layout is refused, not misread
    for loaded in (load_for_resume(path).tensors, load_verified_checkpoint(path).tensors):
        assert all(torch.equal(loaded[k], new[k]) for k in new)
    with pytest.raises(CheckpointError, match=r"has format 1.*upgrade_format_1"):
        load_checkpoint(path)


def test_views_and_non_contiguous_tensors_round_trip(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    saved = {"base": base, "transposed": base.T, "row": base[1], "every_other": base[:, ::2]}
    loaded = load_plain_checkpoint(save_checkpoint(tmp_path, 1, saved, None, None, {})).tensors
    assert loaded.keys() == saved.keys() and all(
        torch.equal(loaded[k], v) for k, v in saved.items()
    )
    assert loaded["transposed"].shape == (4, 3) and loaded["every_other"].tolist() == [
        [0, 2],
        [4, 6],
        [8, 10],
    ]


def test_what_is_not_a_tensor_is_refused_before_the_disk(tmp_path):
    with pytest.raises(
        CheckpointError,
        match=r"^tensor 'w' is a list, not a torch.Tensor; pass the unwrapped "
        r"model's state_dict\(\) with full \(not sharded\) tensors",
    ):
        save_checkpoint(tmp_path, 1, {"w": [1.0, 2.0]}, None, None, {})
    assert not (tmp_path / "checkpoints").exists()


def test_the_plain_loader_refuses_a_sharded_checkpoint(tmp_path):
    from lockstep.checkpoint.sharded import save_sharded_checkpoint

    sharded = save_sharded_checkpoint(
        one_process(), tmp_path, 1, torch.nn.Linear(2, 2), None, None, {"step": 1}, {}, keep_last=1
    )
    with pytest.raises(
        CheckpointError,
        match=r"is sharded \(written by every rank\); open it with "
        r"lockstep.checkpoint.open.load_checkpoint, or load it into a model "
        r"with lockstep.checkpoint.sharded_load.load_sharded_checkpoint",
    ):
        load_plain_checkpoint(sharded)


def test_tensor_device_is_what_safetensors_takes():
    assert [tensor_device(m) for m in ("cpu", torch.device("cpu"), 0, "cuda:1")] == [
        "cpu",
        "cpu",
        0,
        "cuda:1",
    ]
