"""A sharded layout's in-memory snapshot: every rank's shards in its node's memory, and each node's
also on the next node, so that the loss of any one node loses no shard.

Under FSDP, TP or PP every rank holds a part of the state that no other rank holds. A snapshot of a
step is DCP's files, as a sharded checkpoint's (lockstep.checkpoint.sharded): each rank writes its
shards into a temporary dir of its node's snapshot directory (lockstep.checkpoint.memory), rank 0's
node gets DCP's index. In the background, the ranks report their shards' checksums, rank 0 writes
the small files (state.json, rng.pt, the extra files) and the manifest of the whole snapshot and
sends them to every node, and each node's writer (its lowest rank) sends its node's shards to the
next node's writer in ring order (nodes in the order of their lowest rank) before it commits. A
node's snapshot is partial: its own shards, the previous node's, and the manifest listing all.

A restart puts the survivors' parts together (lockstep.checkpoint.memory_parts) and loads them with
DCP, which reshards to the new world size. docs/architecture.md, "In-memory snapshots".

Every rank calls the functions with collectives (on the group given, point to point between the
node writers); files under this node's snapshot directory only.
"""

from __future__ import annotations

import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lockstep.checkpoint.background import BackgroundWriter, async_shards
from lockstep.checkpoint.commit import (
    check_save_args,
    list_checkpoints,
    move_latest,
    seal_as,
    start_save,
    write_file,
    write_meta_files,
)
from lockstep.checkpoint.manifest import (
    SHARDED,
    file_entry,
    new_manifest,
    step_of,
)
from lockstep.checkpoint.memory import NodeSnapshots
from lockstep.collectives import gather_objects, run_on_main
from lockstep.errors import CheckpointError
from lockstep.runtime import Runtime


def writers(hosts: list[str]) -> list[int]:
    """The node writers' ranks (the lowest rank on each host), in ring order. hosts: every rank's."""
    return [hosts.index(host) for host in dict.fromkeys(hosts)]


def is_writer(hosts: list[str], rank: int) -> bool:
    return rank in writers(hosts)


def room_needed(hosts: list[str], needs: list[int]) -> dict[str, int]:
    """Bytes each node holds of one snapshot: its ranks' shards and the previous node's."""
    own = {host: 0 for host in hosts}
    for host, need in zip(hosts, needs):
        own[host] += need
    ring = list(own)
    return {host: own[host] + own[ring[i - 1]] * (len(ring) > 1) for i, host in enumerate(ring)}


@dataclass(frozen=True)
class Snapshot:
    """A sharded snapshot being written: what every rank knows of it."""

    node: NodeSnapshots
    hosts: list[str]  # every rank's host
    step: int
    tmp: Path  # this node's temporary dir
    rng_states: list | None
    compression: dict | None
    small: tuple[bytes, dict[str, bytes]] | None  # rank 0's: state.json and the extra files

    def fail(self, rt: Runtime, phase: str, errors: list) -> CheckpointError:
        if is_writer(self.hosts, rt.rank):
            shutil.rmtree(self.tmp, ignore_errors=True)
        return CheckpointError(
            f"the memory snapshot of step {self.step} failed while {phase} ("
            + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            + ")"
        )


def start_snapshot(
    writer: BackgroundWriter,
    node: NodeSnapshots,
    rt: Runtime,
    to_save: dict,
    *,
    hosts: list[str],
    what: dict,
    compression: dict | None = None,
) -> None:
    """Every rank: this rank's part of the snapshot of what["step"] (`to_save`, its DCP state dict)
    copied to host memory by DCP's async_save, then written and committed on every node in the
    background (writer.group's collectives). `what`: the save's step, state (marked a snapshot), rng
    states and extra files. A failure up to the background raises CheckpointError on every rank."""
    step, writes = what["step"], hosts.index(rt.hostname) == rt.rank
    made, problem, small = None, None, None
    try:
        if rt.is_main:  # a wrong argument fails here, in the step path
            small = check_save_args(step, 1, what["state"], what["extra"])
        if writes:
            # every node committed the snapshot before (its background ended with all of them):
            # the one before that goes, and this one is written beside the newest
            held = list_checkpoints(node.root)
            if held:
                node.keep_only(step_of(held[0]))
            made = str(start_save(node.root, step)[0])
    except (OSError, ValueError, CheckpointError) as e:
        problem = f"{type(e).__name__}: {e}"
    made_by = gather_objects(rt, (made, problem))
    tmp = Path(made_by[hosts.index(rt.hostname)][0] or node.root / "unmade")
    snap = Snapshot(node, hosts, step, tmp, what["rng_states"], compression, small)
    if any(p for _, p in made_by):
        raise snap.fail(rt, "making its directories", [p for _, p in made_by])
    written, errors = async_shards(writer, rt, step, to_save, tmp, pinned=False)
    if any(errors):
        raise snap.fail(rt, "copying the state to host memory", errors)
    writer.start(step, lambda: _commit(writer.rt, snap, written.result))


