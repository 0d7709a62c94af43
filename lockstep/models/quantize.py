"""QLoRA: a Hugging Face model's frozen base loaded in 4-bit (bitsandbytes), LoRA trained on it.

model.load_in_4bit (with model.use_lora) loads every linear layer of the base but the output head
as bitsandbytes' Linear4bit: NF4 codes for blocks of 64 weights, their scales quantized once more
(double quantization), matmuls computed in bf16 (fp16 on GPUs without native bf16): the recipe of
the QLoRA paper (Dettmers et al., 2023). A 7B base then takes about 5 GiB of GPU memory (its
embeddings and head kept in fp32) instead of 13 GiB in bf16.

    check_4bit_training    where a 4-bit base cannot train, fail before a weight loads: `lockstep
                           train` calls it before its workers start, and every worker again
    build_bnb_config       transformers' BitsAndBytesConfig of that recipe
    load_4bit_model        from_pretrained onto this rank's GPU, then peft's
                           prepare_model_for_kbit_training
    full_precision_config  what export, merge and sample build instead: the base in model.dtype

What a run keeps. Checkpoints hold the adapters alone: the base is frozen, and
lockstep.models.hf.trainable_state_dict takes the trainable tensors only, so a resume reloads the
base from model.path. The final directory holds the adapter, its lockstep.json naming the base and
how it was quantized (qlora_note).

`lockstep export --merge-lora` merges the adapters into the base reloaded in model.dtype from
model.path, never into the 4-bit weights. Merging there means dequantize, add, quantize again: the
adapters' update, small next to a weight, is rounded to NF4's 16 levels per block (updates under
half a step vanish), and the result is a 4-bit model few tools load. Merged into the
full-precision base the update is kept exactly and the model loads anywhere, without a GPU or
bitsandbytes; it differs from what training computed by the base's own 4-bit rounding (training
saw NF4(W) + BA, the merge is W + BA), which is how QLoRA adapters are usually deployed. Merging
into the dequantized NF4 weights instead would reproduce training's outputs exactly, but ships that
rounding noise at full size and needs bitsandbytes to export.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import re
from typing import Any

import torch
from torch import nn

from lockstep.config import ModelConfig
from lockstep.errors import ConfigError

QLORA_HINT = "pip install 'lockstep[qlora]'"
# transformers 5 refuses an older bitsandbytes for 4-bit loading (its BITSANDBYTES_MIN_VERSION);
# pyproject's qlora extra asks for the same
MIN_BITSANDBYTES = "0.46.1"
NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}


def check_4bit_training(model: ModelConfig, data_parallel: str, device: torch.device) -> None:
    """Where model.load_in_4bit cannot train, a ConfigError with the fix: off CUDA, under FSDP, or
    without bitsandbytes. Nothing for a model without it."""
    if not model.load_in_4bit:
        return
    check_4bit_device(device)
    if data_parallel == "fsdp":
        raise ConfigError(
            "model.load_in_4bit with parallel.data_parallel = 'fsdp': lockstep does not shard a "
            "4-bit base (FSDP2 over bitsandbytes' packed uint8 blocks, their scales kept beside "
            "them, is untested here, and lockstep's sharded checkpoints save every parameter, the "
            "whole base too); set parallel.data_parallel: ddp (each GPU holds the whole 4-bit "
            "base, which QLoRA makes small) or train on one GPU"
        )
    require_bitsandbytes()


def check_4bit_device(device: torch.device) -> None:
    """A 4-bit base trains on CUDA only; elsewhere a one-line ConfigError that says what to do."""
    if device.type == "cuda":
        return
    why = ""
    if not torch.cuda.is_available():
        why = "; this machine has no GPU (torch.cuda.is_available() is False)"
    raise ConfigError(
        "model.load_in_4bit needs a CUDA device: a 4-bit base is there to save GPU memory, and "
        "lockstep runs bitsandbytes' 4-bit layers on NVIDIA GPUs only, but this process trains on "
        f"{device.type}{why}; drop --load-in-4bit (LoRA on the full-precision base: --use-lora) or "
        "run on a GPU node"
    )


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def require_bitsandbytes() -> None:
    """bitsandbytes, new enough for transformers' 4-bit loading, or how to install it. Read from
    the installed package's metadata: importing bitsandbytes takes seconds and loads CUDA code."""
    try:
        found = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        problem = "bitsandbytes is not installed"
    else:
        if _release(found) >= _release(MIN_BITSANDBYTES):
            return
        problem = f"bitsandbytes {found} is installed, older than {MIN_BITSANDBYTES}"
    raise ConfigError(
        f"model.load_in_4bit needs bitsandbytes >= {MIN_BITSANDBYTES} (transformers loads 4-bit "
        f"weights through it): {problem}; install it: {QLORA_HINT}"
    )


