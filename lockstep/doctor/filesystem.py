"""The output dir in the doctor: every rank writes, fsyncs and lists a marker there, removes it.

`probe_filesystem` runs on every rank (it takes barriers); the checks are pure functions of what
every rank saw: whether it could write, whether the ranks share the directory (rank 0 alone writes
checkpoints, every rank reads them on resume), and the free space.

Thresholds, chosen here: free disk under the output dir warns below 5 GiB and fails below 1 GiB
(one checkpoint of a 1B-parameter model with Adam state is ~16 GB; 1 GiB does not hold even a
small run's checkpoints and logs).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from lockstep.doctor.report import Check, GiB, by_value, format_size, span, where
from lockstep.runtime import Runtime

DISK_WARN, DISK_FAIL = 5 * GiB, 1 * GiB


def probe_filesystem(rt: Runtime, out: Path, nonce: str) -> dict:
    """Write a marker, fsync, wait for all, list whose markers this rank sees, clean up."""
    markers = out / ".doctor"
    mine = markers / f"{rt.hostname}-{rt.rank}-{nonce}"
    # the first directory the doctor creates here: removed after
    missing = next((p for p in [*reversed(out.parents), out] if not p.exists()), None)
    if rt.distributed:
        # every rank has looked before any creates: all agree on what the doctor made
        dist.barrier()
    error, errno_ = None, None
    try:
        markers.mkdir(parents=True, exist_ok=True)
        fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, f"{rt.rank}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        dfd = os.open(markers, os.O_RDONLY)  # the directory entry must reach the server too
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        error, errno_ = (f"{e.strerror}: {e.filename}" if e.filename else str(e)), e.errno
    if rt.distributed:
        dist.barrier()
    try:
        seen = sorted(
            int(name.rsplit("-", 2)[1])
            for name in os.listdir(markers)
            if name.endswith(f"-{nonce}")
        )
    except OSError:
        seen = []
    existing = next(p for p in [out, *out.parents] if p.exists())
    # before the barrier: after it, other ranks remove what they created
    free = shutil.disk_usage(existing).free
    if rt.distributed:
        dist.barrier()  # everyone has listed before anyone removes
    try:
        mine.unlink(missing_ok=True)
    except OSError:  # e.g. a path through a regular file: nothing was written
        pass
    if rt.distributed:
        dist.barrier()  # every marker is gone before any rank removes the directories
    for d in [markers, out, *out.parents] if missing is not None else [markers]:
        try:
            d.rmdir()  # only empty directories: another rank's marker or the user's files keep them
        except OSError:
            pass
        if d == missing:
            break
    return {
        "error": error,
        "errno": errno_,
        "seen": seen,
        "free_bytes": free,
        "disk_path": str(existing),
    }


def check_writable(facts: list[dict], out: str) -> Check:
    errs = [f["rank"] for f in facts if f["fs"]["error"]]
    if errs:
        fs = facts[errs[0]]["fs"]
        why = {
            errno.ENOTDIR: f"{fs['disk_path']} is a file, not a directory",
            errno.EACCES: f"fix the permissions of {fs['disk_path']} for this user",
            errno.EPERM: f"fix the permissions of {fs['disk_path']} for this user",
            errno.EROFS: f"{fs['disk_path']} is on a read-only filesystem",
            errno.ENOSPC: f"the filesystem of {fs['disk_path']} is full",
        }.get(fs["errno"], fs["error"])
        return Check(
            "output dir writable",
            "fail",
            f"{out} cannot be written on {where(facts, errs)}: {fs['error']}",
            "pass --output-dir a directory every rank can create and write (the same as `lockstep "
            f"train --output-dir`); here {why}",
        )
    return Check(
        "output dir writable", "ok", f"every rank wrote and fsynced a marker in {out}/.doctor"
    )


def check_shared(facts: list[dict], out: str) -> Check:
    ok_ranks = [f["rank"] for f in facts if not f["fs"]["error"]]
    if len(ok_ranks) < 2:
        return Check("shared filesystem", "skip", "fewer than 2 ranks could write a marker")
    groups = by_value([facts[r] for r in ok_ranks], lambda f: tuple(f["fs"]["seen"]))
    if len(groups) == 1 and list(next(iter(groups))) == ok_ranks:
        return Check(
            "shared filesystem", "ok", f"{span(ok_ranks)} share {out} (each sees every marker)"
        )
    parts = []
    for seen, ranks in groups.items():
        if list(seen) == ranks == [ranks[0]]:
            parts.append(
                f"rank {ranks[0]} (host {facts[ranks[0]]['host']}) sees no other rank's marker: "
                "not shared"
            )
        else:
            parts.append(f"{where(facts, ranks)} see the markers of {span(seen)}")
    return Check(
        "shared filesystem",
        "warn",
        "; ".join(parts),
        "rank 0 alone writes checkpoints and every rank reads them on resume: put --output-dir on "
        "a filesystem every node mounts at the same path (NFS, Lustre, ...)",
    )


def check_disk(facts: list[dict]) -> Check:
    low = min(facts, key=lambda f: f["fs"]["free_bytes"])
    free, path = low["fs"]["free_bytes"], low["fs"]["disk_path"]
    detail = (
        f"{format_size(free)} free on {path} (lowest, rank {low['rank']} on host {low['host']})"
    )
    fix = (
        f"free space on {path} or point --output-dir at a larger filesystem: one checkpoint of a "
        "1B-parameter model with Adam state takes ~16 GB"
    )
    if free < DISK_FAIL:
        return Check("free disk", "fail", detail + f"; below {format_size(DISK_FAIL)}", fix)
    if free < DISK_WARN:
        return Check("free disk", "warn", detail + f"; below {format_size(DISK_WARN)}", fix)
    return Check("free disk", "ok", detail)
