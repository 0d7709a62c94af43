"""Checkpoints committed atomically: temp dir, fsync, manifest (checksums), rename, move `latest`.

Nothing appears under RUN_DIR/checkpoints/step_* before it is complete and fsynced, so a crash never
harms the previous checkpoint; unfinished `.tmp-*-<pid>` dirs are removed by the next save. `latest`
names the current timeline: `--resume auto` starts at its dir and falls back to older ones; newer
step_* dirs (an abandoned run's) are ignored. File I/O only (the trainer saves on global rank 0);
nothing is unpickled with code execution: safetensors, and torch.load(weights_only=True). What a
checkpoint holds and how it is checked: lockstep.checkpoint.verify.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

# the format, its file names and its checks (lockstep.checkpoint.verify); importers take these from here too
from lockstep.checkpoint.verify import (
    FORMAT, MANIFEST, MANIFEST_SHA256, MODEL, OPTIMIZER, RNG, SHARDED, STATE, _STEP_DIR, manifest_digest,
    refusal_reason, sha256_file, step_of, verify_checkpoint,
)
from lockstep.errors import CheckpointError
from lockstep.checkpoint.verify import DCP_METADATA, read_manifest, read_tensor_shapes  # noqa: F401 (were defined here)
from lockstep.run_dir import unwritable_fix

_RESERVED = {MODEL, OPTIMIZER, RNG, STATE, MANIFEST}
_TMP = re.compile(r"^\.tmp-.+-(\d+)$")  # .tmp-step_..-PID, .tmp-replaced-..-PID, .tmp-latest-PID, ...
_RESUME_FIX = "pick another with --resume PATH (see `lockstep verify RUN_DIR`), or start fresh with --resume none"


@dataclass
class Checkpoint:
    path: Path
    tensors: dict[str, torch.Tensor]
    optimizer_state: dict | None
    rng_states: list | None  # one entry per rank, as gathered by the trainer
    state: dict  # state.json: step, data cursor, scheduler, config, world size, ...
    extra: dict[str, bytes]  # extra files by name (e.g. tokenizer.json)


def _fsync(path: Path) -> None:  # on a directory this makes its entries (renames) durable
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, fill: Callable) -> None:
    with open(path, "wb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return True


def _prepare_tensors(tensors: dict) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing storage (tied weights): clone the second and later
    # holders of a storage; the model's load_state_dict re-ties them on load.
    out, seen = {}, set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor; "
                                  "pass the unwrapped model's state_dict() with full (not sharded) tensors")
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        out[name] = t.clone() if key in seen and t.numel() else t
        seen.add(key)
    return out


def save_checkpoint(run_dir, step: int, tensors: dict[str, torch.Tensor], optimizer_state: dict | None,
                    rng_states: list | None, state: dict, extra: dict[str, bytes] | None = None,
                    keep_last: int = 3) -> Path:
    """Commit a checkpoint for `step` under RUN_DIR/checkpoints and return its path. Rank 0 only."""
    state_json, extra = check_save_args(step, keep_last, state, extra)  # fail before touching the disk
    tensors = _prepare_tensors(tensors)
    with explain_write_errors(run_dir, step):
        tmp, final = start_save(run_dir, step)
        try:
            save_file(tensors, tmp / MODEL, metadata={"format": "pt"})
            _fsync(tmp / MODEL)
            if optimizer_state is not None:
                _write(tmp / OPTIMIZER, lambda f: torch.save(optimizer_state, f))
            write_meta_files(tmp, rng_states, state_json, extra)
            seal(tmp, final, step)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a real crash leaves it; the next save removes it
            raise
        move_latest(final, keep_last)
    return final


@contextmanager
def explain_write_errors(run_dir, step: int):
    """An OSError a user can fix (read-only filesystem, disk full, no permission) as a CheckpointError that says how."""
    try:
        yield
    except OSError as e:
        fix = unwritable_fix(e)
        if fix is None:
            raise
        raise CheckpointError(f"cannot write the checkpoint of step {step} under {Path(run_dir) / 'checkpoints'} "
                              f"({e.strerror}: {e.filename}); {fix}; then run again to resume") from e


def check_save_args(step, keep_last, state: dict, extra: dict[str, bytes] | None) -> tuple[bytes, dict[str, bytes]]:
    """(state.json bytes, extra files) or a CheckpointError saying which argument is wrong."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step {step!r} is not a non-negative int; pass the optimizer step count")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(f"keep_last {keep_last!r} must be an int >= 1; set how many checkpoints to keep")
    extra = dict(extra or {})
    for name, data in extra.items():
        if name in _RESERVED or not name or name.startswith((".", "__")) or "/" in name or "\\" in name \
                or not isinstance(data, (bytes, bytearray)):
            raise CheckpointError(f"extra file {name!r} ({type(data).__name__}) is not allowed: pass bytes under a "
                                  f"plain file name, not hidden, not starting with '__', other than {sorted(_RESERVED)}")
    try:
        state_json = json.dumps(state, indent=2, sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"state is not JSON-serializable ({e}); use dicts, lists, str, numbers, None") from e
    return state_json, extra


