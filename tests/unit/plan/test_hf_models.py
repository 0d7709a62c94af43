"""lockstep.plan.hf_models: Hugging Face models built from a config.json alone (no weights) on
fake tensors as train builds them (LoRA adapters included), their batches, shapes and FLOPs; the
models whose step cannot run on fake tensors estimated by formula, saying so; a 4-bit base counted
at NF4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.models.hf import apply_training_options, hf_flops_per_token
from lockstep.parallel.mesh import check_layout, resolve_batch
from lockstep.plan.hf_models import NF4_BYTES
from lockstep.plan.models import ModelShape
from lockstep.plan.simulate import build_fake_model, simulate_rank

LLAMA = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
WHISPER = dict(
    vocab_size=300,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    num_mel_bins=16,
    max_source_positions=50,
    max_target_positions=40,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=3,
)


def _saved(config, path: Path) -> str:
    config.save_pretrained(path)  # config.json only: a plan reads no weights
    return str(path)


def _cfg(path: str, **sets):
    return load_config(None, {"model.kind": "hf", "model.path": path, **sets})


def test_a_llama_with_lora_is_train_s_model_on_fake_tensors(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _cfg(
        _saved(LlamaConfig(**LLAMA), tmp_path / "llama"),
        **{"model.use_lora": True, "model.max_seq_length": 32},
    )
    with FakeTensorMode():
        built = build_fake_model(cfg)
        batch = built.batch(3)
        loss = built.loss(built.model, batch)
    real = apply_training_options(LlamaForCausalLM(LlamaConfig(**LLAMA)), cfg.model)
    assert [(n, p.shape, p.requires_grad) for n, p in built.model.named_parameters()] == [
        (n, p.shape, p.requires_grad) for n, p in real.named_parameters()
    ]
    assert all(isinstance(p, FakeTensor) for p in built.model.parameters())
    assert batch["input_ids"].shape == batch["labels"].shape == (3, 32)
    assert isinstance(loss, FakeTensor) and loss.shape == ()
    assert built.flops_per_token == hf_flops_per_token(real)
    assert built.shape == ModelShape(
        hidden=64, layers=2, intermediate=128, logits=300, tokens_per_sample=32
    )
    assert built.notes == [f"Llama from {cfg.model.path} (config.json only)"]
    simulated, by_formula = _one_rank(cfg), _one_rank(cfg, formula=True)
    assert not simulated.estimated and by_formula.estimated == "NotSimulated: the formula, as asked"
    # the exact parts alike (the simulated peak comes before this step's gradients exist); the
    # formula's peak within 15% of the simulation's here
    assert by_formula.memory["parameters"] == simulated.memory["parameters"]
    # AdamW's moments; the simulation's also holds each parameter's step count (4 bytes)
    steps = 4 * sum(p.requires_grad for p in real.parameters())
    assert by_formula.memory["optimizer"] + steps == simulated.memory["optimizer"]
    assert by_formula.peak == pytest.approx(simulated.peak, rel=0.15)


def test_a_whisper_reads_its_encoder_s_whole_input_and_counts_each_stack_s_flops(tmp_path):
    from transformers import WhisperConfig

    cfg = _cfg(
        _saved(WhisperConfig(**WHISPER), tmp_path / "whisper"),
        **{"model.task": "speech-seq2seq", "data.kind": "audio", "data.path": "x"},
    )
    with FakeTensorMode():
        built = build_fake_model(cfg)
        batch = built.batch(2)
    assert batch["input_features"].shape == (2, 16, 100)  # mel bins x 2 x encoder positions
    assert batch["labels"].shape == (2, 40)  # model.max_seq_length (128) cut to the decoder's 40
    assert built.shape.tokens_per_sample == 50 + 40 and built.shape.layers == 2
    # logits for the labels only; the encoder's layer reads the frames, the decoder's the labels
    assert built.shape.targets_per_sample == 40 and built.shape.layer_tokens == 50 + 40
    encoder = built.model.get_encoder()
    enc = sum(4 * p.numel() + 2 * p.numel() * p.requires_grad for p in encoder.parameters())
    whole = hf_flops_per_token(built.model)
    assert built.flops_per_token == pytest.approx((enc * 50 + (whole - enc) * 40) / 90)


def _one_rank(cfg, formula=False):
    layout = check_layout(cfg, 1)
    return simulate_rank(cfg, layout, resolve_batch(cfg.train, 1), 0, formula=formula)


def _tiny_higgs(path: Path) -> str:
    from transformers import HiggsAudioV2Config

    config = HiggsAudioV2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        codebook_size=1026,
        audio_token_id=299,
        audio_bos_token_id=298,
        audio_delay_token_id=297,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _saved(config, path)


def test_a_model_whose_step_fake_tensors_cannot_run_is_estimated_and_says_so(tmp_path):
    """Higgs Audio v2 picks its audio frames with boolean masks: the plan falls back to the formula,
    with the parameters, gradients and optimizer state of the real shards all the same."""
    higgs = _tiny_higgs(tmp_path / "higgs")
    sets = {"model.use_lora": True, "data.kind": "chatml", "data.path": "x.json"}
    sim = _one_rank(_cfg(higgs, **sets, **{"train.batch_size": 2}))
    assert sim.estimated.startswith("DynamicOutputShapeException")
    assert sim.shape.tokens_per_sample == 512  # its own context, as train keeps its samples
    assert sim.memory["parameters"] == sim.params * 4
    assert sim.memory["gradients"] == sim.trainable * 4 < sim.memory["parameters"] / 4  # LoRA
    assert sim.memory["optimizer"] == 2 * sim.memory["gradients"]
    assert sim.memory["activations"] > 0 and sim.memory["temporary"] == 3 * 2 * 512 * 8 * 1026 * 4
    shorter = _one_rank(_cfg(higgs, **sets, **{"train.batch_size": 2, "model.max_seq_length": 64}))
    assert shorter.shape.tokens_per_sample == 64
    assert shorter.memory["activations"] == sim.memory["activations"] // 8

    with pytest.raises(ConfigError, match="load_in_4bit is not supported for the Higgs"):
        _one_rank(_cfg(higgs, **sets, **{"model.load_in_4bit": True}))


def test_a_ctc_model_has_no_batch_shape_and_is_estimated(tmp_path):
    from transformers import Wav2Vec2Config

    config = Wav2Vec2Config(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
    )
    sets = {"model.task": "ctc", "data.kind": "audio", "data.path": "x", "train.batch_size": 1}
    sim = _one_rank(_cfg(_saved(config, tmp_path / "ctc"), **sets))
    assert "reads audio of any length" in sim.estimated and sim.peak > 0


def test_a_4bit_base_counts_each_frozen_linear_weight_at_nf4(tmp_path):
    from transformers import LlamaConfig

    path = _saved(LlamaConfig(**LLAMA), tmp_path / "llama")
    sets = {"model.use_lora": True, "model.dtype": "bfloat16", "model.max_seq_length": 16}
    sets["train.batch_size"] = 1
    plain = _one_rank(_cfg(path, **sets))
    quantized = _one_rank(_cfg(path, **sets, **{"model.load_in_4bit": True}))
    h, i, kv, layers = 64, 128, 32, 2
    linear = layers * (h * h + 2 * h * kv + h * h + 3 * h * i) + h * 300  # q k v o, mlp, head
    saved = quantized.memory["parameters"] - plain.memory["parameters"]
    assert saved == -int(linear * (2 - NF4_BYTES))
    assert "4-bit base: frozen Linear weights counted at NF4's 4.127 bits" in quantized.notes
    assert quantized.memory["activations"] == plain.memory["activations"]


def test_the_seeds_configs_are_the_published_models(tmp_path):
    """examples/plan/prepare.py's config.json files, built on the meta device as the plan builds
    them: Whisper small's 242M parameters (openai/whisper-small), Higgs Audio v2's Llama-3.2-3B
    backbone and audio head."""
    import runpy

    prepare = Path(__file__).resolve().parents[3] / "examples" / "plan" / "prepare.py"
    dirs = runpy.run_path(str(prepare))["main"](tmp_path)
    whisper = _cfg(
        str(dirs["whisper"]),
        **{"model.task": "speech-seq2seq", "data.kind": "audio", "data.path": "x"},
    )
    with torch.device("meta"):
        built = build_fake_model(whisper)
    assert sum(p.numel() for p in built.model.parameters()) == pytest.approx(241.7e6, rel=0.01)
    assert built.shape.tokens_per_sample == 1500 + 128
    higgs = _cfg(str(dirs["higgs"]), **{"data.kind": "chatml", "data.path": "x.json"})
    with torch.device("meta"):
        built = build_fake_model(higgs)
    assert built.shape == ModelShape(
        hidden=3072,
        layers=28,
        intermediate=8192,
        logits=8 * 1024,
        tokens_per_sample=2048,
        token_shares=(("mlp", 0.5), ("audio_mlp", 0.5)),  # half text, half audio frames
    )
