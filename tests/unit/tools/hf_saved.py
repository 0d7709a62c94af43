"""What the sample / evaluate / trained tests read (helpers, no tests): tiny HF models saved as lockstep saves them
(a LoRA adapter-only checkpoint, a full-weights checkpoint, a from_pretrained directory), a tiny CTC model, and
real wav files with manifests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import Config, DataConfig, ModelConfig, config_to_dict


def lora_llama(base: Path, seed: int = 1):
    """The tiny llama at `base` wrapped with LoRA as a run with use_lora builds it, adapters made non-zero (lora_B
    starts at 0: an untrained adapter changes nothing), and its config."""
    from lockstep.models.hf import build_hf_model

    cfg = Config(
        model=ModelConfig(
            kind="hf", path=str(base), use_lora=True, lora_rank=4, lora_alpha=8.0, lora_dropout=0.0
        )
    )
    model = build_hf_model(cfg.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval(), cfg


def save_hf_checkpoint(run: Path, model, cfg: Config, step: int = 3) -> Path:
    """A checkpoint as the trainer writes one for an hf model: trainable_state_dict (adapters alone under LoRA)."""
    from lockstep.models.hf import trainable_state_dict

    return save_checkpoint(
        run,
        step,
        trainable_state_dict(model),
        None,
        None,
        {"config": config_to_dict(cfg), "step": step},
    )


def whisper_cfg(whisper: Path, manifest: Path | None = None, eval_fraction: float = 0.02) -> Config:
    data = (
        DataConfig(kind="audio", path=str(manifest), eval_fraction=eval_fraction)
        if manifest
        else DataConfig()
    )
    return Config(model=ModelConfig(kind="hf", path=str(whisper), task="speech-seq2seq"), data=data)


def write_wav(path: Path, freq: float, seconds: float = 0.5, rate: int = 16000) -> Path:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, (0.4 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate)
    return path


def write_manifest(path: Path, rows: list[tuple[str, str]]) -> Path:
    """A JSONL manifest of (audio path relative to the manifest, transcript) rows."""
    path.write_text("".join(json.dumps({"audio": a, "text": t}) + "\n" for a, t in rows))
    return path


def save_tiny_ctc(out: Path, seed: int = 0) -> Path:
    """A Wav2Vec2ForCTC (hidden 32, 1 layer) with a character vocabulary, as from_pretrained loads it."""
    from transformers import (
        Wav2Vec2Config,
        Wav2Vec2CTCTokenizer,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2ForCTC,
    )

    out.mkdir(parents=True, exist_ok=True)
    vocab = {
        "<pad>": 0,
        "<s>": 1,
        "</s>": 2,
        "<unk>": 3,
        "|": 4,
        **{c: i + 5 for i, c in enumerate("abcdefgh")},
    }
    (out / "vocab.json").write_text(json.dumps(vocab))
    tok = Wav2Vec2CTCTokenizer(str(out / "vocab.json"))
    fe = Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=16000,
        padding_value=0.0,
        do_normalize=True,
        return_attention_mask=False,
    )
    torch.manual_seed(seed)
    cfg = Wav2Vec2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        pad_token_id=0,
    )
    Wav2Vec2ForCTC(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    fe.save_pretrained(out)
    return out
