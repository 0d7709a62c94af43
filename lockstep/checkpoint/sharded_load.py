"""Sharded checkpoints loaded into any layout: DCP reshards (2 FSDP ranks -> 1 plain process -> 4 FSDP ranks),
and a plain checkpoint loads into a sharded model. Every rank calls load (collectives inside); DCP's files
are read through lockstep.checkpoint.dcp_files. Saving is lockstep.checkpoint.sharded's.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from lockstep.checkpoint.dcp_files import (
    FIX,
    SafeLoadPlanner,
    SafeReader,
    read_dcp_metadata,
    sharded_problems,
)
from lockstep.checkpoint.manifest import MODEL, RNG, STATE, is_sharded, read_manifest
from lockstep.checkpoint.plain import (
    Upgrade,
    check_shapes,
    load_pickled_weights_only,
    load_plain_checkpoint,
)
from lockstep.checkpoint.sharded import OPTIM
from lockstep.checkpoint.verify import checkpoint_problems
from lockstep.errors import CheckpointError


def load_sharded_checkpoint(
    ckpt_dir,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    partial: bool = False,
    upgrade: Upgrade | None = None,
) -> dict:
    """Load weights (and optimizer state) into `model` in whatever layout it has now; return state.json.

    Every rank of the current job calls it. Sharded checkpoints are resharded by DCP (saved on 2 FSDP
    ranks, loaded on 1 plain process or on 4 FSDP ranks). A plain (rank-0 safetensors) checkpoint also
    loads into an FSDP model, optimizer state included, so a run can switch ddp -> fsdp on resume:
    every rank reads the file (shared filesystem) and keeps its shard. The caller restores step,
    cursor and scheduler from the returned dict, and RNG with load_rng_states.

    partial: the model is one pipeline stage, so the checkpoint's tensors of other stages are not an
    error (the model's own must all be there, with their shapes).
    upgrade: the model's conversion of a format-1 plain checkpoint's tensors (see lockstep.checkpoint.plain).
    Sharded checkpoints are checked for missing or resized files here, not hashed on every rank:
    resolve_resume (rank 0) verifies the checksums before the trainer picks one.
    """
    path = Path(ckpt_dir)
    if not is_sharded(path):
        return _load_plain_into(path, model, optimizer, partial, upgrade)
    _check_files_present(path)
    meta = read_dcp_metadata(path)
    if optimizer is not None and not any(
        _path_of(meta, k)[0] == OPTIM for k in meta.state_dict_metadata
    ):
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state; load it with optimizer=None "
            "(weights only) or pick a checkpoint of a training run"
        )
    if optimizer is not None:
        # this layout's tensors: DCP reads into them
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = {**model_sd, OPTIM: optim_sd}
    else:
        model_sd = get_model_state_dict(model)
        target = dict(model_sd)
    saved = _model_shapes(meta)
    check_shapes(
        {k: v for k, v in saved.items() if k in model_sd} if partial else saved, model_sd, path
    )
    try:
        _load(target, path)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"cannot load the sharded checkpoint {path}: {type(e).__name__}: "
            f"{str(e).strip()[:2000]}; {FIX}"
        ) from e
    if optimizer is not None:
        set_state_dict(
            model,
            optimizer,
            model_state_dict={k: target[k] for k in model_sd},
            optim_state_dict=target[OPTIM],
        )
    else:
        set_model_state_dict(model, target)
    return json.loads((path / STATE).read_text())


def _load_plain_into(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    partial: bool,
    upgrade: Upgrade | None,
) -> dict:
    ckpt = load_plain_checkpoint(path, upgrade=upgrade)  # verifies the checksums
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    model_sd = get_model_state_dict(model)
    # a LoRA run's plain checkpoint holds the trainable tensors only: the frozen base comes from model.path
    expected = {k: v for k, v in model_sd.items() if k in ckpt.tensors or k not in frozen}
    check_shapes(
        {k: v for k, v in ckpt.tensors.items() if k in model_sd} if partial else ckpt.tensors,
        expected,
        path,
    )
    # each rank keeps its shard of the full tensors
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, ckpt.tensors, options=full)
    if optimizer is not None:
        if ckpt.optimizer_state is None:
            raise CheckpointError(
                f"checkpoint {path} holds no optimizer state; load it with optimizer=None "
                "(weights only) or pick a checkpoint of a training run"
            )
        set_optimizer_state_dict(
            model, optimizer, _by_fqn(ckpt.optimizer_state, model, optimizer, path), options=full
        )
    return ckpt.state


def _by_fqn(plain: dict, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict:
    """optimizer.state_dict() (parameters numbered in param_groups order) keyed by parameter FQN instead."""
    fqn_of = {id(p): name for name, p in model.named_parameters()}
    groups = optimizer.param_groups
    saved = [len(g["params"]) for g in plain["param_groups"]]
    if saved != [len(g["params"]) for g in groups]:
        raise CheckpointError(
            f"checkpoint {path} has optimizer groups of {saved} parameters, this optimizer "
            f"{[len(g['params']) for g in groups]}; resume with the model and optimizer settings "
            "it was written with"
        )
    fqns = [fqn_of[id(p)] for g in groups for p in g["params"]]
    return {
        "state": {fqns[i]: s for i, s in plain["state"].items()},
        "param_groups": [
            {**g, "params": [fqns[i] for i in g["params"]]} for g in plain["param_groups"]
        ],
    }


def load_full_model_tensors(ckpt_dir) -> dict[str, torch.Tensor]:
    """The full, unsharded model tensors of a checkpoint (sharded or plain), keyed by FQN, on the CPU.

    One process, no process group (for `lockstep merge` / `export`). Verifies the checksums first.
    """
    path = Path(ckpt_dir)
    problems = checkpoint_problems(path, sharded_problems)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(problems)}); {FIX}")
    return read_full_model_tensors(path) if is_sharded(path) else load_file(path / MODEL)


def read_full_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """load_full_model_tensors of a sharded checkpoint without verifying it (the caller did)."""
    meta = read_dcp_metadata(path)
    tensors = {
        k: torch.empty(shape, dtype=meta.state_dict_metadata[k].properties.dtype)
        for k, shape in _model_shapes(meta).items()
    }
    _load(tensors, path, no_dist=True)
    return tensors


def _load(target: dict, path: Path, no_dist: bool = False) -> None:
    """dcp.load in place into `target`; one process without a process group is meant, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            target, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=no_dist
        )


