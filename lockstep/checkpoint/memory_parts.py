"""A sharded layout's in-memory snapshot at a restart: what each node still holds of it, whether the
survivors' parts make it whole, and each node's copy completed from the others'.

lockstep.checkpoint.memory_shards writes the parts: each node holds its own ranks' shards, the
previous node's, and the small files and manifest of the whole snapshot. Here each node offers the
files of its parts that verify (a damaged one is not offered); the newest step whose parts, under one
manifest, hold every file is whole; every node is then sent the files it lacks, from the lowest rank
holding each, and commits its completed copy, which DCP loads (lockstep.train.recovery).

Collectives on the given group (every rank); files under this node's snapshot directory only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lockstep.checkpoint.commit import commit_dir, list_checkpoints, start_save, write_file
from lockstep.checkpoint.manifest import (
    MANIFEST,
    SHARDED,
    STATE,
    read_manifest,
    sha256_file,
    step_of,
)
from lockstep.checkpoint.memory import NodeSnapshots
from lockstep.collectives import broadcast_object, gather_objects
from lockstep.errors import CheckpointError
from lockstep.runtime import Runtime


@dataclass(frozen=True)
class Part:
    """What one node holds of the snapshot of a step: the manifest's checksum, the files it lists
    (and the manifest itself), and those held here that verify."""

    step: int
    manifest: str
    listed: tuple[str, ...]
    held: tuple[str, ...]


def parts_held(node: NodeSnapshots, model: str) -> tuple[list[Part], list[str]]:
    """(the parts of sharded snapshots this node holds, newest first; why each file or snapshot
    was skipped). A file that fails its checksum is not held; a snapshot of another run or model,
    or without its manifest or state, is skipped."""
    parts, skipped = [], []
    for path in list_checkpoints(node.root):
        manifest, problem = read_manifest(path)
        if manifest is None or manifest.get("layout") != SHARDED:
            skipped.append(f"{path}: {problem or 'not a sharded snapshot'}")
            continue
        held, bad = [MANIFEST], []
        for name, entry in sorted(manifest["files"].items()):
            file = path / name
            if not file.is_file():
                continue  # another node's
            ok = file.stat().st_size == entry.get("bytes") and sha256_file(file) == entry["sha256"]
            (held if ok else bad).append(name)
        why = node.mark_problem(path, model) if STATE in held else f"no good {STATE}"
        if why or bad:
            skipped.append(f"{path}: {why or ', '.join(bad) + ' damaged (checksum)'}")
        if why is None:
            listed = (MANIFEST, *sorted(manifest["files"]))
            parts.append(Part(step_of(path), manifest["manifest_sha256"], listed, tuple(held)))
    return parts, skipped


def whole_step(offers: list[list[Part] | None]) -> int | None:
    """The newest step whose parts, one manifest among them, hold every file it lists. offers:
    every rank's parts (None from a rank that is not its node's writer)."""
    by_step: dict[int, list[Part]] = {}
    for parts in offers:
        for part in parts or []:
            by_step.setdefault(part.step, []).append(part)
    for step in sorted(by_step, reverse=True):
        parts = by_step[step]
        if len({p.manifest for p in parts}) == 1 and set(parts[0].listed) <= {
            name for p in parts for name in p.held
        }:
            return step
    return None


def complete(
    rt: Runtime, node: NodeSnapshots, offers: list[list[Part] | None], step: int
) -> tuple[Path, list[int]]:
    """Every rank: each node's snapshot of `step` made whole, each file it lacks sent by the lowest
    rank holding it; (this node's copy, committed; the writers of the nodes that lacked some).
    offers: as whole_step's."""
    held = {
        r: next((p for p in parts if p.step == step), None)
        for r, parts in enumerate(offers)
        if parts is not None
    }
    holders = {r: set(p.held) for r, p in held.items() if p is not None}
    listed = next(p.listed for p in held.values() if p is not None)
    lacking = sorted(r for r in held if not set(listed) <= holders.get(r, set()))
    sources: dict[int, list[str]] = {}
    for name in listed:
        if any(name not in holders.get(r, ()) for r in lacking):
            sources.setdefault(min(r for r, names in holders.items() if name in names), []).append(
                name
            )
    path = node.root / "checkpoints" / f"step_{step:08d}"
    got: dict[str, bytes] = {}
    for src, names in sorted(sources.items()):
        files = {n: (path / n).read_bytes() for n in names} if rt.rank == src else None
        files = broadcast_object(rt, files, src=src)
        if rt.rank in lacking:
            got.update({n: d for n, d in files.items() if n not in holders.get(rt.rank, ())})
    problem = None
    if rt.rank in lacking:
        try:
            _assemble(node, path, step, got)
        except OSError as e:
            problem = f"{type(e).__name__}: {e}"
    errors = gather_objects(rt, problem)  # every node's copy is whole before any rank reads one
    if any(errors):
        raise CheckpointError(
            f"completing the memory snapshot of step {step} failed ("
            + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            + ")"
        )
    return path, lacking


def _assemble(node: NodeSnapshots, path: Path, step: int, got: dict[str, bytes]) -> None:
    """This node's copy of `step` made whole: the files held (linked, not copied) and those `got`,
    committed in place of the partial one."""
    tmp, final = start_save(node.root, step)
    if path.is_dir():
        for file in path.iterdir():
            if file.name not in got and file.is_file():
                os.link(file, tmp / file.name)
    for name, data in got.items():
        write_file(tmp / Path(name).name, lambda f, data=data: f.write(data))
    commit_dir(tmp, final)