def _commit(rt: Runtime, snap: Snapshot, write) -> Path:
    """The background half, every rank (rt: the writer's group): the shards written and reported, the
    small files and the manifest from rank 0, the ring copy, every node's commit."""
    from torch.distributed.checkpoint.api import CheckpointException

    problem, shards = None, {}
    try:
        write()
        shards = {p.name: file_entry(p) for p in snap.tmp.glob(f"__{rt.rank}_*")}
    except (Exception, CheckpointException) as e:  # DCP raises its own on every rank
        problem = f"{type(e).__name__}: {str(e).strip()[:2000]}"
    reports = gather_objects(rt, (problem, shards))
    if any(p for p, _ in reports):
        raise snap.fail(rt, "writing the shards", [p for p, _ in reports])
    known = {name: entry for _, files in reports for name, entry in files.items()}
    (manifest, small), error = run_on_main(rt, lambda: _small_files(snap, known))
    if error:
        raise snap.fail(rt, "writing its state on rank 0", [f"{type(error).__name__}: {error}"])
    writes = is_writer(snap.hosts, rt.rank)
    ours = [name for name in known if int(name[2:].split("_")[0]) in _ranks_on(snap, rt.hostname)]
    problem = ring_exchange(rt, snap.hosts, [snap.tmp / name for name in sorted(ours)], snap.tmp)
    final = None
    if writes and problem is None:
        try:
            for name, data in small.items():
                if not (snap.tmp / name).exists():
                    write_file(snap.tmp / name, lambda f, data=data: f.write(data))
            final = snap.tmp.parent / f"step_{snap.step:08d}"
            seal_as(snap.tmp, final, manifest)
            move_latest(final, keep_last=2)  # the one before goes when the next one starts
        except OSError as e:
            problem = f"{type(e).__name__}: {e}"
    errors = gather_objects(rt, problem)
    if any(errors):
        raise snap.fail(rt, "committing it", errors)
    return final or snap.tmp.parent / f"step_{snap.step:08d}"


def _ranks_on(snap: Snapshot, host: str) -> set[int]:
    return {r for r, h in enumerate(snap.hosts) if h == host}


def _small_files(snap: Snapshot, known: dict[str, dict]) -> tuple[dict, dict[str, bytes]]:
    """Rank 0: state.json, rng.pt and the extra files written beside DCP's index; (the manifest of
    the whole snapshot, the bytes of every file but the shards)."""
    state_json, extra = snap.small
    write_meta_files(snap.tmp, snap.rng_states, state_json, extra, snap.compression)
    names = sorted(p.name for p in snap.tmp.iterdir() if not p.name.startswith("__"))
    small = {name: (snap.tmp / name).read_bytes() for name in names}
    files = {**known, **{name: file_entry(snap.tmp / name) for name in names}}
    return new_manifest(snap.step, dict(sorted(files.items())), SHARDED), small


def ring_exchange(rt: Runtime, hosts: list[str], files: list[Path], into: Path) -> str | None:
    """Node writers: send `files` to the next node's writer and write what the previous node's sends
    into the dir `into`; what failed to be written, or None. Point to point on
    rt.control_group, one file at a time each way: torch's collectives would send every node's
    files to every node, and a node's shards can be most of its memory."""
    ring = writers(hosts)
    if len(ring) < 2 or rt.rank not in ring:
        return None
    i = ring.index(rt.rank)
    nxt, prev = ring[(i + 1) % len(ring)], ring[i - 1]
    listed = _swap(rt, nxt, prev, pickle.dumps([(f.name, f.stat().st_size) for f in files]))
    coming, problem = pickle.loads(listed), None
    for k in range(max(len(files), len(coming))):
        out = torch.from_numpy(np.fromfile(files[k], dtype=np.uint8)) if k < len(files) else None
        got = torch.empty(coming[k][1], dtype=torch.uint8) if k < len(coming) else None
        _exchange(rt, (out, nxt), (got, prev), tag=k)
        try:  # on a failure, the rest is still received: the sender waits for it
            if got is not None and problem is None:
                write_file(into / Path(coming[k][0]).name, lambda f, got=got: f.write(got.numpy()))
        except OSError as e:
            problem = f"{type(e).__name__}: {e}"
    return problem


def _swap(rt: Runtime, nxt: int, prev: int, data: bytes) -> bytes:
    """Send `data` to rank nxt, return what rank prev sent."""
    size, got = torch.tensor([len(data)]), torch.zeros(1, dtype=torch.int64)
    _exchange(rt, (size, nxt), (got, prev))
    buffer = torch.empty(int(got.item()), dtype=torch.uint8)
    _exchange(rt, (torch.frombuffer(bytearray(data), dtype=torch.uint8), nxt), (buffer, prev))
    return buffer.numpy().tobytes()


def _exchange(rt: Runtime, send: tuple, recv: tuple, tag: int = 0) -> None:
    """A send and a receive at once (a tensor of None: none that way), both waited for."""
    works = []
    if send[0] is not None:
        works.append(dist.isend(send[0], send[1], group=rt.control_group, tag=tag))
    if recv[0] is not None:
        works.append(dist.irecv(recv[0], recv[1], group=rt.control_group, tag=tag))
    for work in works:
        work.wait()
