"""Hugging Face models: build from a local directory, LoRA via peft, checkpoint and save.

`build_hf_model(cfg)` loads `cfg.path` with the Auto class of `cfg.task`, in `cfg.dtype` or with a
4-bit base (QLoRA: lockstep.models.quantize), optionally with activation checkpointing and LoRA
adapters (lockstep.models.lora). Loading is offline: a hub id works only when it is already in
the local Hugging Face cache; lockstep never downloads.

transformers and peft are imported inside the functions, so `import lockstep` stays light and a missing
install says how to get it. This module never imports `torch.distributed`.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.config import ModelConfig
from lockstep.errors import ConfigError
from lockstep.models.lora import INSTALL_HINT, apply_lora
from lockstep.models.quantize import (
    is_4bit,
    load_4bit_model,
    logical_numel,
    qlora_note,
    quantized_device,
    refuse_4bit_merge,
)

TASKS = ("causal-lm", "seq2seq-lm", "speech-seq2seq", "ctc", "sequence-classification")
SPEECH_TASKS = ("speech-seq2seq", "ctc")
# a bare repo name or owner/name; anything else (absolute, ./, ~, deeper paths) can only be a local path
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _require(module: str, needed_by: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{needed_by} needs {module} ({e}); install it: {INSTALL_HINT}") from None


def auto_class(task: str) -> Any:
    """The transformers Auto class that builds a model for `task` (model.task)."""
    transformers = _require("transformers", "model.kind = 'hf'")
    match task:
        case "causal-lm":
            return transformers.AutoModelForCausalLM
        case "seq2seq-lm":
            return transformers.AutoModelForSeq2SeqLM
        case "speech-seq2seq":
            return transformers.AutoModelForSpeechSeq2Seq
        case "ctc":
            return transformers.AutoModelForCTC
        case "sequence-classification":
            return transformers.AutoModelForSequenceClassification
        case _:
            raise ConfigError(
                f"model.task = {task!r} is not a known task; pick one of {', '.join(TASKS)}"
            )


def resolve_hf_path(path: str | None) -> tuple[str, bool]:
    """(local directory, whether `path` was a hub id). Never touches the network."""
    if not path:
        raise ConfigError(
            "model.kind = 'hf' needs model.path: a local directory written by save_pretrained"
        )
    local = Path(path).expanduser()
    if local.is_dir():
        return str(
            local.resolve()
        ), False  # absolute, so adapter configs point at it from any directory
    if local.exists():
        raise ConfigError(
            f"model.path = {path!r} is a file, not a directory; set it to the directory "
            "save_pretrained wrote (config.json + model.safetensors)"
        )
    never = (
        "lockstep never downloads, so a hub id works only when it is already in the local Hugging Face "
        "cache"
    )
    if not _HUB_ID.fullmatch(path) or ".." in path:
        where = "" if local.is_absolute() else f" (looked for {local.resolve()})"
        raise ConfigError(
            f"model.path = {path!r} does not exist{where}; {never}. Set it to a directory written "
            "by save_pretrained"
        )
    _require("transformers", "model.kind = 'hf'")  # huggingface_hub comes with it
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(path, local_files_only=True), True
    except (LocalEntryNotFoundError, HFValidationError):
        raise ConfigError(
            f"model.path = {path!r} is not a local directory (no {local.resolve()}), and as a hub id it is not in "
            f"the local Hugging Face cache ({constants.HF_HUB_CACHE}); lockstep loads offline and never downloads: "
            f"fetch it once (`hf download {path}`), or save_pretrained it to a directory and set model.path to that"
        ) from None


def load_hf_config(path: str, display: str) -> Any:
    """The transformers config of the model directory `path` (shown as `display`), or why it cannot be one."""
    transformers = _require("transformers", "model.kind = 'hf'")
    if not (Path(path) / "config.json").is_file():
        found = sorted(p.name for p in Path(path).iterdir())
        if "adapter_config.json" in found:
            base = json.loads((Path(path) / "adapter_config.json").read_text()).get(
                "base_model_name_or_path"
            )
            raise ConfigError(
                f"model.path = {display!r} holds a LoRA adapter (adapter_config.json) for base model "
                f"{base!r}, not a full model; set model.path to the base model, or save the run with "
                "merge_lora=True to get a full model directory"
            )
        shown = (
            ", ".join(found[:8]) + (f", ... ({len(found)} entries)" if len(found) > 8 else "")
            or "nothing"
        )
        raise ConfigError(
            f"model.path = {display!r} has no config.json, so it is not a Hugging Face model "
            f"directory (it contains: {shown}); point it at the output of save_pretrained "
            "(config.json + model.safetensors)"
        )
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"model.path = {display!r}: transformers {transformers.__version__} cannot read its "
            f"config.json ({type(e).__name__}: {e}); a model_type this version does not know "
            "needs a newer transformers (custom code models are not supported)"
        ) from None


def check_task(config: Any, auto_cls: Any, task: str, display: str) -> None:
    """Fail before loading weights when the architecture has no head for the task."""
    if type(config) in auto_cls._model_mapping:
        return
    fits = [t for t in TASKS if type(config) in auto_class(t)._model_mapping]
    archs = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
    fix = (
        f"set model.task to {' or '.join(map(repr, fits))}"
        if fits
        else f"no lockstep task fits it ({', '.join(TASKS)})"
    )
    raise ConfigError(
        f"model.path = {display!r} is a {archs} (model_type {config.model_type!r}), which "
        f"{auto_cls.__name__} (model.task = {task!r}) cannot build; {fix}"
    )


def build_hf_model(cfg: ModelConfig, device: torch.device | None = None) -> nn.Module:
    """The model at cfg.path for cfg.task, in cfg.dtype, with checkpointing and LoRA as configured.

    With cfg.load_in_4bit the base loads quantized straight onto `device` (None: the GPU this
    process is bound to), and anywhere but CUDA fails before a weight is read
    (lockstep.models.quantize). Other models load on the CPU; the trainer moves them.
    """
    device = quantized_device(device) if cfg.load_in_4bit else device
    path, is_hub_id = resolve_hf_path(cfg.path)
    auto_cls = auto_class(cfg.task)
    config = load_hf_config(path, cfg.path)
    check_task(config, auto_cls, cfg.task, cfg.path)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank drowns the trainer's own progress
    # transformers 5 loads in the checkpoint's dtype unless told (`dtype` was `torch_dtype` < 4.56)
    dtype = getattr(torch, cfg.dtype)
    try:
        if cfg.load_in_4bit:
            model = load_4bit_model(auto_cls, path, config, dtype, device)
        else:
            model = auto_cls.from_pretrained(
                path, config=config, dtype=dtype, local_files_only=True
            )
    except OSError as e:
        raise ConfigError(
            f"model.path = {cfg.path!r}: could not load the weights ({e}); the directory should "
            "hold what save_pretrained wrote (model.safetensors or its shards)"
        ) from None
    if is_hub_id:  # record the hub id, not the cache path, as the base of saved adapters
        model.name_or_path = model.config._name_or_path = cfg.path
    return apply_training_options(model, cfg)


def apply_training_options(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Activation checkpointing and LoRA adapters, as cfg asks, on a loaded Hugging Face model."""
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing needs no input that requires grad, so frozen embeddings under LoRA
        # are fine; transformers also hooks the embeddings to require grad for input_ids models.
        kwargs = {"use_reentrant": False}
        # transformers >= 5.x; the old name warns
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if cfg.use_lora:
        model = apply_lora(model, cfg)
    return model


