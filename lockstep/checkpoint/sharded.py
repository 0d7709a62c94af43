"""Sharded checkpoints: every rank writes its own shards (torch.distributed.checkpoint), one commit.

For layouts where no rank holds all the weights (FSDP, tensor or pipeline parallel). The commit
protocol is lockstep.checkpoint.commit's: a temporary dir, fsynced files, a manifest with the size and
sha256 of every file (every shard too), rename, `latest` moved atomically, keep-last pruning. The
manifest says "layout": "sharded". A step dir then holds

    .metadata  __0_0.distcp  __1_0.distcp ...   DCP's index and each rank's shards (model + optimizer)
    state.json  rng.pt  <extra files>  manifest.json   written by global rank 0 alone

Keys are the unwrapped model's FQNs (`blocks.0.attn.qkv.weight`), as in a plain checkpoint, so a
checkpoint loads into any layout: DCP reshards (2 FSDP ranks -> 1 plain process -> 4 FSDP ranks).
The optimizer state sits under `optimizer.` (FQN-keyed, get_state_dict's format).

Nothing is unpickled with code execution: DCP reads `.metadata` with plain pickle and its non-tensor
values with torch.load(weights_only=False); here the first goes through an allowlist and the second
through weights_only=True.

Every rank calls save and load (collectives inside); global rank 0 alone commits. Built on the common
modules (manifest, verify, commit, plain) and never imported by them; lockstep.checkpoint.open imports
it for sharded checkpoints only.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_optimizer_state_dict, set_state_dict,
)

from lockstep.checkpoint.commit import (
    check_save_args, explain_write_errors, move_latest, seal, start_save, write_meta_files,
)
from lockstep.checkpoint.manifest import (
    DCP_METADATA, MANIFEST, MODEL, RNG, SHARDED, STATE, file_entry, is_sharded, read_manifest,
)
from lockstep.checkpoint.plain import Upgrade, check_shapes, load_pickled_weights_only, load_plain_checkpoint
from lockstep.checkpoint.verify import checkpoint_problems, refusal_reason
from lockstep.collectives import gather_objects, run_on_main
from lockstep.errors import CheckpointError
from lockstep.runtime import Runtime

OPTIM = "optimizer"  # top-level key of the optimizer state; model FQNs sit beside it
_FIX = "see `lockstep verify RUN_DIR`; resume from another checkpoint with --resume PATH, or start fresh"


# ---- saving -----------------------------------------------------------------------------------------

def save_sharded_checkpoint(rt: Runtime, run_dir, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                            rng_states: list | None, state: dict, extra: dict[str, bytes] | None,
                            keep_last: int) -> Path:
    """Commit a sharded checkpoint of `step`; every rank calls it with its part of model and optimizer.

    Rank 0 makes the temporary dir and tells the others; every rank writes its shards there (shared filesystem) and
    hashes them; rank 0 writes state.json, rng.pt (rng_states: one entry per rank, gathered by the caller), the extra
    files and the manifest, and commits. Each phase ends with a collective that every rank reaches whatever happened
    in it: a failure anywhere raises CheckpointError on every rank, and the previous checkpoint is untouched.
    """
    save, to_save = begin_sharded_save(rt, run_dir, step, model, optimizer, rng_states, state, extra, keep_last)
    with warnings.catch_warnings():  # one process without a process group: meant, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return save.write_and_commit(rt, lambda: dcp.save(to_save, storage_writer=shard_writer(save.tmp),
                                                          process_group=rt.control_group))


# DCP's writer of one rank's shards into a dir: one file per rank, each fsynced
shard_writer = functools.partial(FileSystemWriter, single_file_per_rank=True, sync_files=True)


@dataclass
class ShardedSave:
    """A sharded save between its phases; lockstep.checkpoint.background runs write_and_commit in a thread."""

    run_dir: Path
    step: int
    keep_last: int
    tmp: Path  # the temporary dir every rank writes into
    rng_states: list | None
    prepared: dict[str, Any]  # rank 0's: state.json bytes, the extra files, the step dir it becomes

    def fail(self, rt: Runtime, phase: str, errors: list) -> CheckpointError:
        if rt.is_main:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return CheckpointError(f"saving the sharded checkpoint of step {self.step} failed while {phase} ("
                               + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
                               + "); the previous checkpoint is untouched")

    def write_and_commit(self, rt: Runtime, write: Callable[[], Any]) -> Path:
        """Every rank writes its shards with write() and hashes them (in parallel); then rank 0 writes the rest and
        commits. The collectives run on rt.control_group: the caller's thread must be the only one using it."""
        shards, problem = {}, None
        try:
            write()
            shards = {p.name: file_entry(p) for p in self.tmp.glob(f"__{rt.rank}_*")}
        except (Exception, CheckpointException) as e:  # DCP raises its own on every rank; it is a BaseException
            problem = f"{type(e).__name__}: {str(e).strip()[:2000]}"
        reports = gather_objects(rt, (problem, shards))
        if any(err for err, _ in reports):
            raise self.fail(rt, "writing the shards", [err for err, _ in reports])
        path, error = run_on_main(rt, lambda: self._commit({n: e for _, files in reports for n, e in files.items()}))
        if error:
            raise CheckpointError(f"saving the sharded checkpoint of step {self.step} failed on rank 0 "
                                  f"({type(error).__name__}: {error}); the previous checkpoint is untouched")
        return Path(path)

    def _commit(self, known: dict[str, dict]) -> str:
        """Rank 0: state.json, rng.pt, the extra files and the manifest (rank 0 hashes what no rank reported), rename."""
        final, tmp = self.prepared["final"], self.tmp
        try:
            with explain_write_errors(self.run_dir, self.step):
                write_meta_files(tmp, self.rng_states, self.prepared["state_json"], self.prepared["extra"])
                seal(tmp, final, self.step, known, layout=SHARDED)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:  # committed: a failure to move `latest` or prune must not hide that
            move_latest(final, self.keep_last)
        except Exception as e:
            raise CheckpointError(f"{type(e).__name__} after the commit of {final.name}, moving `latest`: {e}") from e
        return str(final)


