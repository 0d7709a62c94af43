"""What `lockstep merge` checks before it averages anything (lockstep.tools.merge): the inputs are copies of
one model (the same kind and model settings, the same tokenizer, the same Hugging Face base), and their
tensors have the same names, shapes and dtypes. Each refusal names the setting or tensor that differs,
in which inputs, and what would make them mergeable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lockstep.checkpoint.manifest import STATE
from lockstep.config import Config, config_from_dict
from lockstep.errors import CheckpointError, ConfigError

TOKENIZER = "tokenizer.json"  # the GPT's BPE tokenizer; absent = the byte tokenizer
# model.* fields that change what the tensors mean, per kind (training-only ones such as dropout are not here)
_GPT_FIELDS = ("vocab_size", "hidden_size", "attention_heads", "layers", "max_seq_length")
_FIX = "merge only copies of one model trained with the same model settings"
# the GPT setting that sizes each dimension of these tensors; every other GPT tensor is sized by hidden_size
# (model.layers changes tensor names, model.attention_heads no shape)
_GPT_DIMS = {
    "tok_emb.weight": ("vocab_size", "hidden_size"),
    "head.weight": ("vocab_size", "hidden_size"),
    "pos_emb.weight": ("max_seq_length", "hidden_size"),
}


@dataclass
class MergeInput:
    path: Path  # the checkpoint directory
    cfg: Config  # from its state.json
    step: int
    tokenizer: bytes | None  # its tokenizer.json


def read_input(ckpt_dir: Path) -> MergeInput:
    """What the checks need before any tensor is read: the config, step and tokenizer."""
    try:
        state = json.loads((ckpt_dir / STATE).read_text())
        tree = state["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{ckpt_dir} has no readable {STATE} with a 'config' ({type(e).__name__}: {e}); "
            "pass a checkpoint written by lockstep train (see `lockstep verify`)"
        ) from None
    tokenizer = (ckpt_dir / TOKENIZER).read_bytes() if (ckpt_dir / TOKENIZER).is_file() else None
    cfg = config_from_dict(tree, source=str(ckpt_dir / STATE))
    return MergeInput(Path(os.path.abspath(ckpt_dir)), cfg, int(state.get("step", 0)), tokenizer)


def _arch_fields(kind: str) -> tuple[str, ...]:
    match kind:
        case "gpt":
            return _GPT_FIELDS
        case "hf":
            return ("task", "use_lora", "dtype")  # model.path: compared by _check_hf_base
        case "custom":
            return ("factory",)
        case _:
            raise ConfigError(
                f"model.kind {kind!r} is not one lockstep knows; pick one of 'gpt', 'hf', 'custom'"
            )


def _config_difference(a: MergeInput, b: MergeInput, fields: tuple[str, ...]) -> str | None:
    for name in fields:
        va, vb = getattr(a.cfg.model, name), getattr(b.cfg.model, name)
        if va != vb:
            return f"model.{name} is {va!r} in {a.path} but {vb!r} in {b.path}"
    return None


def _shape_reason(
    key: str, shape_a: tuple[int, ...], shape_b: tuple[int, ...], a: MergeInput, b: MergeInput
) -> str:
    """Which model setting explains that tensor `key` has another shape in b than in a."""
    if a.cfg.model.kind != "gpt":
        arch = _config_difference(a, b, _arch_fields(a.cfg.model.kind))
        return f"different models ({arch})" if arch else "different models"
    dims = _GPT_DIMS.get(key, ("hidden_size",) * len(shape_a))
    names = (
        []
        if len(shape_a) != len(shape_b)
        else list(dict.fromkeys(name for name, da, db in zip(dims, shape_a, shape_b) if da != db))
    )
    reasons = []
    for name in names:
        va, vb = getattr(a.cfg.model, name), getattr(b.cfg.model, name)
        if va == vb:
            continue  # the config does not explain it (state.json edited by hand?): say only what does
        if name == "vocab_size":
            reasons.append(
                f"the vocabularies differ (model.vocab_size {va} in {a.path}, {vb} in {b.path})"
            )
        else:
            reasons.append(f"model.{name} is {va} in {a.path} but {vb} in {b.path}")
    return (
        " and ".join(reasons)
        or "different models, though their model settings (state.json) do not explain it"
    )


def check_inputs(inputs: list[MergeInput], log: Callable[[str], None]) -> None:
    """The cheap checks, from state.json and tokenizer.json alone."""
    first = inputs[0]
    for other in inputs[1:]:
        if diff := _config_difference(first, other, ("kind",)):
            raise CheckpointError(f"{diff}: different kinds of model cannot be averaged; {_FIX}")
        # the GPT's settings are compared with its tensors, so a different depth or vocabulary is named by tensor
        if first.cfg.model.kind != "gpt" and (
            diff := _config_difference(first, other, _arch_fields(other.cfg.model.kind))
        ):
            raise CheckpointError(f"{diff}; {_FIX}")
        if other.tokenizer != first.tokenizer:

            def what(i: MergeInput) -> str:
                return (
                    f"a BPE tokenizer ({TOKENIZER}, {len(i.tokenizer)} bytes)"
                    if i.tokenizer
                    else f"the byte tokenizer (no {TOKENIZER})"
                )

            raise CheckpointError(
                f"{other.path} was trained with {what(other)} but {first.path} with {what(first)}: the same token id "
                "means different text in each, so their embeddings cannot be averaged; train every copy with "
                "data.tokenizer = byte (a BPE tokenizer is trained per corpus, so each part gets its own)"
            )
    match first.cfg.model.kind:
        case "hf":
            _check_hf_base(inputs, log)
        case "gpt":
            seeds = sorted({i.cfg.train.seed for i in inputs})
            if len(seeds) > 1:
                log(
                    f"warning: the inputs were initialized with different train.seed values {seeds}; averaging "
                    "copies trained from different random inits usually gives a bad model: train them with one seed"
                )


def _check_hf_base(inputs: list[MergeInput], log: Callable[[str], None]) -> None:
    from lockstep.models.hf import resolve_hf_path

    first = inputs[0]
    base = resolve_hf_path(first.cfg.model.path)[0]
    for other in inputs[1:]:
        path = resolve_hf_path(other.cfg.model.path)[0]
        if path == base:
            continue
        a, b = (json.loads((Path(p) / "config.json").read_text()) for p in (base, path))
        key = next(
            (
                k
                for k in [*a, *b]
                if k not in ("_name_or_path", "transformers_version") and a.get(k) != b.get(k)
            ),
            None,
        )
        if key is not None:
            raise CheckpointError(
                f"{other.path} was fine-tuned from {path}, {first.path} from {base}, and their "
                f"config.json differ first at {key!r} ({a.get(key)!r} vs {b.get(key)!r}): copies of "
                f"different base models cannot be averaged; {_FIX}"
            )
        log(
            f"note: {other.path} names base model {path}, {first.path} names {base}; their config.json agree, so "
            "they are taken to hold the same weights"
        )


def check_tensors(
    first: MergeInput,
    ref: dict[str, torch.Tensor],
    other: MergeInput,
    tensors: dict[str, torch.Tensor],
) -> None:
    names = [*ref, *(k for k in tensors if k not in ref)]  # safetensors order: sorted by name
    # the embedding first: (vocab, hidden) shows either difference (head is tied)
    if first.cfg.model.kind == "gpt":
        names.sort(key=lambda k: k != "tok_emb.weight")
    arch = _config_difference(first, other, _arch_fields(first.cfg.model.kind))
    for key in names:
        if key not in ref or key not in tensors:
            has, lacks = (first, other) if key in ref else (other, first)
            n = len(set(ref) ^ set(tensors))
            raise CheckpointError(
                f"tensor {key} is in {has.path} but not in {lacks.path} ({n} tensor name(s) differ"
                f"{'; ' + arch if arch else ''}): the checkpoints hold different models; {_FIX}"
            )
        a, b = ref[key], tensors[key]
        if a.shape != b.shape:
            why = _shape_reason(key, tuple(a.shape), tuple(b.shape), first, other)
            raise CheckpointError(
                f"tensor {key} has shape {tuple(a.shape)} in {first.path} but {tuple(b.shape)} in "
                f"{other.path}: {why}; {_FIX}"
            )
        if a.dtype != b.dtype:
            raise CheckpointError(
                f"tensor {key} is {a.dtype} in {first.path} but {b.dtype} in {other.path}; merge "
                "checkpoints saved in one dtype (model.dtype), or cast one copy and save it again"
            )
        if not a.is_floating_point() and not torch.equal(a, b):
            raise CheckpointError(
                f"tensor {key} ({a.dtype}) differs between {first.path} and {other.path}; integer "
                "and bool tensors (counters, indices, masks) cannot be averaged, so they must be "
                "equal in every input"
            )
    if arch:  # a setting that changes no shape, e.g. model.attention_heads
        raise CheckpointError(f"{arch}: the tensors fit but mean different things; {_FIX}")
