"""lockstep/train/old_formats.py: a run resumes from a checkpoint an older lockstep wrote. The built-in GPT's format-1
checkpoints packed attn.qkv as [q | k | v]; loaded through these loaders (plain and sharded) their rows come back
head-major, and the model computes what it computed before; other model kinds and current formats pass unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import Config, ModelConfig, config_to_dict
from lockstep.models.gpt import build_gpt
from lockstep.train.old_formats import load_checkpoint, load_sharded_checkpoint

CFG = Config(model=ModelConfig(hidden_size=32, attention_heads=2, layers=2, max_seq_length=16))
HEADS, HEAD_SIZE = 2, 16


def as_format_1(t: torch.Tensor) -> torch.Tensor:
    """Head-major rows [q0 k0 v0 | q1 k1 v1] of a qkv weight or bias, back in format 1's [q0 q1 | k0 k1 | v0 v1]."""
    per_head = [t[h * 3 * HEAD_SIZE : (h + 1) * 3 * HEAD_SIZE] for h in range(HEADS)]
    return torch.cat(
        [head[part * HEAD_SIZE : (part + 1) * HEAD_SIZE] for part in range(3) for head in per_head]
    )


def write_format_1(run: Path, tensors: dict[str, torch.Tensor], cfg: Config = CFG) -> Path:
    old = {k: as_format_1(v) if "attn.qkv" in k else v for k, v in tensors.items()}
    path = save_checkpoint(run, 1, old, None, None, {"step": 1, "config": config_to_dict(cfg)})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = 1
    del manifest["manifest_sha256"]  # format 1 had no checksum of its own
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_a_format_1_gpt_checkpoint_loads_head_major(tmp_path):
    torch.manual_seed(0)
    model = build_gpt(CFG.model)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    path = write_format_1(tmp_path, new)
    loaded = load_checkpoint(path).tensors
    # read as it is, not rewritten
    assert json.loads((path / "manifest.json").read_text())["format"] == 1
    assert loaded.keys() == new.keys() and all(torch.equal(loaded[k], v) for k, v in new.items())
    # e.g. head 1's query: rows 16..31 on disk, rows 48..63 head-major
    on_disk = as_format_1(new["blocks.1.attn.qkv.weight"])
    assert torch.equal(loaded["blocks.1.attn.qkv.weight"][48:64], on_disk[16:32])
    # the model those tensors make computes what the original computed
    into = build_gpt(CFG.model)
    into.load_state_dict(loaded)
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(into(x)[0], model(x)[0], rtol=0, atol=0)


def test_the_sharded_loader_upgrades_a_format_1_checkpoint_too(tmp_path):
    torch.manual_seed(1)
    new = {k: v.clone() for k, v in build_gpt(CFG.model).state_dict().items()}
    into = build_gpt(CFG.model)
    state = load_sharded_checkpoint(write_format_1(tmp_path, new), into)
    assert state["step"] == 1
    assert all(torch.equal(into.state_dict()[k], v) for k, v in new.items())


def test_other_model_kinds_and_current_formats_load_as_saved(tmp_path):
    torch.manual_seed(2)
    tensors = {
        "blocks.0.attn.qkv.weight": torch.randn(96, 32),
        "blocks.0.attn.qkv.bias": torch.randn(96),
    }
    custom = Config(model=ModelConfig(kind="custom", factory="mymodels:build"))
    path = write_format_1(tmp_path / "custom", {k: v.clone() for k, v in tensors.items()}, custom)
    # a custom model's qkv is its own business: what format 1 wrote is what loads
    assert all(
        torch.equal(load_checkpoint(path).tensors[k], as_format_1(v)) for k, v in tensors.items()
    )

    current = save_checkpoint(
        tmp_path / "gpt", 1, tensors, None, None, {"step": 1, "config": config_to_dict(CFG)}
    )
    assert all(torch.equal(load_checkpoint(current).tensors[k], v) for k, v in tensors.items())