def begin_sharded_save(rt: Runtime, run_dir, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                       rng_states: list | None, state: dict, extra: dict[str, bytes] | None,
                       keep_last: int) -> tuple[ShardedSave, dict[str, Any]]:
    """Every rank: (the save, this rank's state dict to write). Rank 0 checks the arguments and makes the temporary
    dir; every rank collects its state dict. A failure on any rank raises CheckpointError on every rank."""
    prepared: dict[str, Any] = {}

    def prepare() -> str:
        prepared["state_json"], prepared["extra"] = check_save_args(step, keep_last, state, extra)
        with explain_write_errors(run_dir, step):
            prepared["tmp"], prepared["final"] = start_save(run_dir, step)
        return str(prepared["tmp"])

    tmp_name, error = run_on_main(rt, prepare)
    if error:
        raise CheckpointError(f"saving the sharded checkpoint of step {step} failed on rank 0 "
                              f"({type(error).__name__}: {error}); the previous checkpoint is untouched")
    save = ShardedSave(Path(run_dir), step, keep_last, Path(tmp_name), rng_states, prepared)
    try:
        to_save, problem = _saved_state(model, optimizer), None
    except Exception as e:
        to_save, problem = {}, f"{type(e).__name__}: {e}"
    errors = gather_objects(rt, problem)
    if any(errors):
        raise save.fail(rt, "collecting the state dicts", errors)
    return save, to_save


def _saved_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        model_sd = get_model_state_dict(model)
    else:
        # Note: an optimizer that has not stepped yet gets its state created by a zero-lr step here
        model_sd, optim_sd = get_state_dict(model, optimizer)
    clash = [k for k in model_sd if k == OPTIM or k.startswith(OPTIM + ".")]
    if clash:
        raise CheckpointError(f"model tensor {clash[0]!r} collides with the checkpoint's {OPTIM!r} key; "
                              f"rename the model's {OPTIM!r} submodule")
    return model_sd if optimizer is None else {**model_sd, OPTIM: optim_sd}


