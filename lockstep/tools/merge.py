"""Average the weights of N checkpoints of one model: `lockstep merge A B [C ...] -o OUT`.

The other half of `lockstep split`: copies of one model trained from the same starting point on
different parts of the data, then averaged (a "model soup"). Averaging only makes sense for copies
that share a start: the same pretrained model, or for the GPT the same train.seed (its init).

OUT is a run directory, so `lockstep sample OUT` and `lockstep export OUT -o DIR` work on it:

    OUT/checkpoints/step_N/   a committed lockstep checkpoint: the averaged tensors, state.json with the
                              first input's config, step = the inputs' largest, "merged_from" and
                              "merge_weights"; the first input's extra files (tokenizer.json). No optimizer
                              and no RNG state: a merge is a new starting point, not a run to resume.
    OUT/final/                hf models only: a from_pretrained directory (full weights + processor),
                              as the trainer writes at RUN/final.

Hugging Face LoRA checkpoints hold adapters only, and averaging the A and B matrices separately is
wrong: mean(B_i A_i) != mean(B_i) mean(A_i). So each input is built (base model from model.path plus
its adapters), merged into full weights (merge_and_unload), and those full weights are averaged. The
output is then a full model: OUT/final loads with from_pretrained alone, and the checkpoint's config
says use_lora = false. The inputs may differ in LoRA rank, alpha and target modules.

Tensors are averaged in float64 and cast back to their dtype; integer and bool tensors must be equal
in every input. Any mismatch (tensor names, shapes, dtypes, tokenizer, model settings) is refused
before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from lockstep.checkpoint.manifest import MANIFEST, STATE, is_extra
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.errors import CheckpointError
from lockstep.config import Config, config_from_dict, config_to_dict
from lockstep.errors import ConfigError
from lockstep.tools.export import load_verified_checkpoint, resolve_checkpoint

TOKENIZER = "tokenizer.json"  # the GPT's BPE tokenizer; absent = the byte tokenizer
# model.* fields that change what the tensors mean, per kind (training-only ones such as dropout are not here)
_GPT_FIELDS = ("vocab_size", "hidden_size", "attention_heads", "layers", "max_seq_length")
_FIX = "merge only copies of one model trained with the same model settings"
# the GPT setting that sizes each dimension of these tensors; every other GPT tensor is sized by hidden_size
# (model.layers changes tensor names, model.attention_heads no shape)
_GPT_DIMS = {"tok_emb.weight": ("vocab_size", "hidden_size"), "head.weight": ("vocab_size", "hidden_size"),
             "pos_emb.weight": ("max_seq_length", "hidden_size")}


@dataclass
class _Input:
    path: Path  # the checkpoint directory
    cfg: Config  # from its state.json
    step: int
    tokenizer: bytes | None  # its tokenizer.json


def _sharded_module():
    """lockstep.checkpoint.sharded, or None where it does not exist (every checkpoint is then plain)."""
    try:
        import lockstep.checkpoint.sharded as sharded
    except ModuleNotFoundError as e:
        if e.name != "lockstep.checkpoint.sharded":
            raise
        return None
    return sharded


def load_model_tensors(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) tensors of a checkpoint dir, plain or sharded (FSDP), on the CPU."""
    sharded = _sharded_module()
    if sharded is not None and sharded.is_sharded(ckpt_dir):
        return sharded.load_full_model_tensors(ckpt_dir)
    return load_verified_checkpoint(Path(ckpt_dir)).tensors


