"""lockstep.models.hf on tiny random models saved locally (no downloads, no network)."""

from __future__ import annotations

import json
import math
import shutil
import socket
import time

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from lockstep.config import ModelConfig
from lockstep.errors import ConfigError
from lockstep.models.hf import (  # noqa: E402
    build_hf_model,
    hf_flops_per_token,
    load_hf_processor,
    load_trainable_state_dict,
    save_hf_model,
    trainable_state_dict,
)
from lockstep.models.hf_loss import hf_forward_loss  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tiny_llama):
    return tiny_llama  # the session's (tests/unit/conftest.py)


@pytest.fixture(scope="module")
def whisper_dir(tiny_whisper):
    return tiny_whisper


def hf_cfg(path, **overrides) -> ModelConfig:
    return ModelConfig(kind="hf", path=str(path), **overrides)


def lora_cfg(path, **overrides) -> ModelConfig:
    return hf_cfg(path, use_lora=True, lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, **overrides)


def token_batch(B: int = 2, T: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 300, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def train_steps(model, steps: int = 2) -> None:
    """AdamW over *all* parameters: frozen ones get no grad, so only what is trainable may move."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model.train()
    for step in range(steps):
        hf_forward_loss(model, token_batch(seed=step)).backward()
        opt.step()
        opt.zero_grad()


@torch.no_grad()
def logits(model, seed: int = 7) -> torch.Tensor:
    model.eval()
    return model(input_ids=token_batch(seed=seed)["input_ids"]).logits


def test_causal_lm_builds_llama_with_finite_loss(llama_dir):
    model = build_hf_model(hf_cfg(llama_dir))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.float32
    loss = hf_forward_loss(model, token_batch())
    assert loss.shape == () and math.isfinite(loss.item())
    assert load_hf_processor(hf_cfg(llama_dir)).feature_extractor is None


def test_speech_seq2seq_builds_whisper(whisper_dir):
    cfg = hf_cfg(whisper_dir, task="speech-seq2seq")
    model = build_hf_model(cfg)
    assert type(model).__name__ == "WhisperForConditionalGeneration"
    processor = load_hf_processor(cfg)
    assert type(processor.feature_extractor).__name__ == "WhisperFeatureExtractor"
    features = processor.feature_extractor(
        [torch.randn(16000).numpy()], sampling_rate=16000, return_tensors="pt"
    ).input_features  # (1, 16 mels, 100 frames)
    labels = processor.tokenizer(["hello there"], return_tensors="pt").input_ids
    loss = hf_forward_loss(model, {"input_features": features, "labels": labels})
    assert math.isfinite(loss.item())


def test_bfloat16_dtype(llama_dir):
    model = build_hf_model(hf_cfg(llama_dir, dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_gradient_checkpointing_enabled(llama_dir):
    model = build_hf_model(lora_cfg(llama_dir, gradient_checkpointing=True))
    base = model.get_base_model()
    flag = getattr(type(base), "is_activation_checkpointing", None)  # transformers 5 renamed it
    assert base.is_activation_checkpointing if flag is not None else base.is_gradient_checkpointing
    model.train()
    hf_forward_loss(
        model, token_batch()
    ).backward()  # recomputes checkpointed layers; embeddings are frozen
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    # lora_A: zero until B moves
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)


def test_lora_trains_only_adapters(llama_dir):
    model = build_hf_model(lora_cfg(llama_dir))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    state = trainable_state_dict(model)
    assert sorted(state) == sorted(trainable) and set(state) <= set(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(model, steps=2)  # two: lora_A has zero grad until lora_B (zero at init) has moved
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == set(state)


# peft reads the old name
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_adapter_save_reload_same_logits(llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = lora_cfg(llama_dir)
    model = build_hf_model(cfg)
    train_steps(model)
    out = save_hf_model(model, tmp_path / "adapter", processor=load_hf_processor(cfg))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()
    info = json.loads((out / "lockstep.json").read_text())
    assert info["format"] == "adapter" and info["base_model"] == str(llama_dir.resolve())
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(info["base_model"]), out
    )
    torch.testing.assert_close(logits(reloaded), logits(model), atol=1e-5, rtol=0)


def test_lora_merged_save_loads_without_peft(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_hf_model(lora_cfg(llama_dir))
    train_steps(model)
    want = logits(model)
    out = save_hf_model(model, tmp_path / "merged", merge_lora=True)
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    assert json.loads((out / "lockstep.json").read_text())["format"] == "merged"
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(logits(merged), want, atol=1e-4, rtol=0)
    # the training model kept its adapters
    assert any("lora_A" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(logits(model), want, atol=0, rtol=0)


def test_adapters_trained_on_a_4bit_base_say_so(llama_dir, tmp_path):
    # export rebuilds a QLoRA run's base in full precision (trained_in_4bit), and the directory says
    # what the adapters were trained on and how to load them as trained
    model = build_hf_model(lora_cfg(llama_dir))
    plain = json.loads((save_hf_model(model, tmp_path / "plain") / "lockstep.json").read_text())
    assert "base_quantization" not in plain and "note" not in plain
    notes = {}
    for merge, kind in ((False, "adapter"), (True, "merged")):
        out = save_hf_model(model, tmp_path / kind, merge_lora=merge, trained_in_4bit=True)
        info = json.loads((out / "lockstep.json").read_text())
        assert info["format"] == kind and info["base_model"] == str(llama_dir.resolve())
        assert info["base_quantization"] == "bitsandbytes nf4, double quantization (QLoRA)"
        notes[kind] = info["note"]
    assert notes["adapter"].endswith(
        "load the base with quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
        "bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True) on a GPU"
    )
    assert "merged into the base reloaded in full precision from base_model" in notes["merged"]


def test_full_model_save_loads(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = hf_cfg(llama_dir)
    model = build_hf_model(cfg)
    assert trainable_state_dict(model).keys() == model.state_dict().keys()
    out = save_hf_model(model, tmp_path / "full", processor=load_hf_processor(cfg))
    assert json.loads((out / "lockstep.json").read_text())["format"] == "full"
    assert (out / "tokenizer.json").is_file()
    torch.testing.assert_close(
        logits(AutoModelForCausalLM.from_pretrained(out)), logits(model), atol=0, rtol=0
    )


def test_load_trainable_state_dict_round_trip(llama_dir):
    trained = build_hf_model(lora_cfg(llama_dir))
    train_steps(trained)
    saved = {k: v.clone() for k, v in trainable_state_dict(trained).items()}
    fresh = build_hf_model(lora_cfg(llama_dir))
    assert not torch.allclose(logits(fresh), logits(trained))
    load_trainable_state_dict(fresh, saved)
    torch.testing.assert_close(logits(fresh), logits(trained), atol=0, rtol=0)

    key = next(iter(saved))
    with pytest.raises(ConfigError, match=r"1 missing \(e\.g\. .*lora_A"):
        load_trainable_state_dict(fresh, {k: v for k, v in saved.items() if k != key})
    with pytest.raises(ConfigError, match="1 unexpected .*extra.weight"):
        load_trainable_state_dict(fresh, {**saved, "extra.weight": torch.zeros(1)})
    with pytest.raises(
        ConfigError, match=r"has shape \(3, 64\), the LoRA adapter expects \(4, 64\).*lora_rank"
    ):
        load_trainable_state_dict(fresh, {**saved, key: torch.zeros(3, 64)})


def test_flops_per_token(llama_dir):
    full = build_hf_model(hf_cfg(llama_dir))
    n = sum(p.numel() for p in full.parameters())
    emb = full.get_input_embeddings().weight.numel()  # untied: a lookup, not counted
    assert hf_flops_per_token(full) == 6 * (n - emb)
    lora = build_hf_model(lora_cfg(llama_dir))
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert 0 < adapters < n / 10
    assert hf_flops_per_token(lora) == 4 * (n + adapters - emb) + 2 * adapters


def fake_hf_cache(monkeypatch, home):
    """Point huggingface_hub at an HF_HOME of our own (its cache path is read at import, so patch it too)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return home / "hub"


def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("lockstep.models.hf must not touch the network")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_hub_id_in_cache_loads_offline(llama_dir, tmp_path, monkeypatch):
    cache = fake_hf_cache(monkeypatch, tmp_path / "hf")
    repo = cache / "models--lockstep-test--tiny-llama"
    commit = "0" * 40
    shutil.copytree(llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    no_network(monkeypatch)
    model = build_hf_model(lora_cfg("lockstep-test/tiny-llama"))
    assert model.peft_config["default"].base_model_name_or_path == "lockstep-test/tiny-llama"


# ---- bad input: each error names the value, the rule and the fix


def test_missing_dir(tmp_path):
    with pytest.raises(
        ConfigError, match=r"does not exist.*never downloads.*local Hugging Face cache"
    ):
        build_hf_model(hf_cfg(tmp_path / "nope"))


def test_dir_without_config_json(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(
        ConfigError, match=r"no config\.json.*contains: weights\.bin.*save_pretrained"
    ):
        build_hf_model(hf_cfg(tmp_path))


def test_adapter_dir_as_model_path(llama_dir, tmp_path):
    out = save_hf_model(build_hf_model(lora_cfg(llama_dir)), tmp_path / "adapter")
    with pytest.raises(ConfigError, match=r"holds a LoRA adapter .*base model .*merge_lora=True"):
        build_hf_model(hf_cfg(out))


def test_hub_id_not_in_cache_fails_fast_offline(tmp_path, monkeypatch):
    fake_hf_cache(monkeypatch, tmp_path / "empty-hf-home")
    no_network(monkeypatch)
    start = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=r"'someorg/some-model' is not a local directory.*not in the local "
        r"Hugging Face cache .*empty-hf-home.*never downloads.*hf download",
    ):
        build_hf_model(hf_cfg("someorg/some-model"))
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        load_hf_processor(hf_cfg("someorg/some-model"))
    assert time.monotonic() - start < 5


def test_wrong_task_for_architecture(llama_dir):
    with pytest.raises(
        ConfigError,
        match=r"LlamaForCausalLM .*AutoModelForSpeechSeq2Seq .*'speech-seq2seq'.*"
        r"set model.task to 'causal-lm' or 'sequence-classification'",
    ):
        build_hf_model(hf_cfg(llama_dir, task="speech-seq2seq"))


def test_lora_targets_match_nothing(llama_dir):
    with pytest.raises(
        ConfigError,
        match=r"lora_target_modules = 'qkv, fc' matches no module of LlamaForCausalLM.*"
        r"named .*q_proj.*v_proj.*'all-linear'",
    ):
        build_hf_model(hf_cfg(llama_dir, use_lora=True, lora_target_modules="qkv, fc"))


def test_speech_task_without_feature_extractor(llama_dir, tmp_path):
    # a causal LM has no preprocessor_config.json; asking for a speech processor says what is missing
    with pytest.raises(ConfigError, match=r"needs a feature extractor.*preprocessor_config\.json"):
        load_hf_processor(hf_cfg(llama_dir, task="ctc"))
