"""Is a checkpoint dir intact and usable? The checks that say so, for either kind of checkpoint.

`checkpoint_problems`: the manifest, checked against its own checksum first, so a flipped bit in it is
blamed on it and not on the file it describes; every listed file's size and sha256; then the contents
the resume path relies on: the safetensors header, state.json's fields and their types, pickles that
torch.load(weights_only=True) accepts (optimizer.pt, rng.pt, grad_compression.pt), holding what a
resume reads. The content check of a sharded checkpoint's DCP files needs DCP,
so its caller passes it in (lockstep.checkpoint.open.verify_checkpoint checks either kind).
`quick_check`: the manifest and the file sizes only, for when hashing multi-GB files is too slow
(a run that is stopping says which checkpoint a resume would take).

Reads the files of one checkpoint dir, writes nothing; never unpickles with code execution.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from lockstep.checkpoint.manifest import (
    COMPRESSION,
    DCP_METADATA,
    MANIFEST,
    MODEL,
    OPTIMIZER,
    RNG,
    SHARDED,
    SNAPSHOT_MARK,
    STATE,
    STEP_DIR,
    read_manifest,
    sha256_file,
    step_of,
)
from lockstep.errors import CheckpointError

# what to do about a checkpoint that fails these checks
RESUME_FIX = "pick another with --resume PATH (see `lockstep verify RUN_DIR`), or start fresh with --resume none"

# how the problem of an in-memory snapshot (lockstep.checkpoint.memory) begins
SNAPSHOT_PROBLEM = "an in-memory snapshot of run"
# (checkpoint dir, the files its manifest lists) -> problems of its DCP index and shards
DcpCheck = Callable[[Path, dict], list]


def quick_check(path) -> list[str]:
    """checkpoint_problems without hashing or reading contents: the manifest, and every listed file present at its size."""
    return _file_problems(Path(path), hash_files=False)[0]


def checkpoint_problems(
    path, dcp_problems: DcpCheck | None = None, *, snapshot: bool = False
) -> list[str]:
    """Problems with a checkpoint dir, one string each; an empty list means it is good.

    An in-memory snapshot (lockstep.checkpoint.memory) is a problem unless `snapshot`, which asks for
    one: it is never taken for a committed checkpoint.

    dcp_problems: the content check of a sharded checkpoint (lockstep.checkpoint.dcp_files.sharded_problems);
    without it, a sharded checkpoint's DCP files are checked by size and sha256 only.
    """
    path = Path(path)
    problems, manifest, bad = _file_problems(path, hash_files=True)
    if not path.is_dir():
        return problems
    # Content checks: garbage written with a valid checksum; a precise diagnosis without manifest.
    if (
        dcp_problems is not None
        and manifest is not None
        and manifest.get("layout") == SHARDED
        and (path / DCP_METADATA).is_file()
        and DCP_METADATA not in bad
    ):
        problems += dcp_problems(path, manifest["files"])
    if (path / MODEL).is_file() and MODEL not in bad:
        try:
            read_tensor_shapes(path)
        except CheckpointError as e:
            problems.append(f"{MODEL}: safetensors header unreadable ({e.__cause__ or e})")
    state = None
    if (path / STATE).is_file() and STATE not in bad:
        try:
            state = json.loads((path / STATE).read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{STATE}: not JSON ({e})")
        else:
            problems += state_problems(state, manifest.get("step") if manifest else None)
            problems += _kind_problems(path, state, snapshot)
    return problems + _pickle_problems(path, state, bad)


def _kind_problems(path: Path, state: Any, snapshot: bool) -> list[str]:
    mark = state.get(SNAPSHOT_MARK) if isinstance(state, dict) else None
    if mark is not None and not snapshot:
        return [
            f"{SNAPSHOT_PROBLEM} {mark.get('run_id') if isinstance(mark, dict) else mark} "
            "(lockstep.checkpoint.memory), not a committed checkpoint: only a restart of its run "
            "reads it; use a checkpoint under RUN/checkpoints"
        ]
    if mark is None and snapshot:
        return [f"{STATE}: not an in-memory snapshot (no {SNAPSHOT_MARK!r} entry)"]
    return []


def _file_problems(path: Path, hash_files: bool) -> tuple[list[str], dict | None, set[str]]:
    """(problems, the manifest if it is good, names of listed files that are damaged)."""
    if not path.is_dir():
        return [f"{path}: no such directory"], None, set()
    manifest, problem = read_manifest(path)
    problems, bad = ([problem] if problem else []), set()
    if manifest is None:
        return problems, None, bad
    files = manifest["files"]
    needed = (DCP_METADATA if manifest.get("layout") == SHARDED else MODEL, STATE)
    problems += [f"{MANIFEST}: does not list {name}" for name in needed if name not in files]
    for name, entry in sorted(files.items()):
        file, want = path / name, entry.get("bytes")
        if "/" in name or not file.is_file():
            problems.append(f"{name}: missing")
        elif (size := file.stat().st_size) != want:
            hint = " (truncated?)" if isinstance(want, int) and size < want else ""
            problems.append(f"{name}: {size} bytes, manifest says {want}{hint}")
        elif hash_files and sha256_file(file) != entry.get("sha256"):
            problems.append(f"{name}: checksum mismatch")
        else:
            continue
        bad.add(name)
    if STEP_DIR.match(path.name) and manifest.get("step") != step_of(path):
        problems.append(f"{MANIFEST}: says step {manifest.get('step')}, directory is {path.name}")
    return problems, manifest, bad


def read_tensor_shapes(path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from the safetensors header only (no tensor data is read). `path`: dir or file."""
    file = Path(path) / MODEL if Path(path).is_dir() else Path(path)
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError, OSError, ...
        raise CheckpointError(f"cannot read the safetensors header of {file}: {e}") from e