def merge_checkpoints(paths: Sequence[str | Path], out: str | Path, weights: Sequence[float] | None = None,
                      log: Callable[[str], None] = print) -> Path:
    """Average checkpoints (or run dirs: their newest good checkpoint) into the run dir OUT; return OUT.

    weights: one per checkpoint, finite, >= 0, not all 0; normalized to sum 1 (None = equal weights).
    """
    if len(paths) < 2:
        raise ConfigError(f"merge needs 2 or more checkpoints, got {len(paths)}; pass A B [C ...]")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {out} already exists and is not an empty directory; pass a new directory with -o")
    weights = _normalize_weights(weights, [str(p) for p in paths], log)
    inputs = [_read_input(resolve_checkpoint(p, log)) for p in paths]
    _check_inputs(inputs, log)
    first = inputs[0]
    lora = first.cfg.model.kind == "hf" and first.cfg.model.use_lora
    log(f"averaging {len(inputs)} checkpoints" + (" (LoRA: each merged into its base model first)" if lora else "")
        + "".join(f"\n  {w:.6g} x {inp.path} (step {inp.step})" for inp, w in zip(inputs, weights)))
    tensors, full_model = _average(inputs, weights, lora)

    cfg = dataclasses.replace(first.cfg, model=dataclasses.replace(first.cfg.model, use_lora=False),
                              checkpoint=dataclasses.replace(first.cfg.checkpoint, output_dir=str(out)))
    state = {"config": config_to_dict(cfg), "step": max(inp.step for inp in inputs),
             "merged_from": [str(inp.path) for inp in inputs], "merge_weights": weights}
    extra = _extra_files(first.path)
    if cfg.model.kind == "hf":
        _save_final(out, cfg, tensors, full_model)
        log(f"wrote {out / 'final'} (from_pretrained directory)")
    ckpt = save_checkpoint(out, state["step"], tensors, None, None, state, extra=extra)
    log(f"wrote {ckpt}")
    return out


def _normalize_weights(weights: Sequence[float] | None, paths: list[str], log: Callable[[str], None]) -> list[float]:
    n = len(paths)
    if weights is None:
        return [1.0 / n] * n
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise ConfigError(f"--weights has {len(weights)} values for {n} checkpoints; give one weight per "
                          f"checkpoint, in order (e.g. --weights {','.join(['1'] * n)})")
    for w, path in zip(weights, paths):
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"--weights value {w} for {path} is {'negative' if w < 0 else 'not finite'}; "
                              "weights must be finite numbers >= 0")
    total = math.fsum(weights)
    if total <= 0:
        raise ConfigError(f"--weights {','.join(f'{w:g}' for w in weights)} sum to 0; make at least one > 0")
    normalized = [w / total for w in weights]
    if total != 1.0:
        log(f"--weights {','.join(f'{w:g}' for w in weights)} sum to {total:g}; normalized to sum 1: "
            + ",".join(f"{w:.6g}" for w in normalized))
    return normalized


def _read_input(ckpt_dir: Path) -> _Input:
    """What the checks need before any tensor is read: the config, step and tokenizer."""
    try:
        state = json.loads((ckpt_dir / STATE).read_text())
        tree = state["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt_dir} has no readable {STATE} with a 'config' ({type(e).__name__}: {e}); "
                              "pass a checkpoint written by lockstep train (see `lockstep verify`)") from None
    tokenizer = (ckpt_dir / TOKENIZER).read_bytes() if (ckpt_dir / TOKENIZER).is_file() else None
    cfg = config_from_dict(tree, source=str(ckpt_dir / STATE))
    return _Input(Path(os.path.abspath(ckpt_dir)), cfg, int(state.get("step", 0)), tokenizer)


def _arch_fields(kind: str) -> tuple[str, ...]:
    match kind:
        case "gpt":
            return _GPT_FIELDS
        case "hf":
            return ("task", "use_lora", "dtype")  # model.path: compared by _check_hf_base
        case "custom":
            return ("factory",)
        case _:
            raise ConfigError(f"model.kind {kind!r} is not one lockstep knows; pick one of 'gpt', 'hf', 'custom'")


def _config_difference(a: _Input, b: _Input, fields: tuple[str, ...]) -> str | None:
    for name in fields:
        va, vb = getattr(a.cfg.model, name), getattr(b.cfg.model, name)
        if va != vb:
            return f"model.{name} is {va!r} in {a.path} but {vb!r} in {b.path}"
    return None


