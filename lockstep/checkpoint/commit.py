"""The commit protocol: temp dir, fsync, manifest (checksums), rename, move `latest`, prune to keep_last.

Nothing appears under RUN_DIR/checkpoints/step_* before it is complete and fsynced, so a crash never
harms the previous checkpoint; unfinished `.tmp-*-<pid>` dirs are removed by the next save. `latest`
names the current timeline (lockstep.checkpoint.resume reads it). The writers fill the temporary dir:
lockstep.checkpoint.plain (rank 0 alone) and lockstep.checkpoint.sharded (every rank its shards).

Writes under RUN_DIR/checkpoints only, on the rank that commits; no process group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from lockstep.checkpoint.manifest import (
    COMPRESSION,
    MANIFEST,
    RESERVED,
    RNG,
    STATE,
    STEP_DIR,
    file_entry,
    new_manifest,
    step_of,
)
from lockstep.errors import CheckpointError
from lockstep.run_dir import unwritable_fix

# .tmp-step_..-PID, .tmp-replaced-..-PID, .tmp-latest-PID, ...
TMP_DIR = re.compile(r"^\.tmp-.+-(\d+)$")


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory: that makes its entries (renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, fill: Callable) -> None:
    """Write `path` with fill(f), then fsync it."""
    with open(path, "wb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


def list_checkpoints(run_dir) -> list[Path]:
    """Committed checkpoint dirs of a run, newest step first (unfinished .tmp-* dirs excluded)."""
    root = Path(run_dir) / "checkpoints"
    found = (
        [p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
        if root.is_dir()
        else []
    )
    return sorted(found, key=step_of, reverse=True)


@contextmanager
def explain_write_errors(run_dir, step: int):
    """An OSError a user can fix (read-only filesystem, disk full, no permission) as a CheckpointError that says how."""
    try:
        yield
    except OSError as e:
        fix = unwritable_fix(e)
        if fix is None:
            raise
        raise CheckpointError(
            f"cannot write the checkpoint of step {step} under {Path(run_dir) / 'checkpoints'} "
            f"({e.strerror}: {e.filename}); {fix}; then run again to resume"
        ) from e


def check_save_args(
    step, keep_last, state: dict, extra: dict[str, bytes] | None
) -> tuple[bytes, dict[str, bytes]]:
    """(state.json bytes, extra files) or a CheckpointError saying which argument is wrong."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            f"step {step!r} is not a non-negative int; pass the optimizer step count"
        )
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(
            f"keep_last {keep_last!r} must be an int >= 1; set how many checkpoints to keep"
        )
    extra = dict(extra or {})
    for name, data in extra.items():
        if (
            name in RESERVED
            or not name
            or name.startswith((".", "__"))
            or "/" in name
            or "\\" in name
            or not isinstance(data, (bytes, bytearray))
        ):
            raise CheckpointError(
                f"extra file {name!r} ({type(data).__name__}) is not allowed: pass bytes under a "
                f"plain file name, not hidden, not starting with '__', other than {sorted(RESERVED)}"
            )
    try:
        state_json = json.dumps(state, indent=2, sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"state is not JSON-serializable ({e}); use dicts, lists, str, numbers, None"
        ) from e
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


def write_meta_files(
    tmp: Path,
    rng_states: list | None,
    state_json: bytes,
    extra: dict[str, bytes],
    compression: dict | None = None,
) -> None:
    """rng.pt (one RNG state per rank), grad_compression.pt (its state, when it keeps one), state.json and the extra
    files, each fsynced."""
    if rng_states is not None:
        write_file(tmp / RNG, lambda f: torch.save(list(rng_states), f))
    if compression is not None:
        write_file(tmp / COMPRESSION, lambda f: torch.save(compression, f))
    for name, data in [(STATE, state_json), *extra.items()]:
        write_file(tmp / name, lambda f, data=data: f.write(data))


def seal(
    tmp: Path,
    final: Path,
    step: int,
    known: dict[str, dict] | None = None,
    layout: str | None = None,
) -> None:
    """Write the manifest (size + sha256 of every file in tmp; `known` entries are taken as given; its own
    checksum last), rename into place."""
    known = known or {}
    files = {p.name: known.get(p.name) or file_entry(p) for p in sorted(tmp.iterdir())}
    seal_as(tmp, final, new_manifest(step, files, layout))


def seal_as(tmp: Path, final: Path, manifest: dict) -> None:
    """Write `manifest` into tmp as it is (a sharded snapshot's lists files other nodes hold), rename
    into place."""
    write_file(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    fsync_path(tmp)
    commit_dir(tmp, final)


def move_latest(final: Path, keep_last: int) -> None:
    """Point `latest` at the committed `final` (atomic replace), then prune to keep_last checkpoints."""
    root = final.parent
    latest_tmp = root / f".tmp-latest-{os.getpid()}"
    write_file(latest_tmp, lambda f: f.write((final.name + "\n").encode()))
    os.replace(latest_tmp, root / "latest")
    fsync_path(root)
    _prune(root, final, keep_last)


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename a complete temporary dir to `final`, replacing a committed one of the same step safely."""
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
    fsync_path(final.parent)
    if replacing:
        shutil.rmtree(aside, ignore_errors=True)  # the new one is in; leftovers go at the next save


def _prune(root: Path, saved: Path, keep_last: int) -> None:
    # Keep the one just saved and the keep_last - 1 newest older ones. Newer dirs belong to an
    # abandoned timeline; they are left alone and get replaced as this run saves those steps.
    older = [c for c in list_checkpoints(root.parent) if step_of(c) < step_of(saved)]
    for ckpt in older[keep_last - 1 :]:
        # Rename first so a crash mid-delete leaves a .tmp-* dir, never a half-deleted step_* dir.
        doomed = root / f".tmp-pruned-{ckpt.name}-{os.getpid()}"
        os.rename(ckpt, doomed)
        # best effort (NFS can hold files); retried next save
        shutil.rmtree(doomed, ignore_errors=True)
    for entry in root.iterdir():
        m = TMP_DIR.match(entry.name)
        if m and (int(m[1]) == os.getpid() or not _pid_alive(int(m[1]))):  # never a live saver's
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(
                missing_ok=True
            )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return True
