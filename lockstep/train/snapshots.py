"""The run's in-memory snapshots on this node: taken every K steps, read first by a restart.

A plain layout (one process, DDP) holds the whole state on every rank, so one rank per node (the
lowest on its host) writes the node's snapshot, and its rng.pt holds every rank's RNG (gathered, as a
checkpoint's). Every node then has a whole copy: any node can be lost while one survives, with no
copy sent over the network while training; a node that joins is sent one (lockstep.train.recovery).
In a sharded layout (FSDP, TP, PP) no rank holds the whole state: every rank writes its shards into
its node's memory, and each node's shards are copied to the next node
(lockstep.checkpoint.memory_shards), so any one node can be lost.

The Checkpointer takes the snapshots (snapshot()); lockstep.train.recovery opens them at the start
of an attempt and reads them. docs/architecture.md, "In-memory snapshots".
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import uuid
from pathlib import Path

from lockstep.checkpoint.background import BackgroundWriter, start_plain_save
from lockstep.checkpoint.manifest import SNAPSHOT_MARK
from lockstep.checkpoint.memory import RUN_ID, NodeSnapshots
from lockstep.checkpoint.memory_shards import room_needed, start_snapshot
from lockstep.checkpoint.staging import tensors_in
from lockstep.collectives import all_reduce_max, gather_objects
from lockstep.errors import CheckpointError
from lockstep.metrics import held_bytes
from lockstep.runtime import Runtime

# auto: the share of the training time snapshots may take, and how many are timed before K is chosen
BUDGET = 0.02
TIMED = 4


class MemorySnapshots:
    """This node's snapshots of the run. Every rank calls due() and took() at the same steps (a
    snapshot gathers the RNG states); in a plain layout the node's writer (its lowest rank) alone
    writes, in a thread of its own.

    interval None is auto: the first TIMED snapshots are taken at every step and timed, then every
    rank agrees on the interval that keeps their cost within BUDGET of the steps between them.
    hosts (every rank's) and group (a gloo group for the background's collectives) mean a sharded
    layout: every rank writes its shards, in a thread of its own (write_shards).
    """

    def __init__(
        self,
        node: NodeSnapshots,
        rt: Runtime,
        *,
        writes: bool,
        interval: int | None,
        model: str,
        log: logging.Logger,
        hosts: list[str] | None = None,
        group: object = None,
    ) -> None:
        self.node, self.rt, self.writes, self.interval, self.model = (
            node,
            rt,
            writes,
            interval,
            model,
        )
        self.log, self.hosts = log, hosts
        self.sharded = hosts is not None
        self.on = True  # False once a failure turned them off (on every node, in a sharded layout)
        self.writer = BackgroundWriter(rt, group) if writes or self.sharded else None
        self.size = 0  # bytes of the last snapshot written
        self._costs: list[float] = []  # seconds the step path spent on each timed snapshot
        self._writes: list[float] = []  # seconds each timed snapshot took in the background
        self._waits: list[float] = []  # seconds the step path waited for it, while timing
        self._calls: list[float] = []  # when each timed snapshot began

    def due(self, step: int) -> bool:
        return self.interval is None or step % self.interval == 0

    def write(self, step: int, what: dict, tensors: dict, optimizer_state: dict, **rest) -> None:
        """The writer: this node's snapshot of `step`, copied to host memory here, committed in the
        background (after the one before it). A failed write, or no room for one, turns this node's
        snapshots off with one warning: recovery then reads the disk checkpoints."""
        assert self.writer is not None, "only the node's writer writes"
        if not self.settle():
            return
        need = sum(t.numel() * t.element_size() for t in tensors_in((tensors, optimizer_state)))
        free = self.node.free_bytes()
        if free < 2 * need:  # the snapshot before it stays until this one commits
            self._off(
                f"{self.node.memory_dir} has {free / 2**20:.0f} MiB free, and a snapshot needs "
                f"{need / 2**20:.0f} MiB twice over while the next one is written"
            )
            return
        state = {**what["state"], SNAPSHOT_MARK: self.node.mark(self.model)}
        start_plain_save(
            self.writer,
            **{**what, "state": state, "run_dir": self.node.root, "keep_last": 1},
            tensors=tensors,
            optimizer_state=optimizer_state,
            **rest,
        )
        self.size = need

    def write_shards(self, what: dict, model, optimizer, compression: dict | None) -> None:
        """Every rank of a sharded layout: its part of the snapshot of what["step"], copied to host
        memory here, written and committed on every node in the background. No room on a node, or a
        failure anywhere, turns the snapshots off on every node with one warning."""
        from lockstep.checkpoint.sharded import saved_state

        if not self.settle():
            return
        to_save = saved_state(model, optimizer)
        free = self.node.free_bytes() if self.writes else None
        rooms = gather_objects(self.rt, (sum(map(held_bytes, tensors_in(to_save))), free))
        needs = room_needed(self.hosts, [need for need, _ in rooms])
        short = [
            f"{host} has {room / 2**20:.0f} MiB free in {self.node.memory_dir}, and a snapshot needs "
            f"{needs[host] / 2**20:.0f} MiB there twice over while the next one is written"
            for host, (_, room) in zip(self.hosts, rooms)
            if room is not None and room < 2 * needs[host]
        ]
        if short:
            return self._off("; ".join(short))
        state = {**what["state"], SNAPSHOT_MARK: self.node.mark(self.model)}
        try:
            start_snapshot(
                self.writer,
                self.node,
                self.rt,
                to_save,
                hosts=self.hosts,
                what={**what, "state": state},
                compression=compression,
            )
        except CheckpointError as e:  # raised on every rank alike
            return self._off(str(e))
        self.size = needs[self.rt.hostname]

    def took(self, began: float) -> None:
        """Every rank, after each snapshot (or its turn, on a node that writes none): while auto is
        timing, note what it cost the step path; after the last timed one, agree on the interval."""
        if self.interval is not None:
            return
        self._calls.append(began)
        self._costs.append(time.perf_counter() - began)
        # timing: the write ends here, its wait not counted as the step's
        if self.writer is not None:
            waited = time.perf_counter()
            self.settle()
            self._waits.append(time.perf_counter() - waited)
            self._writes.append(self.writer.seconds)
        if len(self._calls) == TIMED:
            self.interval = self._agree()

    def close(self, finished: bool) -> None:
        """The end of this attempt: wait for the write in flight; a finished (or stopped, hence
        committed) run removes its snapshots, a failed one keeps them for its restart."""
        if self.writer is None:
            return
        self.settle()
        if finished:
            self.node.clear()

    def _agree(self) -> int:
        """The interval every rank takes: the smallest that keeps a snapshot's cost (the step path's,
        and on a CPU the background's, which shares its cores) within BUDGET of the steps it covers."""
        waits = self._waits or [0.0] * TIMED
        steps = [
            b - a - cost - wait
            for a, b, cost, wait in zip(self._calls, self._calls[1:], self._costs, waits)
        ]
        step = max(statistics.median(steps), 1e-6)
        cost = min(self._costs[1:]) + (min(self._writes[1:] or [0.0]) if _on_cpu(self.rt) else 0.0)
        interval = int(all_reduce_max(self.rt, float(max(1, math.ceil(cost / (BUDGET * step))))))
        if self.rt.is_main:
            self.log.info(
                "memory snapshots: every %d step(s) in %s (one costs %.1f ms, a step %.1f ms; "
                "%.0f MiB per node)",
                interval,
                self.node.memory_dir,
                1000 * cost,
                1000 * step,
                self.size / 2**20,
            )
        return interval

    def settle(self) -> bool:
        """Wait for the write in flight; False (and snapshots off on this node, or on every node in
        a sharded layout, whose failures every rank learns) if one failed."""
        if self.on and self.writer is not None:
            _, error = self.writer.outcome()
            if error:
                self._off(error.replace("checkpoint", "memory snapshot"))
        return self.on if self.sharded else self.writes

    def _off(self, why: str) -> None:
        self.writes = self.on = False
        self.log.warning(
            "memory snapshots off on %s: %s; a restart reads the disk checkpoints instead",
            self.rt.hostname,
            why,
        )


def run_id(run_dir: Path, fresh: bool) -> str:
    """RUN/run_id, made at the run's first start and again when it starts over (--resume none), so
    that snapshots of another run, or of this one before it started over, are never read."""
    path = run_dir / RUN_ID
    if not fresh and path.is_file():
        return path.read_text().strip()
    run_dir.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex[:16]
    tmp = path.with_name(f".tmp-{RUN_ID}")
    tmp.write_text(new + "\n")
    tmp.replace(path)
    return new


def _on_cpu(rt: Runtime) -> bool:
    return rt.device.type == "cpu"
