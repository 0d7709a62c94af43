"""Plain checkpoints: global rank 0 alone writes every tensor to one safetensors file, and reads it back.

For layouts where rank 0 holds all the weights (one process, DDP). Saving goes through the commit
protocol (lockstep.checkpoint.commit); loading verifies first (lockstep.checkpoint.verify). Nothing is
unpickled with code execution: safetensors, and torch.load(weights_only=True). A checkpoint of either
kind is opened with lockstep.checkpoint.open.load_checkpoint.

Old formats: a format-1 checkpoint may hold tensors in a layout its model has changed since (the built-in
GPT's attn.qkv). The loaders take the model's `upgrade(tensors, state) -> tensors` and call it on format-1
checkpoints only; this library knows no model, so the caller that does passes it
(lockstep.models.gpt.upgrade_format_1 for the built-in GPT).

File I/O in one checkpoint dir only; no process group.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from lockstep.checkpoint.commit import (
    check_save_args,
    explain_write_errors,
    fsync_path,
    move_latest,
    seal,
    start_save,
    write_file,
    write_meta_files,
)
from lockstep.checkpoint.manifest import (
    COMPRESSION,
    MANIFEST,
    MODEL,
    OPTIMIZER,
    RNG,
    STATE,
    is_extra,
    is_sharded,
)
from lockstep.checkpoint.verify import RESUME_FIX, checkpoint_problems, refusal_reason
from lockstep.errors import CheckpointError

# (model tensors of a format-1 checkpoint, its state.json) -> the tensors as the model now lays them out
Upgrade = Callable[[dict[str, torch.Tensor], dict], dict[str, torch.Tensor]]


@dataclass
class Checkpoint:
    path: Path
    tensors: dict[str, torch.Tensor]
    optimizer_state: dict | None
    rng_states: list | None  # one entry per rank, as gathered by the trainer
    state: dict  # state.json: step, data cursor, scheduler, config, world size, ...
    extra: dict[str, bytes]  # extra files by name (e.g. tokenizer.json)
    # grad_compression.pt: the compression hook's state (lockstep.parallel.compression)
    compression: dict | None = None


# ---- saving -----------------------------------------------------------------------------------------


def save_checkpoint(
    run_dir,
    step: int,
    tensors: dict[str, torch.Tensor],
    optimizer_state: dict | None,
    rng_states: list | None,
    state: dict,
    extra: dict[str, bytes] | None = None,
    keep_last: int = 3,
    compression: dict | None = None,
) -> Path:
    """Commit a checkpoint for `step` under RUN_DIR/checkpoints and return its path. Rank 0 only."""
    # fail before touching the disk
    state_json, extra = check_save_args(step, keep_last, state, extra)
    tensors = _prepare_tensors(tensors)
    with explain_write_errors(run_dir, step):
        tmp, final = start_save(run_dir, step)
        try:
            save_file(tensors, tmp / MODEL, metadata={"format": "pt"})
            fsync_path(tmp / MODEL)
            if optimizer_state is not None:
                write_file(tmp / OPTIMIZER, lambda f: torch.save(optimizer_state, f))
            write_meta_files(tmp, rng_states, state_json, extra, compression)
            seal(tmp, final, step)
        except BaseException:
            # a real crash leaves it; the next save removes it
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        move_latest(final, keep_last)
    return final


def _prepare_tensors(tensors: dict) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing storage (tied weights): clone the second and later
    # holders of a storage; the model's load_state_dict re-ties them on load.
    out, seen = {}, set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(
                f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor; "
                "pass the unwrapped model's state_dict() with full (not sharded) tensors"
            )
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        out[name] = t.clone() if key in seen and t.numel() else t
        seen.add(key)
    return out


# ---- loading ----------------------------------------------------------------------------------------


def load_plain_checkpoint(path, map_location="cpu", upgrade: Upgrade | None = None) -> Checkpoint:
    """Verify, then load a plain checkpoint dir. Raises CheckpointError if it is damaged or sharded."""
    path = Path(path)
    problems = checkpoint_problems(path)  # a sharded one's DCP files need DCP: refused below
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(problems)}); {RESUME_FIX}")
    if is_sharded(path):
        raise CheckpointError(
            f"checkpoint {path} is sharded (written by every rank); open it with "
            "lockstep.checkpoint.open.load_checkpoint, or load it into a model with "
            "lockstep.checkpoint.sharded_load.load_sharded_checkpoint"
        )
    return read_checkpoint(
        path, load_file(path / MODEL, device=tensor_device(map_location)), map_location, upgrade
    )


def read_checkpoint(
    path: Path, tensors: dict[str, torch.Tensor], map_location="cpu", upgrade: Upgrade | None = None
) -> Checkpoint:
    """A verified checkpoint dir of either kind around its model tensors (read by the caller): the optimizer
    state, RNG states, state.json and extra files; a format-1 checkpoint's tensors upgraded."""
    manifest = json.loads((path / MANIFEST).read_text())
    files = manifest["files"]
    state = json.loads((path / STATE).read_text())
    if manifest.get("format") == 1:
        # loading the old layout as if it were the new one would go wrong silently
        if upgrade is None:
            raise CheckpointError(
                f"checkpoint {path} has format 1, whose tensors may be in a layout its model "
                "has changed since; load it with upgrade= the model's conversion "
                "(lockstep.models.gpt.upgrade_format_1 for the built-in GPT)"
            )
        tensors = upgrade(tensors, state)
    return Checkpoint(
        path=path,
        tensors=tensors,
        optimizer_state=load_pickled_weights_only(path / OPTIMIZER, map_location)
        if OPTIMIZER in files
        else None,
        rng_states=load_pickled_weights_only(path / RNG, "cpu")
        if RNG in files
        else None,  # RNG states live on CPU
        state=state,
        extra={name: (path / name).read_bytes() for name in sorted(files) if is_extra(name)},
        compression=load_pickled_weights_only(path / COMPRESSION, map_location)
        if COMPRESSION in files
        else None,
    )