@dataclass
class HFProcessor:
    """What turns raw data into model inputs: a tokenizer, plus a feature extractor for speech tasks."""

    tokenizer: Any
    feature_extractor: Any | None = None

    def save_pretrained(self, out_dir: str | Path) -> None:
        self.tokenizer.save_pretrained(out_dir)
        if self.feature_extractor is not None:
            self.feature_extractor.save_pretrained(out_dir)


def load_hf_processor(cfg: ModelConfig) -> HFProcessor:
    """The tokenizer (text tasks), or feature extractor + tokenizer (speech tasks) saved with cfg.path."""
    transformers = _require("transformers", "model.kind = 'hf'")
    path, _ = resolve_hf_path(cfg.path)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model.path = {cfg.path!r}: no tokenizer could be loaded ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}); save one beside the model with tokenizer.save_pretrained "
            "(tokenizer.json + tokenizer_config.json)"
        ) from None
    feature_extractor = None
    if cfg.task in SPEECH_TASKS:
        try:
            feature_extractor = transformers.AutoFeatureExtractor.from_pretrained(
                path, local_files_only=True
            )
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"model.task = {cfg.task!r} needs a feature extractor, and model.path = "
                f"{cfg.path!r} has none ({type(e).__name__}); save one beside the model with "
                "feature_extractor.save_pretrained (preprocessor_config.json)"
            ) from None
    return HFProcessor(tokenizer, feature_extractor)


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")  # duck-typed, so plain models never import peft