# ---- loading ----------------------------------------------------------------------------------------

def load_sharded_checkpoint(ckpt_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                            partial: bool = False, upgrade: Upgrade | None = None) -> dict:
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
    meta = _read_dcp_metadata(path)
    if optimizer is not None and not any(_path_of(meta, k)[0] == OPTIM for k in meta.state_dict_metadata):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state; load it with optimizer=None "
                              "(weights only) or pick a checkpoint of a training run")
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)  # this layout's tensors: DCP reads into them
        target = {**model_sd, OPTIM: optim_sd}
    else:
        model_sd = get_model_state_dict(model)
        target = dict(model_sd)
    saved = _model_shapes(meta)
    check_shapes({k: v for k, v in saved.items() if k in model_sd} if partial else saved, model_sd, path)
    try:
        _load(target, path)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot load the sharded checkpoint {path}: {type(e).__name__}: "
                              f"{str(e).strip()[:2000]}; {_FIX}") from e
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict={k: target[k] for k in model_sd},
                       optim_state_dict=target[OPTIM])
    else:
        set_model_state_dict(model, target)
    return json.loads((path / STATE).read_text())


def _load_plain_into(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, partial: bool,
                     upgrade: Upgrade | None) -> dict:
    ckpt = load_plain_checkpoint(path, upgrade=upgrade)  # verifies the checksums
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    model_sd = get_model_state_dict(model)
    # a LoRA run's plain checkpoint holds the trainable tensors only: the frozen base comes from model.path
    expected = {k: v for k, v in model_sd.items() if k in ckpt.tensors or k not in frozen}
    check_shapes({k: v for k, v in ckpt.tensors.items() if k in model_sd} if partial else ckpt.tensors, expected, path)
    full = StateDictOptions(full_state_dict=True, strict=False)  # each rank keeps its shard of the full tensors
    set_model_state_dict(model, ckpt.tensors, options=full)
    if optimizer is not None:
        if ckpt.optimizer_state is None:
            raise CheckpointError(f"checkpoint {path} holds no optimizer state; load it with optimizer=None "
                                  "(weights only) or pick a checkpoint of a training run")
        set_optimizer_state_dict(model, optimizer, _by_fqn(ckpt.optimizer_state, model, optimizer, path), options=full)
    return ckpt.state


