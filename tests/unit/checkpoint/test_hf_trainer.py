"""HF Trainer checkpoint directories recognized and their tensors read (lockstep/checkpoint/hf_trainer.py), from
files written here in the layouts transformers and peft write: one safetensors file, shards with an index,
pytorch_model.bin, adapters. A real Trainer's checkpoint-1 is loaded in tests/unit/train/test_hf_resume.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from lockstep.checkpoint.hf_trainer import find_hf_trainer_checkpoint, load_hf_trainer_tensors
from lockstep.errors import CheckpointError

A, B = torch.arange(6.0).reshape(2, 3), torch.ones(4)


def test_sharded_safetensors_are_joined_through_their_index(tmp_path):
    save_file({"a": A}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": B}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "a": "model-00001-of-00002.safetensors",
                    "b": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    ckpt = find_hf_trainer_checkpoint(tmp_path)
    assert ckpt.weights.name == "model.safetensors.index.json" and ckpt.global_step is None
    tensors = load_hf_trainer_tensors(ckpt)
    assert torch.equal(tensors["a"], A) and torch.equal(tensors["b"], B)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is missing"):
        load_hf_trainer_tensors(ckpt)


def test_pytorch_model_bin_is_read_weights_only(tmp_path):
    torch.save({"a": A}, tmp_path / "pytorch_model.bin")
    assert torch.equal(load_hf_trainer_tensors(find_hf_trainer_checkpoint(tmp_path))["a"], A)
    # a pickled module
    torch.save({"a": A, "code": torch.nn.Linear(1, 1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_hf_trainer_tensors(find_hf_trainer_checkpoint(tmp_path))
    torch.save({"a": A}, tmp_path / "pytorch_model.bin")
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])  # an interrupted copy
    with pytest.raises(CheckpointError) as e:
        load_hf_trainer_tensors(find_hf_trainer_checkpoint(tmp_path))
    said = str(e.value)
    assert said.startswith(
        f"{tmp_path / 'pytorch_model.bin'} cannot be read by torch.load (RuntimeError: "
    )
    assert said.endswith("it is damaged (an interrupted save or copy?); use another checkpoint")
    assert "\n" not in said


def test_a_damaged_file_is_named_with_the_checkpoint_to_take_instead(tmp_path):
    for step in (100, 200):
        (tmp_path / f"checkpoint-{step}").mkdir()
        save_file({"a": A, "b": B}, tmp_path / f"checkpoint-{step}" / "model.safetensors")
    weights = tmp_path / "checkpoint-200" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size - 5])
    with pytest.raises(CheckpointError) as e:
        load_hf_trainer_tensors(find_hf_trainer_checkpoint(tmp_path))
    assert str(e.value) == (
        f"{weights} is {size - 5} bytes, its header describes {size}: truncated (an interrupted "
        f"save or copy?); resume from an earlier checkpoint (--resume {tmp_path / 'checkpoint-100'}"
        "), or save this checkpoint again (or copy it again, if it was copied)"
    )
    weights.write_bytes(weights.read_bytes()[:30])  # inside its header
    with pytest.raises(CheckpointError, match=r"is 30 bytes, shorter than its own \d+-byte header"):
        load_hf_trainer_tensors(find_hf_trainer_checkpoint(tmp_path))
    index = tmp_path / "checkpoint-200" / "model.safetensors.index.json"
    weights.unlink()
    index.write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(
        CheckpointError,
        match=r"index.json has weight_map \['model.safetensors'\], "
        r"not a map of tensor names to files; resume from",
    ):
        load_hf_trainer_tensors(find_hf_trainer_checkpoint(tmp_path / "checkpoint-200"))
    (tmp_path / "checkpoint-100" / "trainer_state.json").write_text("[1]")
    with pytest.raises(
        CheckpointError,
        match=r"trainer_state.json holds a JSON list, not an "
        r"object; resume from an earlier checkpoint-N",
    ):
        find_hf_trainer_checkpoint(tmp_path / "checkpoint-100")


def test_adapters_need_their_config_and_the_newest_checkpoint_of_an_output_dir_is_taken(tmp_path):
    for step in (50, 500, 100):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        save_file({"x.lora_A.weight": A * step}, d / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    ckpt = find_hf_trainer_checkpoint(tmp_path)
    assert (ckpt.path.name, ckpt.global_step, ckpt.is_adapter, ckpt.adapter_config["r"]) == (
        "checkpoint-500",
        500,
        True,
        2,
    )
    assert torch.equal(load_hf_trainer_tensors(ckpt)["x.lora_A.weight"], A * 500)
    (ckpt.path / "adapter_config.json").unlink()
    with pytest.raises(CheckpointError, match="has no adapter_config.json"):
        find_hf_trainer_checkpoint(ckpt.path)


def test_lockstep_checkpoints_and_other_dirs_are_not_taken_for_one(tmp_path):
    save_file({"a": A}, tmp_path / "model.safetensors")
    (tmp_path / "manifest.json").write_text("{}")  # lockstep's own checkpoint
    assert find_hf_trainer_checkpoint(tmp_path) is None
    assert find_hf_trainer_checkpoint(tmp_path / "nowhere") is None
    (tmp_path / "empty").mkdir()
    assert find_hf_trainer_checkpoint(tmp_path / "empty") is None