def trainable_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a training checkpoint must hold: with LoRA the trainable (adapter) tensors, keyed as in
    model.state_dict(); otherwise the full state_dict (frozen base weights reload from model.path)."""
    if not _is_peft(model):
        return model.state_dict()
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load what trainable_state_dict saved; keys must match exactly, shapes too."""
    expected = trainable_state_dict(model)
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    what = "LoRA adapter" if _is_peft(model) else "model"
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        raise ConfigError(
            f"the checkpoint's tensors do not match the {what}'s: {'; '.join(parts)}; resume with "
            "the model settings the checkpoint was written with (model.path, use_lora, "
            "lora_rank, lora_target_modules)"
        )
    for key, want in expected.items():
        if tuple(tensors[key].shape) != tuple(want.shape):
            raise ConfigError(
                f"checkpoint tensor {key} has shape {tuple(tensors[key].shape)}, the {what} expects "
                f"{tuple(want.shape)}; resume with the settings the checkpoint was written with "
                "(e.g. model.lora_rank)"
            )
    # strict=False: under LoRA the frozen base weights are absent on purpose (checked above instead)
    model.load_state_dict(tensors, strict=False)


def save_hf_model(
    model: nn.Module,
    out_dir: str | Path,
    processor: HFProcessor | None = None,
    merge_lora: bool = False,
    trained_in_4bit: bool = False,
) -> Path:
    """Write a directory from_pretrained loads, plus lockstep.json saying what it holds.

    LoRA without merge: peft's adapter directory (adapter_config.json + adapter_model.safetensors), loaded
    as base + PeftModel.from_pretrained. LoRA with merge: the adapters folded into a copy of the base
    weights, a full model. No LoRA: the full model. Pass the unwrapped model (not DDP/FSDP).
    Adapters trained on a 4-bit base (`model` loaded so, or `trained_in_4bit`: export rebuilds the
    base in full precision) are noted in lockstep.json; merging into a 4-bit base is refused
    (lockstep.models.quantize says why).
    """
    if merge_lora:
        refuse_4bit_merge(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if _is_peft(model):
        base = model.peft_config["default"].base_model_name_or_path
        if merge_lora:
            # merge_and_unload rewrites the module in place; work on a copy so training can go on
            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(out)
            kind, arch = "merged", type(merged).__name__
        else:
            model.save_pretrained(out)
            kind, arch = "adapter", type(model.get_base_model()).__name__
    else:
        model.save_pretrained(out)
        base, kind, arch = (
            getattr(model, "name_or_path", None) or None,
            "full",
            type(model).__name__,
        )
    if processor is not None:
        processor.save_pretrained(out)
    how = {
        "adapter": f"PeftModel.from_pretrained({arch}.from_pretrained({base!r}), {str(out)!r})",
        "merged": f"{arch}.from_pretrained({str(out)!r})",
        "full": f"{arch}.from_pretrained({str(out)!r})",
    }[kind]
    info = {"format": kind, "architecture": arch, "base_model": base, "load_with": how}
    if kind != "full" and (trained_in_4bit or is_4bit(model)):
        info.update(qlora_note(kind))
    (out / "lockstep.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


def hf_flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token: 4 x N + 2 x N_trainable, attention scores left out.

    Each weight does a multiply-add (2 FLOPs) per token forward; backward computes the activation
    gradient through every weight, frozen or not (another 2N), and the weight gradient only for
    trainable ones (2 per trainable weight). Full fine-tuning: 6N. LoRA: ~4N, the adapters being tiny.
    An untied input embedding is a lookup, not a matmul, so it is not counted.
    """
    # a 4-bit weight is dequantized and multiplied as a full one
    total = sum(logical_numel(p) for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    try:
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        emb = head = None
    if emb is not None and (head is None or head.weight is not emb.weight):
        total -= emb.weight.numel()
        if emb.weight.requires_grad:
            trainable -= emb.weight.numel()
    return float(4 * total + 2 * trainable)