# ---- state.json: the fields a resume reads, with the types it assumes ------------------------------------


def state_problems(state: Any, manifest_step: int | None) -> list[str]:
    """What in state.json would make a resume fail, or go on from the wrong place. Fields are checked when
    present (a merged checkpoint has no cursor); continuing a run (a scheduler is saved) needs step and cursor."""
    if not isinstance(state, dict):
        return [f"{STATE}: holds {_shown(state)}, not a JSON object"]
    problems = []
    if "scheduler" in state:
        problems += [
            f"{STATE}: has a scheduler but no {key!r}, which a resume continues from"
            for key in ("step", "cursor")
            if key not in state
        ]
    step = state.get("step")
    if "step" in state and not _is_count(step):
        problems.append(f"{STATE}: step is {_shown(step)}; it must be an int >= 0")
    elif "step" in state and manifest_step is not None and step != manifest_step:
        problems.append(f"{STATE}: step {step}, {MANIFEST} says {manifest_step}")
    if "cursor" in state:  # lockstep.data.sampler.Cursor.from_dict
        cursor = state["cursor"]
        if not isinstance(cursor, dict):
            problems.append(
                f"{STATE}: cursor is {_shown(cursor)}; it must be an object with int epoch and offset >= 0"
            )
        else:
            problems += [
                f"{STATE}: cursor.{key} is {_shown(cursor.get(key))}; it must be an int >= 0"
                for key in ("epoch", "offset")
                if not _is_count(cursor.get(key))
            ]
    if "scheduler" in state and not isinstance(state["scheduler"], dict):
        problems.append(
            f"{STATE}: scheduler is {_shown(state['scheduler'])}; it must be an object (its state_dict)"
        )
    for key in ("grad_scaler", "config"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            problems.append(f"{STATE}: {key} is {_shown(state[key])}; it must be an object or null")
    model = state["config"].get("model") if isinstance(state.get("config"), dict) else None
    if model is not None and not isinstance(model, dict):
        problems.append(
            f"{STATE}: config.model is {_shown(model)}; it must be an object (the model's settings)"
        )
    world = state.get("world_size")
    if world is not None and not (_is_count(world) and world >= 1):
        problems.append(f"{STATE}: world_size is {_shown(world)}; it must be an int >= 1 or null")
    return problems


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


# ---- pickles: what torch.load(weights_only=True) accepts ---------------------------------------------------


def _pickle_problems(path: Path, state: Any, bad: set[str]) -> list[str]:
    """optimizer.pt, rng.pt and grad_compression.pt as a resume loads and uses them:
    optimizer.load_state_dict(that dict), rng_states[rank] for every rank of the saved world size,
    and the gradient compression's state (lockstep.train.setup.load_compression_state)."""
    problems = []
    checks = {OPTIMIZER: _optimizer_problem, RNG: _rng_problem, COMPRESSION: _compression_problem}
    for name, check in checks.items():
        if (path / name).is_file() and name not in bad:
            saved, problem = _unpickle(path / name)
            problem = problem or check(saved, state if isinstance(state, dict) else {})
            problems += [problem] if problem else []
    return problems


def _optimizer_problem(optimizer: Any, state: dict) -> str | None:
    if (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("state"), dict)
        and isinstance(optimizer.get("param_groups"), list)
    ):
        return None
    return (
        f"{OPTIMIZER}: holds {_shown(optimizer)}, not an optimizer state_dict (state, param_groups)"
    )