def start_save(run_dir, step: int) -> tuple[Path, Path]:
    """(a fresh temporary dir to write into, the step dir it becomes on commit)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a failed earlier attempt of this very process
    tmp.mkdir()
    return tmp, final


def write_meta_files(tmp: Path, rng_states: list | None, state_json: bytes, extra: dict[str, bytes]) -> None:
    if rng_states is not None:
        _write(tmp / RNG, lambda f: torch.save(list(rng_states), f))
    for name, data in [(STATE, state_json), *extra.items()]:
        _write(tmp / name, lambda f, data=data: f.write(data))


def seal(tmp: Path, final: Path, step: int, known: dict[str, dict] | None = None, layout: str | None = None) -> None:
    """Write the manifest (size + sha256 of every file in tmp; `known` entries are taken as given; its own
    checksum last), rename into place."""
    known = known or {}
    files = {p.name: known.get(p.name) or file_entry(p) for p in sorted(tmp.iterdir())}
    manifest = {"format": FORMAT, "step": step, "files": files}
    if layout is not None:
        manifest["layout"] = layout
    manifest[MANIFEST_SHA256] = manifest_digest(manifest)
    _write(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    _fsync(tmp)
    _commit_dir(tmp, final)


def move_latest(final: Path, keep_last: int) -> None:
    """Point `latest` at the committed `final` (atomic replace), then prune to keep_last checkpoints."""
    root = final.parent
    latest_tmp = root / f".tmp-latest-{os.getpid()}"
    _write(latest_tmp, lambda f: f.write((final.name + "\n").encode()))
    os.replace(latest_tmp, root / "latest")
    _fsync(root)
    _prune(root, final, keep_last)


def file_entry(path: Path) -> dict:
    """A manifest entry: size and sha256 (ranks hash their own shards and send these to rank 0)."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _commit_dir(tmp: Path, final: Path) -> None:
    # POSIX rename cannot replace a non-empty dir: when re-saving a step (e.g. after a resume),
    # move the committed one aside first, and back if the second rename fails.
    aside, replacing = final.with_name(f".tmp-replaced-{final.name}-{os.getpid()}"), final.exists()
    if replacing:
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        if replacing:
            os.rename(aside, final)
        raise
    _fsync(final.parent)
    if replacing:
        shutil.rmtree(aside, ignore_errors=True)  # the new one is in; leftovers go at the next save


def _prune(root: Path, saved: Path, keep_last: int) -> None:
    # Keep the one just saved and the keep_last - 1 newest older ones. Newer dirs belong to an
    # abandoned timeline; they are left alone and get replaced as this run saves those steps.
    older = [c for c in list_checkpoints(root.parent) if step_of(c) < step_of(saved)]
    for ckpt in older[keep_last - 1:]:
        # Rename first so a crash mid-delete leaves a .tmp-* dir, never a half-deleted step_* dir.
        doomed = root / f".tmp-pruned-{ckpt.name}-{os.getpid()}"
        os.rename(ckpt, doomed)
        shutil.rmtree(doomed, ignore_errors=True)  # best effort (NFS can hold files); retried next save
    for entry in root.iterdir():
        m = _TMP.match(entry.name)
        if m and (int(m[1]) == os.getpid() or not _pid_alive(int(m[1]))):  # never a live saver's
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def list_checkpoints(run_dir) -> list[Path]:
    """Committed checkpoint dirs of a run, newest step first (unfinished .tmp-* dirs excluded)."""
    root = Path(run_dir) / "checkpoints"
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()] if root.is_dir() else []
    return sorted(found, key=step_of, reverse=True)


def _resume_order(run_dir: Path) -> tuple[list[Path], str | None, str | None]:
    """(checkpoints `--resume auto` tries in order, what `latest` says, a note if it was unusable)."""
    ckpts = list_checkpoints(run_dir)
    try:
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):  # crash before the first `latest`, or removed by hand
        return ckpts, None, ("`latest` is missing" if ckpts else None)
    named = [c for c in ckpts if c.name == latest]
    if not named:
        return ckpts, latest, f"`latest` names {latest!r}, which does not exist"
    return [c for c in ckpts if step_of(c) <= step_of(named[0])], latest, None


def _auto_resume(run_dir: Path, log: Callable[[str], None], verify=verify_checkpoint) -> Path | None:
    order, _, note = _resume_order(run_dir)
    if not order:
        return None
    if note:
        log(f"{note}; falling back to the newest checkpoint, {order[0].name}")
    failures = []
    for i, ckpt in enumerate(order):
        problems = verify(ckpt)
        if not problems:
            return ckpt
        failures.append(f"  {ckpt}: {'; '.join(problems)}")
        nxt = f"falling back to {order[i + 1].name}" if i + 1 < len(order) else "no older checkpoint left"
        log(f"checkpoint {ckpt.name} is damaged ({'; '.join(problems)}); {nxt}")
    raise CheckpointError(f"no checkpoint of {run_dir} verifies, refusing to start over silently:\n"
                          + "\n".join(failures) + f"\n{_RESUME_FIX}")


