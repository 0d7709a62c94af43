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
from pathlib import Path
from typing import Callable, Sequence

import torch

from lockstep.checkpoint.manifest import MANIFEST, is_extra
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import Config, config_to_dict
from lockstep.errors import ConfigError
from lockstep.tools.export import load_verified_checkpoint, resolve_checkpoint
from lockstep.tools.merge_checks import MergeInput, check_inputs, check_tensors, read_input


def _sharded_module():
    """lockstep.checkpoint.sharded_load, or None where it does not exist (every checkpoint is then plain)."""
    try:
        import lockstep.checkpoint.sharded_load as sharded
    except ModuleNotFoundError as e:
        if e.name != "lockstep.checkpoint.sharded_load":
            raise
        return None
    return sharded


def load_model_tensors(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) tensors of a checkpoint dir, plain or sharded (FSDP), on the CPU."""
    sharded = _sharded_module()
    if sharded is not None and sharded.is_sharded(ckpt_dir):
        return sharded.load_full_model_tensors(ckpt_dir)
    return load_verified_checkpoint(Path(ckpt_dir)).tensors


def merge_checkpoints(
    paths: Sequence[str | Path],
    out: str | Path,
    weights: Sequence[float] | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Average checkpoints (or run dirs: their newest good checkpoint) into the run dir OUT; return OUT.

    weights: one per checkpoint, finite, >= 0, not all 0; normalized to sum 1 (None = equal weights).
    """
    if len(paths) < 2:
        raise ConfigError(f"merge needs 2 or more checkpoints, got {len(paths)}; pass A B [C ...]")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"output {out} already exists and is not an empty directory; pass a new directory with -o"
        )
    weights = _normalize_weights(weights, [str(p) for p in paths], log)
    inputs = [read_input(resolve_checkpoint(p, log)) for p in paths]
    check_inputs(inputs, log)
    first = inputs[0]
    lora = first.cfg.model.kind == "hf" and first.cfg.model.use_lora
    log(
        f"averaging {len(inputs)} checkpoints"
        + (" (LoRA: each merged into its base model first)" if lora else "")
        + "".join(f"\n  {w:.6g} x {inp.path} (step {inp.step})" for inp, w in zip(inputs, weights))
    )
    tensors, full_model = _average(inputs, weights, lora)

    cfg = dataclasses.replace(
        first.cfg,
        model=dataclasses.replace(first.cfg.model, use_lora=False),
        checkpoint=dataclasses.replace(first.cfg.checkpoint, output_dir=str(out)),
    )
    state = {
        "config": config_to_dict(cfg),
        "step": max(inp.step for inp in inputs),
        "merged_from": [str(inp.path) for inp in inputs],
        "merge_weights": weights,
    }
    extra = _extra_files(first.path)
    if cfg.model.kind == "hf":
        _save_final(out, cfg, tensors, full_model)
        log(f"wrote {out / 'final'} (from_pretrained directory)")
    ckpt = save_checkpoint(out, state["step"], tensors, None, None, state, extra=extra)
    log(f"wrote {ckpt}")
    return out


def _normalize_weights(
    weights: Sequence[float] | None, paths: list[str], log: Callable[[str], None]
) -> list[float]:
    n = len(paths)
    if weights is None:
        return [1.0 / n] * n
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise ConfigError(
            f"--weights has {len(weights)} values for {n} checkpoints; give one weight per "
            f"checkpoint, in order (e.g. --weights {','.join(['1'] * n)})"
        )
    for w, path in zip(weights, paths):
        if not math.isfinite(w) or w < 0:
            raise ConfigError(
                f"--weights value {w} for {path} is {'negative' if w < 0 else 'not finite'}; "
                "weights must be finite numbers >= 0"
            )
    total = math.fsum(weights)
    if total <= 0:
        raise ConfigError(
            f"--weights {','.join(f'{w:g}' for w in weights)} sum to 0; make at least one > 0"
        )
    normalized = [w / total for w in weights]
    if total != 1.0:
        log(
            f"--weights {','.join(f'{w:g}' for w in weights)} sum to {total:g}; normalized to sum 1: "
            + ",".join(f"{w:.6g}" for w in normalized)
        )
    return normalized


def _full_tensors(
    inp: MergeInput, lora: bool
) -> tuple[dict[str, torch.Tensor], torch.nn.Module | None]:
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


def _average(
    inputs: list[MergeInput], weights: list[float], lora: bool
) -> tuple[dict[str, torch.Tensor], torch.nn.Module | None]:
    """sum_i w_i x_i in float64, one input in memory at a time; checks each input against the first."""
    ref: dict[
        str, torch.Tensor
    ] = {}  # the first input's tensors: integer ones kept, float ones as meta
    acc: dict[str, torch.Tensor] = {}
    model = None
    for i, (inp, w) in enumerate(zip(inputs, weights)):
        tensors, model = _full_tensors(inp, lora)
        if i == 0:
            ref = {
                k: t
                if not t.is_floating_point()
                else torch.empty(t.shape, dtype=t.dtype, device="meta")
                for k, t in tensors.items()
            }
        else:
            check_tensors(inputs[0], ref, inp, tensors)
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
    # verified when its tensors were loaded
    listed = json.loads((ckpt_dir / MANIFEST).read_text())["files"]
    # neither lockstep's own files nor a sharded checkpoint's (DCP's .metadata and __<rank>_0.distcp)
    return {name: (ckpt_dir / name).read_bytes() for name in sorted(listed) if is_extra(name)}


def _save_final(
    out: Path, cfg: Config, tensors: dict[str, torch.Tensor], model: torch.nn.Module | None
) -> None:
    """OUT/final: the averaged full model as from_pretrained loads it, with the base model's processor."""
    from lockstep.models.hf import (
        build_hf_model,
        load_hf_processor,
        load_trainable_state_dict,
        save_hf_model,
    )
    from lockstep.models.quantize import full_precision_config

    if model is None:  # no LoRA: nothing was built while averaging
        model = build_hf_model(full_precision_config(cfg.model))
    load_trainable_state_dict(model, tensors)
    tmp = out / f".tmp-final-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_model(model, tmp, load_hf_processor(cfg.model))
    os.replace(tmp, out / "final")
