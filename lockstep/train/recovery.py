"""Where an attempt starts: from memory when the nodes' snapshots can serve, else from disk.

At the start of every attempt (a restart by torch's elastic agent after a worker or a node was lost
or joined, or a new command on the same run) the ranks agree on the newest step for which a whole,
verified snapshot of this run and model exists in some node's memory (lockstep.train.snapshots). If
it is not older than the newest committed checkpoint on disk, every node loads it; a node that lacks
it (one that joined, or lost its memory) is sent its files first. Otherwise the attempt resumes from
disk. Either way the data cursor is the one saved with the state, re-cut for the new world size as a
disk resume re-cuts it (docs/architecture.md, "In-memory snapshots"), and rank 0 logs which was used
and how many steps are trained again.

Collectives on the control group; reads RUN/run_id and RUN/metrics.jsonl, writes under memory_dir.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from lockstep.checkpoint.manifest import STEP_DIR, step_of
from lockstep.checkpoint.memory import RUN_ID, Found, NodeSnapshots, fingerprint, fingerprint_of
from lockstep.checkpoint.memory_parts import Part, complete, parts_held, whole_step
from lockstep.checkpoint.plain import Checkpoint
from lockstep.checkpoint.resume import resume_order
from lockstep.collectives import broadcast_object, computed_once, gather_objects
from lockstep.config import CheckpointConfig, Config
from lockstep.runtime import Runtime, side_group
from lockstep.train.snapshots import MemorySnapshots, run_id
from lockstep.train.state import pick_resume_point
from lockstep.train.trainee import Trainee


def open_snapshots(cfg: Config, trainee: Trainee, log: logging.Logger) -> MemorySnapshots | None:
    """Every rank: this attempt's memory snapshots, or None where they are off."""
    c, rt = cfg.checkpoint, trainee.rt
    off = c.memory_interval == 0 or (c.memory_interval == "auto" and rt.max_restarts == 0)
    if off:
        _forget(Path(c.output_dir), Path(c.memory_dir), rt.hostname)
        return None
    run_dir = Path(c.output_dir)
    rid = computed_once(rt, lambda: run_id(run_dir, fresh=c.resume == "none"))
    hosts = gather_objects(rt, rt.hostname)
    sharded = trainee.layout.sharded_checkpoints
    model = _model_shape(trainee) if sharded else fingerprint(trainee.workload.checkpoint_tensors())
    return MemorySnapshots(
        NodeSnapshots(Path(c.memory_dir), rid, rt.hostname),
        rt,
        writes=hosts.index(rt.hostname) == rt.rank,  # the lowest rank on each host
        interval=None if c.memory_interval == "auto" else c.memory_interval,
        model=model,
        log=log,
        hosts=hosts if sharded else None,
        group=side_group(rt, cfg.distributed.timeout_seconds) if sharded else None,
    )


def _model_shape(trainee: Trainee) -> str:
    """A sharded layout's fingerprint: every rank's tensors' names, global shapes and dtypes (a
    pipeline stage holds some of them), gathered."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    mine = [
        (k, list(t.shape), str(t.dtype)) for k, t in get_model_state_dict(trainee.model).items()
    ]
    return fingerprint_of(
        {x[0]: x for held in gather_objects(trainee.rt, mine) for x in held}.values()
    )


def _forget(run_dir: Path, memory_dir: Path, host: str) -> None:
    """An attempt that takes no snapshots removes this node's of the run: a later attempt that takes them
    again must not find ones from before the timeline this attempt trains (every rank may try; no
    collective)."""
    try:
        rid = (run_dir / RUN_ID).read_text().strip()
    except OSError:  # a run that never took any
        return
    if rid:
        NodeSnapshots(memory_dir, rid, host).clear()


@dataclass(frozen=True)
class Held:
    """What the nodes' memory holds: this node's newest usable snapshot, and every rank's (host,
    step of its node's newest, or None). A sharded layout's: every node writer's parts instead
    (lockstep.checkpoint.memory_parts), and by_rank's step is the newest its node holds a part of."""

    found: Found | None
    by_rank: list[tuple[str, int | None]]
    parts: list[list[Part] | None] | None = None

    @property
    def best(self) -> int | None:
        if self.parts is not None:
            return whole_step(self.parts)
        return max((step for _, step in self.by_rank if step is not None), default=None)


def gather_held(snapshots: MemorySnapshots, auto: bool, log: logging.Logger) -> Held:
    """Every rank: what each node's memory can serve (nothing unless --resume auto), agreed."""
    found, parts, skipped = None, None, []
    if snapshots.writes and snapshots.sharded:
        parts, skipped = parts_held(snapshots.node, snapshots.model) if auto else ([], [])
    elif snapshots.writes and auto:
        found, skipped = snapshots.node.newest(snapshots.model)
    for why in skipped:
        log.warning("memory snapshot skipped: %s", why)
    newest = found.step if found else parts[0].step if parts else None
    by_rank = gather_objects(snapshots.rt, (snapshots.rt.hostname, newest, parts))
    steps = [(host, step) for host, step, _ in by_rank]
    return Held(found, steps, [p for *_, p in by_rank] if snapshots.sharded else None)