def resolve_resume(run_dir, resume: str, log: Callable[[str], None] = print) -> Path | None:
    """Turn --resume ("none" | "auto" | a checkpoint dir | a run dir) into a verified checkpoint or None."""
    if resume == "none":
        return None
    if resume == "auto":
        return _auto_resume(Path(run_dir), log)
    path = Path(resume)
    if path.name == "checkpoints" and path.is_dir():  # RUN/checkpoints given: treat as RUN
        path = path.parent
    if (path / "checkpoints").is_dir():
        found = _auto_resume(path, log)
        if found is None:  # the user named this run on purpose: starting fresh would surprise
            raise CheckpointError(f"--resume {resume}: run dir has no checkpoints; {_RESUME_FIX}")
        return found
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such directory; pass a checkpoint dir "
                              "(RUN/checkpoints/step_NNNNNNNN), a run dir, 'auto' or 'none'")
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"--resume {resume}: checkpoint is damaged ({'; '.join(problems)}); {_RESUME_FIX}")
    return path


def load_pickled_weights_only(file: Path, map_location):
    """torch.load(weights_only=True), with a CheckpointError that says why anything else is refused."""
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{file} holds objects outside torch's weights_only allowlist "
                              f"({refusal_reason(e)}); refusing to unpickle them, since that could "
                              "run code. Save only tensors and plain Python values, or use another checkpoint") from e


def load_checkpoint(path, map_location="cpu") -> Checkpoint:
    """Verify, then load a checkpoint dir. Raises CheckpointError if it is damaged.

    A sharded checkpoint (lockstep.checkpoint.sharded) gives its full model tensors and optimizer_state
    None: its optimizer state is sharded, and only load_sharded_checkpoint puts it into an optimizer.
    """
    path = Path(path)
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(problems)}); {_RESUME_FIX}")
    manifest = json.loads((path / MANIFEST).read_text())
    files = manifest["files"]
    device = map_location if isinstance(map_location, int) else str(torch.device(map_location))
    if manifest.get("layout") == SHARDED:
        from lockstep.checkpoint.sharded import read_full_model_tensors

        tensors = {k: v.to(device) for k, v in read_full_model_tensors(path).items()}
    else:
        tensors = load_file(path / MODEL, device=device)
    state = json.loads((path / STATE).read_text())
    if manifest.get("format") == 1:
        tensors = _upgrade_format_1(tensors, state)
    return Checkpoint(
        path=path,
        tensors=tensors,
        optimizer_state=load_pickled_weights_only(path / OPTIMIZER, map_location) if OPTIMIZER in files else None,
        rng_states=load_pickled_weights_only(path / RNG, "cpu") if RNG in files else None,  # RNG states live on CPU
        state=state,
        extra={name: (path / name).read_bytes() for name in sorted(files) if _is_extra(name)},
    )


def _upgrade_format_1(tensors: dict[str, torch.Tensor], state: dict) -> dict[str, torch.Tensor]:
    """Format-1 GPT checkpoints packed attn.qkv as [q | k | v]; the GPT now packs it head by head (whole heads
    per tensor-parallel shard). Same names and shapes, so without this they would load silently wrong."""
    model = (state.get("config") or {}).get("model") or {}
    if model.get("kind", "gpt") != "gpt":
        return tensors
    from lockstep.models.gpt import qkv_head_major

    heads = int(model.get("attention_heads", 4))
    return {k: qkv_head_major(v, heads) if k.endswith(("attn.qkv.weight", "attn.qkv.bias")) else v
            for k, v in tensors.items()}


def _is_extra(name: str) -> bool:
    return name not in _RESERVED and not name.startswith((".", "__"))  # DCP's .metadata and __R_N.distcp shards


def check_shapes(ckpt_tensors: dict, model_state: dict, ckpt_path) -> None:
    """Raise CheckpointError if the checkpoint's tensors (or shapes) do not fit the model's state dict."""
    ckpt = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for k, v in ckpt_tensors.items()}
    model = {k: tuple(v.shape) for k, v in model_state.items() if hasattr(v, "shape")}
    missing = [k for k in model if k not in ckpt]
    unexpected = [k for k in ckpt if k not in model]
    mismatch = next((k for k in model if k in ckpt and ckpt[k] != model[k]), None)
    if not (missing or unexpected or mismatch):
        return
    lines = [f"checkpoint {ckpt_path} was saved with {mismatch} of shape {ckpt[mismatch]} "
             f"but the model built from the config has {model[mismatch]}"] if mismatch else []
    for what, keys in (("lacks tensors the model has", missing), ("has tensors the model lacks", unexpected)):
        if keys:  # a different architecture can differ in hundreds of names: show a few
            more = f", ... ({len(keys)} in all)" if len(keys) > 5 else ""
            lines.append(f"checkpoint {ckpt_path} {what}: {', '.join(keys[:5])}{more}")
    raise CheckpointError("\n".join(lines) + "\nresume with the checkpoint's model settings (see its state.json "
                          "'config'), or start fresh with --resume none / another --output-dir")