def quantized_device(device: torch.device | None) -> torch.device:
    """The device a 4-bit base loads on: `device`, or (None) the GPU lockstep.runtime bound this
    process to; a ConfigError off CUDA."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    check_4bit_device(device)
    return device


def build_bnb_config(native_bf16: bool) -> Any:
    """transformers' BitsAndBytesConfig for QLoRA: NF4, double quantization, bf16 compute where the
    GPU has native bf16 (compute capability 8.0 on), fp16 elsewhere."""
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if native_bf16 else torch.float16
    return BitsAndBytesConfig(**NF4, bnb_4bit_compute_dtype=compute)


def load_4bit_model(
    auto_cls: Any, path: str, config: Any, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """auto_cls.from_pretrained(path) with its linear layers quantized to 4-bit as they load, onto
    `device` (one rank's GPU: every rank holds the whole base), frozen and ready for LoRA.

    `dtype` is what the layers that stay unquantized load in (embeddings, norms, the output head);
    prepare_model_for_kbit_training then keeps them in fp32 and freezes every parameter. It is told
    not to enable activation checkpointing: lockstep.models.hf.apply_training_options does, as for
    any model, non-reentrant, which needs no input-gradient hook; peft would add that hook and call
    transformers' deprecated gradient_checkpointing_enable.
    """
    require_bitsandbytes()
    from peft import prepare_model_for_kbit_training

    if device.type == "cuda":
        native_bf16 = torch.cuda.get_device_capability(device)[0] >= 8
        device_map = {"": device.index}  # transformers' own default: the GPU's index
    else:  # bitsandbytes' CPU backend: refused for training (check_4bit_device), tests load with it
        native_bf16, device_map = True, {"": device.type}
    model = auto_cls.from_pretrained(
        path,
        config=config,
        dtype=dtype,
        quantization_config=build_bnb_config(native_bf16),
        device_map=device_map,
        local_files_only=True,
    )
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def is_4bit(model: nn.Module) -> bool:
    """Whether `model` (a transformers model, or peft's wrapper of one) has a 4-bit base."""
    # peft's wrapper hands attribute lookups on to the model it wraps
    return bool(getattr(model, "is_loaded_in_4bit", False))


def logical_numel(p: torch.Tensor) -> int:
    """The weights a parameter stands for: a bitsandbytes 4-bit parameter packs two in a uint8 and
    keeps the original shape in its quant_state; any other tensor, its numel()."""
    state = getattr(p, "quant_state", None)
    return math.prod(state.shape) if state is not None else p.numel()


def full_precision_config(cfg: ModelConfig) -> ModelConfig:
    """cfg with the base loaded in model.dtype instead of 4-bit: what export, merge and sample
    build to put a QLoRA run's adapters on, on any machine (the adapters' names and shapes are the
    same)."""
    return dataclasses.replace(cfg, load_in_4bit=False)


def refuse_4bit_merge(model: nn.Module) -> None:
    """Merging LoRA into a 4-bit base quantizes the sum again: the module docstring says what that
    loses."""
    if is_4bit(model):
        raise ConfigError(
            "merging LoRA adapters into a 4-bit base would quantize the merged weights to 4-bit "
            "again, rounding the adapters' updates to NF4's steps; save the adapter "
            "(merge_lora=False), or run `lockstep export RUN -o DIR --merge-lora`, which merges "
            "into the base reloaded in model.dtype from model.path"
        )


def qlora_note(kind: str) -> dict[str, str]:
    """What lockstep.json adds for adapters trained on a 4-bit base: the quantization, and how to
    load `kind` (adapter | merged)."""
    if kind == "merged":
        note = (
            "the adapters were trained on the base quantized to 4-bit NF4, then merged into the "
            "base reloaded in full precision from base_model (not into the 4-bit weights, where "
            "quantizing again would round their updates to NF4's steps)"
        )
    else:
        how = ", ".join(f"{k}={v!r}" for k, v in NF4.items())
        note = (
            "trained on the base quantized to 4-bit NF4: load_with puts the adapter on the "
            "full-precision base, which differs from the weights it was trained on by their 4-bit "
            "rounding; to run it as trained, load the base with "
            f"quantization_config=BitsAndBytesConfig({how}) on a GPU"
        )
    return {"base_quantization": "bitsandbytes nf4, double quantization (QLoRA)", "note": note}