def _shape_reason(key: str, shape_a: tuple[int, ...], shape_b: tuple[int, ...], a: _Input, b: _Input) -> str:
    """Which model setting explains that tensor `key` has another shape in b than in a."""
    if a.cfg.model.kind != "gpt":
        arch = _config_difference(a, b, _arch_fields(a.cfg.model.kind))
        return f"different models ({arch})" if arch else "different models"
    dims = _GPT_DIMS.get(key, ("hidden_size",) * len(shape_a))
    names = [] if len(shape_a) != len(shape_b) else \
        list(dict.fromkeys(name for name, da, db in zip(dims, shape_a, shape_b) if da != db))
    reasons = []
    for name in names:
        va, vb = getattr(a.cfg.model, name), getattr(b.cfg.model, name)
        if va == vb:
            continue  # the config does not explain it (state.json edited by hand?): say only what does
        if name == "vocab_size":
            reasons.append(f"the vocabularies differ (model.vocab_size {va} in {a.path}, {vb} in {b.path})")
        else:
            reasons.append(f"model.{name} is {va} in {a.path} but {vb} in {b.path}")
    return " and ".join(reasons) or "different models, though their model settings (state.json) do not explain it"


def _check_inputs(inputs: list[_Input], log: Callable[[str], None]) -> None:
    """The cheap checks, from state.json and tokenizer.json alone."""
    first = inputs[0]
    for other in inputs[1:]:
        if diff := _config_difference(first, other, ("kind",)):
            raise CheckpointError(f"{diff}: different kinds of model cannot be averaged; {_FIX}")
        # the GPT's settings are compared with its tensors, so a different depth or vocabulary is named by tensor
        if first.cfg.model.kind != "gpt" and (diff := _config_difference(first, other, _arch_fields(other.cfg.model.kind))):
            raise CheckpointError(f"{diff}; {_FIX}")
        if other.tokenizer != first.tokenizer:
            def what(i: _Input) -> str:
                return f"a BPE tokenizer ({TOKENIZER}, {len(i.tokenizer)} bytes)" if i.tokenizer else \
                    f"the byte tokenizer (no {TOKENIZER})"
            raise CheckpointError(
                f"{other.path} was trained with {what(other)} but {first.path} with {what(first)}: the same token id "
                "means different text in each, so their embeddings cannot be averaged; train every copy with "
                "data.tokenizer = byte (a BPE tokenizer is trained per corpus, so each part gets its own)")
    match first.cfg.model.kind:
        case "hf":
            _check_hf_base(inputs, log)
        case "gpt":
            seeds = sorted({i.cfg.train.seed for i in inputs})
            if len(seeds) > 1:
                log(f"warning: the inputs were initialized with different train.seed values {seeds}; averaging "
                    "copies trained from different random inits usually gives a bad model: train them with one seed")


def _check_hf_base(inputs: list[_Input], log: Callable[[str], None]) -> None:
    from lockstep.models.hf import resolve_hf_path

    first = inputs[0]
    base = resolve_hf_path(first.cfg.model.path)[0]
    for other in inputs[1:]:
        path = resolve_hf_path(other.cfg.model.path)[0]
        if path == base:
            continue
        a, b = (json.loads((Path(p) / "config.json").read_text()) for p in (base, path))
        key = next((k for k in [*a, *b] if k not in ("_name_or_path", "transformers_version") and a.get(k) != b.get(k)),
                   None)
        if key is not None:
            raise CheckpointError(f"{other.path} was fine-tuned from {path}, {first.path} from {base}, and their "
                                  f"config.json differ first at {key!r} ({a.get(key)!r} vs {b.get(key)!r}): copies of "
                                  f"different base models cannot be averaged; {_FIX}")
        log(f"note: {other.path} names base model {path}, {first.path} names {base}; their config.json agree, so "
            "they are taken to hold the same weights")


def _full_tensors(inp: _Input, lora: bool) -> tuple[dict[str, torch.Tensor], torch.nn.Module | None]:
    """The input's full model tensors; for LoRA, its adapters merged into its base model (returned too)."""
    tensors = load_model_tensors(inp.path)
    if not lora:
        return tensors, None
    from lockstep.models.hf import build_hf_model, load_trainable_state_dict
    from lockstep.models.quantize import full_precision_config

    model = build_hf_model(full_precision_config(inp.cfg.model))  # QLoRA: merged into the full base
    load_trainable_state_dict(model, tensors)
    full = model.merge_and_unload()
    return full.state_dict(), full