def _by_fqn(plain: dict, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict:
    """optimizer.state_dict() (parameters numbered in param_groups order) keyed by parameter FQN instead."""
    fqn_of = {id(p): name for name, p in model.named_parameters()}
    groups = optimizer.param_groups
    saved = [len(g["params"]) for g in plain["param_groups"]]
    if saved != [len(g["params"]) for g in groups]:
        raise CheckpointError(f"checkpoint {path} has optimizer groups of {saved} parameters, this optimizer "
                              f"{[len(g['params']) for g in groups]}; resume with the model and optimizer settings "
                              "it was written with")
    fqns = [fqn_of[id(p)] for g in groups for p in g["params"]]
    return {"state": {fqns[i]: s for i, s in plain["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in plain["param_groups"]]}


def load_full_model_tensors(ckpt_dir) -> dict[str, torch.Tensor]:
    """The full, unsharded model tensors of a checkpoint (sharded or plain), keyed by FQN, on the CPU.

    One process, no process group (for `lockstep merge` / `export`). Verifies the checksums first.
    """
    path = Path(ckpt_dir)
    problems = checkpoint_problems(path, sharded_problems)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(problems)}); {_FIX}")
    return read_full_model_tensors(path) if is_sharded(path) else load_file(path / MODEL)


def read_full_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """load_full_model_tensors of a sharded checkpoint without verifying it (the caller did)."""
    meta = _read_dcp_metadata(path)
    tensors = {k: torch.empty(shape, dtype=meta.state_dict_metadata[k].properties.dtype)
               for k, shape in _model_shapes(meta).items()}
    _load(tensors, path, no_dist=True)
    return tensors


def _load(target: dict, path: Path, no_dist: bool = False) -> None:
    """dcp.load in place into `target`; one process without a process group is meant, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(), no_dist=no_dist)


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
            problems.append(f"{name}: {file.stat().st_size} bytes, manifest says {entry.get('bytes')}")
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(problems)}); {_FIX}")


def _path_of(meta, key: str) -> tuple:
    """The nested path a flattened key came from: ('blocks.0.attn.qkv.weight',) or ('optimizer', 'state', ...)."""
    return tuple((meta.planner_data or {}).get(key, (key,)))


def _model_shapes(meta) -> dict[str, tuple[int, ...]]:
    return {k: tuple(md.size) for k, md in meta.state_dict_metadata.items()
            if isinstance(md, dcp_metadata.TensorStorageMetadata) and len(_path_of(meta, k)) == 1
            and _path_of(meta, k)[0] != OPTIM}


# ---- reading DCP files without pickle code execution -------------------------------------------------

# DCP's index (`.metadata`) is a plain pickle of its metadata dataclasses, torch dtypes and sizes, and
# the path it was saved under; any other global (a function to call) is refused.
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # Metadata, TensorStorageMetadata, ... (data only)
_SAFE_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                 ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                 ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module in (_DCP_METADATA_MODULE, "torch"):
            obj = super().find_class(module, name)
            if (module == _DCP_METADATA_MODULE and isinstance(obj, type)) or \
                    isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's {DCP_METADATA}")


def _read_dcp_metadata(path: Path):
    try:
        with open(path / DCP_METADATA, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
        raise CheckpointError(f"cannot read {path / DCP_METADATA}: {type(e).__name__}: {e}; {_FIX}") from e
    if not isinstance(meta, dcp_metadata.Metadata):
        raise CheckpointError(f"{path / DCP_METADATA} holds a {type(meta).__name__}, not DCP metadata; {_FIX}")
    return meta


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        meta = _read_dcp_metadata(Path(self.path))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class _SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # Non-tensor values (optimizer hyperparameters: floats, tuples, strings) need no code execution.
        # Loaded with weights_only=True first, the object that DCP's own torch.load then sees is known-safe.
        super().load_bytes(read_item, io.BytesIO(_reserialize(torch.load(value, weights_only=True))))


def _reserialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def sharded_problems(path: Path, listed: dict) -> list[str]:
    """Content checks for verify_checkpoint: DCP's index parses, every shard it names is in the manifest, and
    the non-tensor values in the shards (optimizer hyperparameters) load as a resume loads them, weights_only."""
    try:
        meta = _read_dcp_metadata(path)
    except CheckpointError as e:
        return [f"{DCP_METADATA}: unreadable ({e.__cause__ or e})"]
    try:
        storage = dict(meta.storage_data or {})
        named = {info.relative_path for info in storage.values()}
        values = [(index.fqn, info) for index, info in storage.items() if not info.transform_descriptors
                  and isinstance(meta.state_dict_metadata.get(index.fqn), dcp_metadata.BytesStorageMetadata)]
    except (AttributeError, TypeError) as e:  # parsed, but not shaped like DCP's index
        return [f"{DCP_METADATA}: not DCP's index of this checkpoint ({type(e).__name__}: {e})"]
    problems = [f"{name}: holds shards (says {DCP_METADATA}) but is not in {MANIFEST}" for name in sorted(named - set(listed))]
    refused: dict[str, str] = {}  # the first refused value of each shard file says enough
    for fqn, info in values:
        if info.relative_path in refused or not (path / info.relative_path).is_file():
            continue
        try:
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        except Exception as e:  # UnpicklingError (a global outside the allowlist), a cut-off zip, ...
            refused[info.relative_path] = f"{info.relative_path}: value {fqn} is refused by " \
                                          f"torch.load(weights_only=True) ({refusal_reason(e)})"
    return problems + sorted(refused.values())
