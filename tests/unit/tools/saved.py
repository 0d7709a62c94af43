"""Checkpoints the export and sample tests read: a tiny GPT saved as `lockstep train` saves it, and a damaged one."""

from __future__ import annotations

from pathlib import Path

import torch

from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import Config, ModelConfig, config_to_dict
from lockstep.models.gpt import build_gpt


def save_gpt(run: Path, step: int, **model) -> Path:
    cfg = Config(
        model=ModelConfig(
            **{"hidden_size": 32, "attention_heads": 2, "layers": 1, "max_seq_length": 16, **model}
        )
    )
    torch.manual_seed(step)
    return save_checkpoint(
        run,
        step,
        build_gpt(cfg.model).state_dict(),
        None,
        None,
        {"config": config_to_dict(cfg), "step": step},
    )


def truncate(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
