"""lockstep.tools.merge on real checkpoints: tiny GPTs and a tiny Llama with LoRA, the refusals, the CLI.

Tolerance: inputs are fp32 and the merge averages in float64, so every merged tensor is the fp32 mean
rounded once; it must be within 1 ulp (of the fp32 result) of the mean computed directly in fp32.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import run_main

from lockstep.checkpoint.commit import list_checkpoints
from lockstep.checkpoint.open import load_checkpoint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.cli.merge import parse_weights
from lockstep.config import Config, ModelConfig, config_to_dict
from lockstep.errors import CheckpointError, ConfigError
from lockstep.models.gpt import build_gpt
from lockstep.tools.merge import load_model_tensors, merge_checkpoints
from lockstep.tools.sample import load_model_from_checkpoint

TOKENIZER = b'{"fake": "bpe"}'


def gpt_cfg(**model) -> Config:
    fields = {"hidden_size": 32, "attention_heads": 2, "layers": 2, "max_seq_length": 16, **model}
    return Config(model=ModelConfig(**fields))


def save_gpt(run, seed: int, step: int = 10, extra: dict | None = None, **model):
    cfg = gpt_cfg(**model)
    torch.manual_seed(seed)
    net = build_gpt(cfg.model)
    return save_checkpoint(
        run,
        step,
        net.state_dict(),
        None,
        None,
        {"config": config_to_dict(cfg), "step": step},
        extra=extra,
    )


def within_ulp(merged: torch.Tensor, want: torch.Tensor) -> bool:
    ulp = (torch.nextafter(want, torch.full_like(want, math.inf)) - want).abs()
    return merged.dtype == want.dtype and bool(((merged - want).abs() <= ulp).all())


def test_two_gpts_average_to_their_mean(tmp_path):
    a = save_gpt(tmp_path / "a", seed=1, step=10, extra={"tokenizer.json": TOKENIZER})
    b = save_gpt(tmp_path / "b", seed=2, step=12, extra={"tokenizer.json": TOKENIZER})
    lines = []
    # a run dir and a checkpoint
    out = merge_checkpoints([tmp_path / "a", b], tmp_path / "out", log=lines.append)
    ta, tb = load_model_tensors(a), load_model_tensors(b)
    (ckpt_dir,) = list_checkpoints(out)
    ckpt = load_checkpoint(ckpt_dir)
    assert ckpt_dir.name == "step_00000012" and ckpt.state["step"] == 12
    assert set(ckpt.tensors) == set(ta)
    for key, t in ckpt.tensors.items():
        assert within_ulp(t, (ta[key] + tb[key]) / 2), key
    # a starting point, not a resumable run
    assert ckpt.optimizer_state is None and ckpt.rng_states is None
    assert ckpt.extra == {"tokenizer.json": TOKENIZER}
    assert ckpt.state["merged_from"] == [str(a), str(b)] and ckpt.state["merge_weights"] == [
        0.5,
        0.5,
    ]
    assert ckpt.state["config"]["model"]["layers"] == 2
    assert any("averaging 2 checkpoints" in line for line in lines)


def test_weighted_merge_normalizes_and_says_so(tmp_path):
    a, b = save_gpt(tmp_path / "a", seed=1), save_gpt(tmp_path / "b", seed=2)
    lines = []
    out = merge_checkpoints([a, b], tmp_path / "out", weights=[7, 3], log=lines.append)
    merged = load_checkpoint(list_checkpoints(out)[0])
    assert merged.state["merge_weights"] == pytest.approx([0.7, 0.3], abs=1e-15)
    assert any("sum to 10; normalized to sum 1: 0.7,0.3" in line for line in lines)
    ta, tb = load_model_tensors(a), load_model_tensors(b)
    for key, t in merged.tensors.items():
        want = (0.7 * ta[key].double() + 0.3 * tb[key].double()).float()
        assert within_ulp(t, want), key


def test_three_inputs(tmp_path):
    ckpts = [save_gpt(tmp_path / f"r{i}", seed=i, step=5 + i) for i in range(3)]
    out = merge_checkpoints(ckpts, tmp_path / "out", log=lambda _: None)
    merged = load_checkpoint(list_checkpoints(out)[0])
    assert merged.state["step"] == 7
    ts = [load_model_tensors(c) for c in ckpts]
    for key, t in merged.tensors.items():
        want = ((ts[0][key].double() + ts[1][key].double() + ts[2][key].double()) / 3).float()
        assert within_ulp(t, want), key


def test_merged_run_samples_and_exports(tmp_path, capsys):
    a, b = save_gpt(tmp_path / "a", seed=1), save_gpt(tmp_path / "b", seed=2)
    code, out, err = run_main(
        capsys, "merge", str(a), str(b), "-o", str(tmp_path / "out"), "--weights", "0.7,0.3"
    )
    assert code == 0 and "wrote" in out, err
    model, tokenizer, ckpt = load_model_from_checkpoint(tmp_path / "out")
    assert ckpt.state["merge_weights"] == [0.7, 0.3]
    code, out, err = run_main(
        capsys, "sample", str(tmp_path / "out"), "--max-new-tokens", "5", "--prompt", "ab"
    )
    assert code == 0 and out.startswith("ab"), err
    code, _, err = run_main(capsys, "export", str(tmp_path / "out"), "-o", str(tmp_path / "export"))
    assert code == 0, err
    assert (tmp_path / "export" / "model.safetensors").is_file()


def test_dtype_and_integer_tensors(tmp_path):
    state = {
        "config": config_to_dict(Config(model=ModelConfig(kind="custom", factory="x:y"))),
        "step": 1,
    }
    w = torch.randn(3, 2)
    save_checkpoint(tmp_path / "a", 1, {"w": w, "n": torch.tensor([1, 2])}, None, None, state)
    save_checkpoint(
        tmp_path / "b", 1, {"w": w.double(), "n": torch.tensor([1, 2])}, None, None, state
    )
    save_checkpoint(tmp_path / "c", 1, {"w": w, "n": torch.tensor([1, 3])}, None, None, state)
    with pytest.raises(
        CheckpointError, match=r"tensor w is torch.float32 in .* but torch.float64 in"
    ):
        merge_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "out", log=lambda _: None)
    with pytest.raises(
        CheckpointError, match=r"tensor n \(torch.int64\) differs .* must be\s+equal"
    ):
        merge_checkpoints([tmp_path / "a", tmp_path / "c"], tmp_path / "out", log=lambda _: None)
    out = merge_checkpoints([tmp_path / "a", tmp_path / "a"], tmp_path / "out", log=lambda _: None)
    merged = load_checkpoint(list_checkpoints(out)[0]).tensors
    assert torch.equal(merged["n"], torch.tensor([1, 2])) and torch.equal(merged["w"], w)


def test_bad_weights_and_outputs(tmp_path, capsys):
    a, b = save_gpt(tmp_path / "a", seed=1), save_gpt(tmp_path / "b", seed=2)
    for weights, pattern in [
        ([1.0], r"--weights has 1 values for 2 checkpoints.*--weights 1,1"),
        ([1.0, -1.0], r"value -1.0 .* is negative"),
        ([1.0, math.nan], r"value nan .* is not finite"),
        ([1.0, math.inf], r"value inf .* is not finite"),
        ([0.0, 0.0], r"sum to 0; make at least one > 0"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            merge_checkpoints([a, b], tmp_path / "out", weights=weights, log=lambda _: None)
    with pytest.raises(ConfigError, match=r"not a comma-separated list of numbers"):
        parse_weights("0.7;0.3")
    with pytest.raises(ConfigError, match=r"needs 2 or more checkpoints, got 1"):
        merge_checkpoints([a], tmp_path / "out")
    with pytest.raises(ConfigError, match=r"already exists and is not an empty directory"):
        merge_checkpoints([a, b], tmp_path / "a")
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        merge_checkpoints([a, tmp_path / "nope"], tmp_path / "out")
    code, _, err = run_main(
        capsys, "merge", str(a), str(b), "-o", str(tmp_path / "out"), "--weights", "1,-1"
    )
    assert code == 2 and "is negative" in err


def test_sharded_checkpoints_are_read_through_checkpoint_sharded(tmp_path, monkeypatch):
    """Dispatch only: lockstep.checkpoint.sharded_load (FSDP) is faked here, its own tests cover the real one."""
    import lockstep.checkpoint

    a, b = save_gpt(tmp_path / "a", seed=1), save_gpt(tmp_path / "b", seed=2)
    ta = load_model_tensors(a)
    full = {k: torch.zeros_like(v) for k, v in ta.items()}
    fake = types.ModuleType("lockstep.checkpoint.sharded_load")
    fake.is_sharded = lambda d: Path(d) == b
    fake.load_full_model_tensors = lambda d: full
    monkeypatch.setitem(sys.modules, "lockstep.checkpoint.sharded_load", fake)
    monkeypatch.setattr(lockstep.checkpoint, "sharded_load", fake, raising=False)
    assert load_model_tensors(b) is full
    out = merge_checkpoints([a, b], tmp_path / "out", log=lambda _: None)
    for key, t in load_checkpoint(list_checkpoints(out)[0]).tensors.items():
        assert within_ulp(t, ta[key] / 2), key


# ---------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def llama_dir(tiny_llama):
    pytest.importorskip("peft")
    return tiny_llama  # the session's (tests/unit/conftest.py)


def save_lora(run, llama_dir, seed: int):
    """A LoRA checkpoint as the trainer writes one, its adapters perturbed by `seed`; and its merged full model."""
    from lockstep.models.hf import build_hf_model, trainable_state_dict

    cfg = Config(
        model=ModelConfig(
            kind="hf",
            path=str(llama_dir),
            use_lora=True,
            lora_rank=4,
            lora_alpha=8.0,
            lora_dropout=0.0,
        )
    )
    model = build_hf_model(cfg.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # lora_B starts at 0: without this every adapter would be a no-op
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ckpt = save_checkpoint(
        run, 3, trainable_state_dict(model), None, None, {"config": config_to_dict(cfg), "step": 3}
    )
    return ckpt, copy.deepcopy(model).merge_and_unload().state_dict()


def test_lora_checkpoints_merge_into_full_weights_then_average(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM

    from lockstep.tools.export import export_checkpoint

    a, full_a = save_lora(tmp_path / "a", llama_dir, seed=1)
    b, full_b = save_lora(tmp_path / "b", llama_dir, seed=2)
    out = merge_checkpoints([a, b], tmp_path / "out", log=lambda _: None)
    merged = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    assert set(merged) == set(full_a)
    for key, t in merged.items():
        assert within_ulp(t, (full_a[key] + full_b[key]) / 2), key
    # the adapters' own mean is not what was written: mean(B A) != mean(B) mean(A)
    key = next(k for k in merged if k.endswith("q_proj.weight"))
    base = AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()[key]
    assert not torch.allclose(merged[key], base)
    assert json.loads((out / "final" / "lockstep.json").read_text())["format"] == "full"
    assert (out / "final" / "tokenizer.json").is_file()
    # the checkpoint holds the full weights with use_lora off, so export rebuilds them from the base model
    ckpt = load_checkpoint(list_checkpoints(out)[0])
    assert ckpt.state["config"]["model"]["use_lora"] is False and set(ckpt.tensors) == set(full_a)
    exported = export_checkpoint(out, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert all(torch.equal(reloaded[k], merged[k]) for k in merged)


def test_full_hf_checkpoints_average_and_write_final(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM

    from lockstep.models.hf import build_hf_model, trainable_state_dict

    cfg = Config(model=ModelConfig(kind="hf", path=str(llama_dir)))
    sds = []
    for name, seed in (("a", 1), ("b", 2)):
        model = build_hf_model(cfg.model)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        sds.append({k: v.clone() for k, v in trainable_state_dict(model).items()})
        save_checkpoint(
            tmp_path / name, 4, sds[-1], None, None, {"config": config_to_dict(cfg), "step": 4}
        )
    out = merge_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "out", log=lambda _: None)
    merged = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    for key, t in merged.items():
        assert within_ulp(t, (sds[0][key] + sds[1][key]) / 2), key
