"""DCP's files read without pickle code execution, and the content check of a sharded checkpoint.

DCP reads its index (`.metadata`) with plain pickle and its non-tensor values with
torch.load(weights_only=False). Here the index goes through an allowlist of DCP's metadata classes,
torch dtypes and sizes (any other global, a function to call, is refused), and every non-tensor value
through torch.load(weights_only=True) first. lockstep.checkpoint.sharded loads through SafeReader and
SafeLoadPlanner; verify_checkpoint calls sharded_problems.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from lockstep.checkpoint.manifest import DCP_METADATA, MANIFEST
from lockstep.checkpoint.verify import refusal_reason
from lockstep.errors import CheckpointError

FIX = "see `lockstep verify RUN_DIR`; resume from another checkpoint with --resume PATH, or start fresh"

# DCP's index (`.metadata`) is a plain pickle of its metadata dataclasses, torch dtypes and sizes, and
# the path it was saved under; any other global (a function to call) is refused.
# Metadata, TensorStorageMetadata, ... (data only)
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module in (_DCP_METADATA_MODULE, "torch"):
            obj = super().find_class(module, name)
            if (module == _DCP_METADATA_MODULE and isinstance(obj, type)) or isinstance(
                obj, (torch.dtype, torch.layout, torch.memory_format)
            ):
                return obj
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in a checkpoint's {DCP_METADATA}"
        )


def read_dcp_metadata(path: Path):
    try:
        with open(path / DCP_METADATA, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except (
        OSError,
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ImportError,
        TypeError,
        ValueError,
    ) as e:
        raise CheckpointError(
            f"cannot read {path / DCP_METADATA}: {type(e).__name__}: {e}; {FIX}"
        ) from e
    if not isinstance(meta, dcp_metadata.Metadata):
        raise CheckpointError(
            f"{path / DCP_METADATA} holds a {type(meta).__name__}, not DCP metadata; {FIX}"
        )
    return meta


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        meta = read_dcp_metadata(Path(self.path))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # Non-tensor values (optimizer hyperparameters: floats, tuples, strings) need no code execution.
        # Loaded with weights_only=True first, the object that DCP's own torch.load then sees is known-safe.
        super().load_bytes(
            read_item, io.BytesIO(_reserialize(torch.load(value, weights_only=True)))
        )


def _reserialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def sharded_problems(path: Path, listed: dict) -> list[str]:
    """Content checks for verify_checkpoint: DCP's index parses, every shard it names is in the manifest, and
    the non-tensor values in the shards (optimizer hyperparameters) load as a resume loads them, weights_only."""
    try:
        meta = read_dcp_metadata(path)
    except CheckpointError as e:
        return [f"{DCP_METADATA}: unreadable ({e.__cause__ or e})"]
    try:
        storage = dict(meta.storage_data or {})
        named = {info.relative_path for info in storage.values()}
        values = [
            (index.fqn, info)
            for index, info in storage.items()
            if not info.transform_descriptors
            and isinstance(
                meta.state_dict_metadata.get(index.fqn), dcp_metadata.BytesStorageMetadata
            )
        ]
    except (AttributeError, TypeError) as e:  # parsed, but not shaped like DCP's index
        return [f"{DCP_METADATA}: not DCP's index of this checkpoint ({type(e).__name__}: {e})"]
    problems = [
        f"{name}: holds shards (says {DCP_METADATA}) but is not in {MANIFEST}"
        for name in sorted(named - set(listed))
    ]
    refused: dict[str, str] = {}  # the first refused value of each shard file says enough
    for fqn, info in values:
        if info.relative_path in refused or not (path / info.relative_path).is_file():
            continue
        try:
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        # UnpicklingError (a global outside the allowlist), a cut-off zip, ...
        except Exception as e:
            refused[info.relative_path] = (
                f"{info.relative_path}: value {fqn} is refused by "
                f"torch.load(weights_only=True) ({refusal_reason(e)})"
            )
    return problems + sorted(refused.values())
