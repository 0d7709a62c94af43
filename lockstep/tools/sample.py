"""Generate text from a trained GPT: used at the end of training and by `lockstep sample`."""

from __future__ import annotations

from pathlib import Path

import torch

from lockstep.checkpoint.plain import Checkpoint
from lockstep.errors import ConfigError
from lockstep.data.tokenizer import tokenizer_from_json
from lockstep.tools.export import check_weights_fit, checkpoint_config, load_verified_checkpoint, resolve_checkpoint
from lockstep.models.gpt import GPT, build_gpt


def load_model_from_checkpoint(path: str | Path) -> tuple[GPT, object, Checkpoint]:
    """A checkpoint directory, or a run directory (its newest checkpoint that verifies)."""
    ckpt = load_verified_checkpoint(resolve_checkpoint(path))
    cfg = checkpoint_config(ckpt)
    if cfg.model.kind != "gpt":
        raise ConfigError(f"lockstep sample generates with the built-in GPT, but {ckpt.path} holds model.kind = "
                          f"{cfg.model.kind!r}; write it out with `lockstep export {path} -o DIR` and generate with "
                          "its own code (for hf: from_pretrained(DIR) and generate)")
    model = build_gpt(cfg.model)
    check_weights_fit(ckpt, model.state_dict())
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