def tensor_device(map_location) -> int | str:
    """The device argument that safetensors takes, for torch.load's map_location."""
    return map_location if isinstance(map_location, int) else str(torch.device(map_location))


def load_pickled_weights_only(file: Path, map_location):
    """torch.load(weights_only=True), with a CheckpointError that says why anything else is refused."""
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{file} holds objects outside torch's weights_only allowlist "
            f"({refusal_reason(e)}); refusing to unpickle them, since that could "
            "run code. Save only tensors and plain Python values, or use another checkpoint"
        ) from e
    except (OSError, RuntimeError, EOFError, ValueError) as e:  # truncated, not torch.save's format
        raise CheckpointError(
            f"{file} cannot be read by torch.load ({refusal_reason(e)}): it "
            "is damaged (an interrupted save or copy?); use another checkpoint"
        ) from e


def check_shapes(ckpt_tensors: dict, model_state: dict, ckpt_path) -> None:
    """Raise CheckpointError if the checkpoint's tensors (or shapes) do not fit the model's state dict."""
    ckpt = {
        k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v)
        for k, v in ckpt_tensors.items()
    }
    model = {k: tuple(v.shape) for k, v in model_state.items() if hasattr(v, "shape")}
    missing = [k for k in model if k not in ckpt]
    unexpected = [k for k in ckpt if k not in model]
    mismatch = next((k for k in model if k in ckpt and ckpt[k] != model[k]), None)
    if not (missing or unexpected or mismatch):
        return
    lines = (
        [
            f"checkpoint {ckpt_path} was saved with {mismatch} of shape {ckpt[mismatch]} "
            f"but the model built from the config has {model[mismatch]}"
        ]
        if mismatch
        else []
    )
    for what, keys in (
        ("lacks tensors the model has", missing),
        ("has tensors the model lacks", unexpected),
    ):
        if keys:  # a different architecture can differ in hundreds of names: show a few
            more = f", ... ({len(keys)} in all)" if len(keys) > 5 else ""
            lines.append(f"checkpoint {ckpt_path} {what}: {', '.join(keys[:5])}{more}")
    raise CheckpointError(
        "\n".join(lines) + "\nresume with the checkpoint's model settings (see its state.json "
        "'config'), or start fresh with --resume none / another --output-dir"
    )
