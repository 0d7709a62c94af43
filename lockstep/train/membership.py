"""Who trains this attempt of a run, and what changed since the last one (an elastic job lost or gained nodes).

Each start of `lockstep train` on a run directory is an attempt: the first one, a resume after a stop, or a
restart by torch's elastic agent after a node died or joined. Global rank 0 keeps the last attempt's members in
RUN/membership.json and logs, at each start, how this one differs: which hosts left or joined, the world size
before and now, the batch plan the new world size trains with, and the step it resumed at.

Reads and writes RUN/membership.json on global rank 0; one gather over the control group.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from lockstep.collectives import gather_objects
from lockstep.parallel.mesh import BatchPlan, describe_plans
from lockstep.runtime import Runtime

FILE = "membership.json"


@dataclass(frozen=True)
class Members:
    """The ranks of one attempt: hosts[r] is the host rank r runs on."""

    hosts: list[str]
    step: int  # the step the attempt started at
    restart: int  # torch elastic's restart count on rank 0's node (0 outside torchrun)

    @property
    def world_size(self) -> int:
        return len(self.hosts)


def describe_change(before: Members, now: Members, plan: BatchPlan) -> str | None:
    """One line for a person when the members changed (None when they did not): who left, who joined, the new
    world size and batch plan, and the step training goes on from."""
    old, new = Counter(before.hosts), Counter(now.hosts)
    if old == new:
        return None
    left, joined = old - new, new - old
    parts = []
    if left:
        parts.append("left: " + ", ".join(_ranks_on(host, n) for host, n in sorted(left.items())))
    if joined:
        parts.append(
            "joined: " + ", ".join(_ranks_on(host, n) for host, n in sorted(joined.items()))
        )
    batch = describe_plans({now.world_size: plan})[0].split(": ", 1)[1]
    return (
        f"membership changed since the last attempt ({'; '.join(parts)}): world size {before.world_size} -> "
        f"{now.world_size}, {batch}; resumed at step {now.step}"
    )


def _ranks_on(host: str, n: int) -> str:
    return f"{host} ({n} rank{'s' if n > 1 else ''})"


def note_members(
    rt: Runtime, run_dir: Path, step: int, plan: BatchPlan, log: logging.Logger
) -> str | None:
    """Every rank calls this once per start; rank 0 logs what changed since the last attempt and records this one.
    Returns the change line on rank 0 (None elsewhere, or when nothing changed)."""
    hosts = gather_objects(rt, rt.hostname)
    if not rt.is_main:
        return None
    now = Members(
        hosts=list(hosts), step=step, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    )
    path = run_dir / FILE
    before = _read(path)
    change = describe_change(before, now, plan) if before else None
    if change:
        log.warning(change)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{FILE}-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(now), indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file
    return change


def _read(path: Path) -> Members | None:
    try:
        data = json.loads(path.read_text())
        return Members(
            hosts=[str(h) for h in data["hosts"]],
            step=int(data["step"]),
            restart=int(data["restart"]),
        )
    # none yet, or from another version: nothing to compare
    except (OSError, ValueError, KeyError, TypeError):
        return None