def _check_tensors(first: _Input, ref: dict[str, torch.Tensor], other: _Input, tensors: dict[str, torch.Tensor]) -> None:
    names = [*ref, *(k for k in tensors if k not in ref)]  # safetensors order: sorted by name
    if first.cfg.model.kind == "gpt":  # the embedding first: (vocab, hidden) shows either difference (head is tied)
        names.sort(key=lambda k: k != "tok_emb.weight")
    arch = _config_difference(first, other, _arch_fields(first.cfg.model.kind))
    for key in names:
        if key not in ref or key not in tensors:
            has, lacks = (first, other) if key in ref else (other, first)
            n = len(set(ref) ^ set(tensors))
            raise CheckpointError(f"tensor {key} is in {has.path} but not in {lacks.path} ({n} tensor name(s) differ"
                                  f"{'; ' + arch if arch else ''}): the checkpoints hold different models; {_FIX}")
        a, b = ref[key], tensors[key]
        if a.shape != b.shape:
            why = _shape_reason(key, tuple(a.shape), tuple(b.shape), first, other)
            raise CheckpointError(f"tensor {key} has shape {tuple(a.shape)} in {first.path} but {tuple(b.shape)} in "
                                  f"{other.path}: {why}; {_FIX}")
        if a.dtype != b.dtype:
            raise CheckpointError(f"tensor {key} is {a.dtype} in {first.path} but {b.dtype} in {other.path}; merge "
                                  "checkpoints saved in one dtype (model.dtype), or cast one copy and save it again")
        if not a.is_floating_point() and not torch.equal(a, b):
            raise CheckpointError(f"tensor {key} ({a.dtype}) differs between {first.path} and {other.path}; integer "
                                  "and bool tensors (counters, indices, masks) cannot be averaged, so they must be "
                                  "equal in every input")
    if arch:  # a setting that changes no shape, e.g. model.attention_heads
        raise CheckpointError(f"{arch}: the tensors fit but mean different things; {_FIX}")


def _average(inputs: list[_Input], weights: list[float], lora: bool
             ) -> tuple[dict[str, torch.Tensor], torch.nn.Module | None]:
    """sum_i w_i x_i in float64, one input in memory at a time; checks each input against the first."""
    ref: dict[str, torch.Tensor] = {}  # the first input's tensors: integer ones kept, float ones as meta
    acc: dict[str, torch.Tensor] = {}
    model = None
    for i, (inp, w) in enumerate(zip(inputs, weights)):
        tensors, model = _full_tensors(inp, lora)
        if i == 0:
            ref = {k: t if not t.is_floating_point() else torch.empty(t.shape, dtype=t.dtype, device="meta")
                   for k, t in tensors.items()}
        else:
            _check_tensors(inputs[0], ref, inp, tensors)
        for key, t in tensors.items():
            if not t.is_floating_point():
                continue
            if key in acc:
                acc[key].add_(t.to(torch.float64), alpha=w)
            else:
                acc[key] = t.to(torch.float64) * w
        del tensors
    return {k: acc[k].to(t.dtype) if t.is_floating_point() else t for k, t in ref.items()}, model


def _extra_files(ckpt_dir: Path) -> dict[str, bytes]:
    """The first input's extra files (tokenizer.json), so sample and export find them in OUT."""
    listed = json.loads((ckpt_dir / MANIFEST).read_text())["files"]  # verified when its tensors were loaded
    # neither lockstep's own files nor a sharded checkpoint's (DCP's .metadata and __<rank>_0.distcp)
    return {name: (ckpt_dir / name).read_bytes() for name in sorted(listed) if is_extra(name)}


def _save_final(out: Path, cfg: Config, tensors: dict[str, torch.Tensor], model: torch.nn.Module | None) -> None:
    """OUT/final: the averaged full model as from_pretrained loads it, with the base model's processor."""
    from lockstep.models.hf import build_hf_model, load_hf_processor, load_trainable_state_dict, save_hf_model
    from lockstep.models.quantize import full_precision_config

    if model is None:  # no LoRA: nothing was built while averaging
        model = build_hf_model(full_precision_config(cfg.model))
    load_trainable_state_dict(model, tensors)
    tmp = out / f".tmp-final-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_model(model, tmp, load_hf_processor(cfg.model))
    os.replace(tmp, out / "final")
