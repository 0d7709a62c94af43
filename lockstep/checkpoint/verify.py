"""Is a checkpoint dir intact and usable? What a committed one holds, and the checks that say so.

`verify_checkpoint` (resume, `lockstep verify`): the manifest, checked against its own checksum first, so
a flipped bit in it is blamed on it and not on the file it describes; every listed file's size and
sha256; then the contents the resume path relies on: the safetensors header, state.json's fields and
their types, pickles that torch.load(weights_only=True) accepts, DCP's index of a sharded checkpoint.
`quick_check`: the manifest and the file sizes only, for when hashing multi-GB files is too slow
(a run that is stopping says which checkpoint a resume would take).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lockstep.errors import CheckpointError

# 1: the built-in GPT's attn.qkv held [q | k | v] (converted on load); 2: head-major qkv rows;
# 3: the manifest holds the sha256 of its own canonical JSON (MANIFEST_SHA256). Older lockstep versions
# refuse format 3 rather than skip that check; format-2 manifests have no such field and still load.
FORMAT = 3
_READABLE_FORMATS = (1, 2, 3)
MODEL, OPTIMIZER, RNG, STATE, MANIFEST = "model.safetensors", "optimizer.pt", "rng.pt", "state.json", "manifest.json"
SHARDED, DCP_METADATA = "sharded", ".metadata"  # manifest "layout" of lockstep.checkpoint.sharded; DCP's index
MANIFEST_SHA256 = "manifest_sha256"
_CHUNK = 1 << 20
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def step_of(path: Path) -> int:
    """The step of a step_NNNNNNNN dir."""
    return int(_STEP_DIR.match(path.name)[1])


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no spaces), its own checksum field left out."""
    rest = {k: v for k, v in manifest.items() if k != MANIFEST_SHA256}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """(the manifest of a checkpoint dir, None) or (None, what is wrong with it)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None, f"{MANIFEST}: missing (the save never finished)"
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST}: unreadable ({e})"
    if not isinstance(manifest, dict):
        return None, f"{MANIFEST}: holds a {type(manifest).__name__}, not a manifest"
    # its own checksum first: a flipped bit in a recorded size or sha256 must not be blamed on that file
    recorded = manifest.get(MANIFEST_SHA256)
    if recorded is not None and recorded != manifest_digest(manifest):
        return None, (f"{MANIFEST} damaged: its contents no longer match its own checksum ({MANIFEST_SHA256}), "
                      "so the files it lists cannot be checked against it")
    files = manifest.get("files")
    if not isinstance(files, dict) or manifest.get("format") not in _READABLE_FORMATS or \
            not all(isinstance(entry, dict) for entry in files.values()):
        return None, f"{MANIFEST}: not a format-{'/'.join(map(str, _READABLE_FORMATS))} manifest"
    if recorded is None and manifest["format"] >= 3:
        return None, f"{MANIFEST} damaged: a format-{manifest['format']} manifest without its {MANIFEST_SHA256}"
    return manifest, None


def quick_check(path) -> list[str]:
    """verify_checkpoint without hashing or reading contents: the manifest, and every listed file present at its size."""
    return _manifest_problems(Path(path), hash_files=False)[0]


def verify_checkpoint(path) -> list[str]:
    """Problems with a checkpoint dir, one string each; an empty list means it is good."""
    path = Path(path)
    problems, manifest, bad = _manifest_problems(path, hash_files=True)
    if not path.is_dir():
        return problems
    # Content checks: garbage written with a valid checksum; a precise diagnosis without manifest.
    if manifest is not None and manifest.get("layout") == SHARDED and (path / DCP_METADATA).is_file() \
            and DCP_METADATA not in bad:
        from lockstep.checkpoint.sharded import sharded_problems  # DCP is imported only for sharded checkpoints

        problems += sharded_problems(path, manifest["files"])
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
    return problems + _pickle_problems(path, state, bad)


def _manifest_problems(path: Path, hash_files: bool) -> tuple[list[str], dict | None, set[str]]:
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
    if _STEP_DIR.match(path.name) and manifest.get("step") != step_of(path):
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
        problems += [f"{STATE}: has a scheduler but no {key!r}, which a resume continues from"
                     for key in ("step", "cursor") if key not in state]
    step = state.get("step")
    if "step" in state and not _is_count(step):
        problems.append(f"{STATE}: step is {_shown(step)}; it must be an int >= 0")
    elif "step" in state and manifest_step is not None and step != manifest_step:
        problems.append(f"{STATE}: step {step}, {MANIFEST} says {manifest_step}")
    if "cursor" in state:  # lockstep.data.sampler.Cursor.from_dict
        cursor = state["cursor"]
        if not isinstance(cursor, dict):
            problems.append(f"{STATE}: cursor is {_shown(cursor)}; it must be an object with int epoch and offset >= 0")
        else:
            problems += [f"{STATE}: cursor.{key} is {_shown(cursor.get(key))}; it must be an int >= 0"
                         for key in ("epoch", "offset") if not _is_count(cursor.get(key))]
    if "scheduler" in state and not isinstance(state["scheduler"], dict):
        problems.append(f"{STATE}: scheduler is {_shown(state['scheduler'])}; it must be an object (its state_dict)")
    for key in ("grad_scaler", "config"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            problems.append(f"{STATE}: {key} is {_shown(state[key])}; it must be an object or null")
    model = state["config"].get("model") if isinstance(state.get("config"), dict) else None
    if model is not None and not isinstance(model, dict):
        problems.append(f"{STATE}: config.model is {_shown(model)}; it must be an object (the model's settings)")
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
    """optimizer.pt and rng.pt as a resume loads and uses them: optimizer.load_state_dict(that dict), and
    rng_states[rank] for every rank of the saved world size."""
    problems = []
    if (path / OPTIMIZER).is_file() and OPTIMIZER not in bad:
        optimizer, problem = _unpickle(path / OPTIMIZER)
        if problem is None and not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
                                    and isinstance(optimizer.get("param_groups"), list)):
            problem = f"{OPTIMIZER}: holds {_shown(optimizer)}, not an optimizer state_dict (state, param_groups)"
        problems += [problem] if problem else []
    if (path / RNG).is_file() and RNG not in bad:
        rng, problem = _unpickle(path / RNG)
        world = state.get("world_size") if isinstance(state, dict) else None
        if problem is None and not isinstance(rng, list):
            problem = f"{RNG}: holds {_shown(rng)}, not a list with one RNG state per rank"
        elif problem is None and _is_count(world) and len(rng) != world:
            problem = f"{RNG}: holds {len(rng)} ranks' RNG states, {STATE} says world_size {world}"
        problems += [problem] if problem else []
    return problems


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
    """Why torch.load refused a file, in one line (its own message is a paragraph that suggests allowlisting)."""
    if m := re.search(r"GLOBAL ([\w.]+)", str(error)):
        return f"{type(error).__name__}: global {m[1]} is outside its allowlist"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    return f"{type(error).__name__}: {lines[0][:300]}"