def start_point(
    snapshots: MemorySnapshots | None,
    checkpoint: CheckpointConfig,
    rt: Runtime,
    log: logging.Logger,
) -> tuple[Checkpoint | Path | None, Path | None]:
    """Every rank: (the snapshot this attempt starts from, or None; the committed checkpoint on disk
    it resumes from, or the newest one, which memory supersedes). Memory first: with --resume auto,
    the disk checkpoint is verified (every file hashed, on rank 0) only when no node's snapshot is
    as new as the newest one committed, so a recovery from memory does not read the disk at all."""
    run_dir = Path(checkpoint.output_dir)
    if snapshots is None or checkpoint.resume != "auto":
        disk = pick_resume_point(checkpoint, rt, run_dir, log)
        return (recover(snapshots, disk, checkpoint, log) if snapshots else None), disk
    held = gather_held(snapshots, True, log)
    newest = computed_once(rt, lambda: next(iter(resume_order(run_dir)[0]), None))
    if held.best is None or (_step_of(newest) or 0) > held.best:
        newest = pick_resume_point(checkpoint, rt, run_dir, log)  # may fall back past a damaged one
    return recover(snapshots, newest, checkpoint, log, held), newest


def recover(
    snapshots: MemorySnapshots,
    disk: Path | None,
    checkpoint: CheckpointConfig,
    log: logging.Logger,
    held: Held | None = None,
) -> Checkpoint | Path | None:
    """Every rank: the snapshot this attempt starts from, read (a sharded layout's: this node's copy
    made whole, which DCP loads); None to start from `disk` (the committed checkpoint picked for
    --resume, or None). Only --resume auto reads memory; any other start clears the nodes'
    snapshots, which would otherwise hold another timeline. `held`: what the nodes hold, when
    start_point has gathered it already."""
    rt, node, auto = snapshots.rt, snapshots.node, checkpoint.resume == "auto"
    held = held or gather_held(snapshots, auto, log)
    best = held.best
    disk_step = _step_of(disk)
    if best is None or (disk_step is not None and best < disk_step):
        if snapshots.writes:
            node.clear()
        if rt.is_main and auto and best is not None:
            log.info(
                "recovery: the newest memory snapshot (step %d) is older than the checkpoint of "
                "step %d; resuming from disk",
                best,
                disk_step,
            )
        return None
    copy = _plain_copy if held.parts is None else _sharded_copy
    snapshot, holders, lacking = copy(snapshots, held, best)
    if rt.is_main:
        reached = _last_logged_step(Path(checkpoint.output_dir) / "metrics.jsonl")
        log.warning(
            "recovery: from memory, the snapshot of step %d (held by %s%s); the newest disk "
            "checkpoint is %s, so %d step(s) are not trained again; %s",
            best,
            ", ".join(holders),
            f"; sent to {', '.join(lacking)}" if lacking else "",
            f"step {disk_step}" if disk_step is not None else "none",
            best - (disk_step or 0),
            f"{max(0, reached - best)} step(s) are (metrics.jsonl's last step: {reached})"
            if reached is not None
            else "no step was logged before",
        )
    return snapshot


def _plain_copy(snapshots: MemorySnapshots, held: Held, best: int) -> tuple[Checkpoint, list, list]:
    """Every rank: the snapshot of `best` on every node, read; (it, the nodes that held it, those
    sent it: one that joined, or lost its memory, gets its files from the lowest rank holding it)."""
    rt, node, offered = snapshots.rt, snapshots.node, held.by_rank
    holders = sorted({host for host, step in offered if step == best})
    lacking = sorted({host for host, _ in offered} - set(holders))
    if lacking:
        src = next(r for r, (_, step) in enumerate(offered) if step == best)
        files = broadcast_object(rt, node.files(held.found) if rt.rank == src else None, src=src)
        if snapshots.writes and (held.found is None or held.found.step != best):
            node.receive(best, files)
    if snapshots.writes:
        node.keep_only(best)
    gather_objects(rt, None)  # every node's copy is in place before any rank reads one
    return node.read(Found(best, node.root / "checkpoints" / f"step_{best:08d}")), holders, lacking


def _sharded_copy(snapshots: MemorySnapshots, held: Held, best: int) -> tuple[Path, list, list]:
    """Every rank: each node's copy of the sharded snapshot of `best` made whole, each node sent the
    files it lacks (lockstep.checkpoint.memory_shards.complete); (this node's, which DCP loads, the
    nodes that held parts of it, those sent some)."""
    path, short = complete(snapshots.rt, snapshots.node, held.parts, best)
    if snapshots.writes:
        snapshots.node.keep_only(best)
    hosts = [host for host, _ in held.by_rank]
    holders = {
        hosts[r] for r, parts in enumerate(held.parts) if any(p.step == best for p in parts or [])
    }
    return path, sorted(holders), sorted(hosts[r] for r in short)


def _step_of(path: Path | None) -> int | None:
    """The step of a committed step_NNNNNNNN dir; None for none, or a checkpoint named otherwise."""
    return step_of(path) if path is not None and STEP_DIR.match(path.name) else None


def _last_logged_step(path: Path) -> int | None:
    """The last train step metrics.jsonl recorded (written by global rank 0 at each log line)."""
    last = None
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the line being written when its process died
            continue
        if record.get("split", "train") == "train":
            last = record["step"]
    return last