def _rng_problem(rng: Any, state: dict) -> str | None:
    world = state.get("world_size")
    if not isinstance(rng, list):
        return f"{RNG}: holds {_shown(rng)}, not a list with one RNG state per rank"
    if _is_count(world) and len(rng) != world:
        return f"{RNG}: holds {len(rng)} ranks' RNG states, {STATE} says world_size {world}"
    return None


def _compression_problem(saved: Any, state: dict) -> str | None:
    """The fields a resume reads: kind, world_size, iter, q (parameter name -> tensor, the same on
    every rank) and errors (one such map per rank: each rank's own error feedback)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("kind"), str):
        return (
            f"{COMPRESSION}: holds {_shown(saved)}, not a gradient compression state "
            "(a dict with its kind)"
        )
    world, errors, q = saved.get("world_size"), saved.get("errors"), saved.get("q")
    if not (_is_count(world) and world >= 1):
        return f"{COMPRESSION}: world_size is {_shown(world)}; it must be an int >= 1"
    if not _is_count(saved.get("iter")):
        return f"{COMPRESSION}: iter is {_shown(saved.get('iter'))}; it must be an int >= 0"
    if not _is_tensor_map(q):
        return f"{COMPRESSION}: q is {_shown(q)}; it must map parameter names to tensors"
    if not (isinstance(errors, list) and len(errors) == world and all(map(_is_tensor_map, errors))):
        return (
            f"{COMPRESSION}: errors is {_shown(errors)}; it must be a list of {world} "
            "(its world_size) maps of parameter names to tensors, one per rank"
        )
    saved_by = state.get("world_size")
    if _is_count(saved_by) and world != saved_by:
        return f"{COMPRESSION}: saved by {world} ranks, {STATE} says world_size {saved_by}"
    return None


def _is_tensor_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    )


def _unpickle(file: Path) -> tuple[Any, str | None]:
    """(the object, None) or (None, why torch.load(weights_only=True) refuses the file).

    mmap: the tensors stay on disk, only the pickle is read, so this is cheap on a multi-GB optimizer.pt.
    lockstep writes torch.save's zip format, which mmap needs; anything else is not what it wrote.
    """
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True), None
    except Exception as e:  # UnpicklingError (a global outside the allowlist), RuntimeError (not a zip), EOFError, ...
        return None, f"{file.name}: torch.load(weights_only=True) refuses it ({refusal_reason(e)})"


def refusal_reason(error: Exception) -> str:
    """Why torch.load refused a file, in one line (its own message is a paragraph that suggests
    allowlisting, or nothing at all for a file that ends early)."""
    text = str(error)
    if m := re.search(r"GLOBAL ([\w.]+)", text):
        return f"{type(error).__name__}: global {m[1]} is outside its allowlist"
    if "mmap can only be used" in text:  # torch.save writes a zip archive; this is something else
        return f"{type(error).__name__}: not in torch.save's zip format (a bare pickle, or damaged)"
    if m := re.search(r"WeightsUnpickler error: \s*(\S[^\n]*)", text):
        return f"{type(error).__name__}: {m[1].strip()[:300]}"
    if isinstance(error, EOFError) and not text.strip():
        return f"{type(error).__name__}: the file ends early (empty or truncated)"
    lines = [line.strip() for line in text.splitlines() if line.strip()] or ["(no message)"]
    return f"{type(error).__name__}: {lines[0][:300]}"
