"""Generate text from a trained GPT: used at the end of training and by `lockstep sample`."""

from __future__ import annotations

from pathlib import Path

import torch

from lockstep.checkpoint import Checkpoint, check_shapes, load_checkpoint, resolve_resume
from lockstep.config import config_from_dict
from lockstep.data.tokenizer import tokenizer_from_json
from lockstep.models.gpt import GPT, build_gpt


def load_model_from_checkpoint(path: str | Path) -> tuple[GPT, object, Checkpoint]:
    """A checkpoint directory, or a run directory (its newest checkpoint that verifies)."""
    path = Path(path)
    ckpt_dir = resolve_resume(path, str(path)) if (path / "checkpoints").is_dir() else path
    if ckpt_dir is None:
        raise FileNotFoundError(f"{path} has no committed checkpoint yet; train first or pass a checkpoint directory")
    ckpt = load_checkpoint(ckpt_dir)
    cfg = config_from_dict(ckpt.state["config"], source=str(ckpt_dir / "state.json"))
    model = build_gpt(cfg.model)
    check_shapes(ckpt.tensors, model.state_dict(), ckpt_dir)
    model.load_state_dict(ckpt.tensors)
    tokenizer = tokenizer_from_json(ckpt.extra.get("tokenizer.json", b"").decode() or None)
    return model.eval(), tokenizer, ckpt


def generate_text(model: GPT, tokenizer, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0) -> str:
    ids = tokenizer.encode(prompt) or [0]
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    return tokenizer.decode(out[0].tolist())
