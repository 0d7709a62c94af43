"""LoRA adapters (peft) on a loaded Hugging Face model: which layers, which peft task type, and the
error that names the model's layers when model.lora_target_modules matches none.

lockstep.models.hf calls `apply_lora` last: after loading (in full precision, or a 4-bit base that
lockstep.models.quantize prepared) and after activation checkpointing. peft is imported inside, so
a missing install says how to get it.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from torch import nn

from lockstep.config import ModelConfig
from lockstep.errors import ConfigError

INSTALL_HINT = "pip install 'lockstep[hf]'"
# peft's task types pick the wrapper's forward signature; speech models have none, so the plain
# PeftModel passes every kwarg (input_features, ...) through. SEQ_CLS also trains the new head.
PEFT_TASK_TYPES = {
    "causal-lm": "CAUSAL_LM",
    "seq2seq-lm": "SEQ_2_SEQ_LM",
    "sequence-classification": "SEQ_CLS",
}


def _peft() -> Any:
    try:
        return importlib.import_module("peft")
    except ImportError as e:
        raise ConfigError(f"model.use_lora needs peft ({e}); install it: {INSTALL_HINT}") from None


def linear_names(model: nn.Module) -> list[str]:
    """Distinct last-component names of the linear layers LoRA can target: nn.Linear and its
    subclasses (bitsandbytes' Linear4bit among them), GPT-2's Conv1D."""
    names = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if n and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    }
    return sorted(names)


def lora_targets(spec: str) -> str | list[str]:
    """model.lora_target_modules as peft takes it: 'all-linear', or a list of the names."""
    spec = spec.strip()
    if spec == "all-linear":
        return spec
    return [t.strip() for t in spec.split(",") if t.strip()]


def apply_lora(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """`model` wrapped by peft with LoRA adapters as cfg says (rank, alpha, dropout, target
    modules): the base weights frozen, the adapters trainable."""
    peft = _peft()
    lora = peft.LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=lora_targets(cfg.lora_target_modules),
        task_type=PEFT_TASK_TYPES.get(cfg.task),
    )
    try:
        with warnings.catch_warnings():
            # peft 0.21 reads model.is_gradient_checkpointing, which transformers 5 deprecated;
            # not ours to act on
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
            )
            return peft.get_peft_model(model, lora)
    except ValueError as e:
        # peft >= 0.18 raises NoMatchingPeftModuleError; older ones a plain ValueError
        no_match = getattr(peft, "NoMatchingPeftModuleError", ())
        if not (isinstance(e, no_match) or "not found in the base model" in str(e)):
            raise
        names = linear_names(model)
        raise ConfigError(
            f"model.lora_target_modules = {cfg.lora_target_modules!r} matches no module of "
            f"{type(model).__name__} ({e}); its linear layers are named {', '.join(names[:12])}; "
            "set a comma-separated list of those, or 'all-linear'"
        ) from None