def load_rng_states(ckpt_dir) -> list | None:
    """Every saved rank's RNG state (index = rank), or None when the checkpoint has none."""
    file = Path(ckpt_dir) / RNG
    return load_pickled_weights_only(file, "cpu") if file.is_file() else None


def _check_files_present(path: Path) -> None:
    manifest, problem = read_manifest(path)
    problems = [problem] if problem else []
    for name, entry in sorted(manifest["files"].items()) if manifest else []:
        file = path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
        elif file.stat().st_size != entry.get("bytes"):
            problems.append(
                f"{name}: {file.stat().st_size} bytes, manifest says {entry.get('bytes')}"
            )
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(problems)}); {FIX}")


def _path_of(meta, key: str) -> tuple:
    """The nested path a flattened key came from: ('blocks.0.attn.qkv.weight',) or ('optimizer', 'state', ...)."""
    return tuple((meta.planner_data or {}).get(key, (key,)))


def _model_shapes(meta) -> dict[str, tuple[int, ...]]:
    return {
        k: tuple(md.size)
        for k, md in meta.state_dict_metadata.items()
        if isinstance(md, dcp_metadata.TensorStorageMetadata)
        and len(_path_of(meta, k)) == 1
        and _path_of(meta, k)[0] != OPTIM
    }
