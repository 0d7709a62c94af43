"""The rank that holds the others back, and why: from every rank's step times (lockstep.train.step_clock).

In a synchronous step every rank waits, in the gradient all-reduce, for the slowest one; a rank's
own time per step is what it spent on anything but that wait. The rank with the most is behind when
its own time is more than `margin` (and MIN_EXCESS_S) above the median of the other ranks'; its
cause is the phase where it spends the most more than they do (data, compute, optimizer,
checkpoint, other). Log windows are pooled until they cover MIN_STEPS steps before they are
compared (one step's time is mostly noise), and a rank behind, for one cause, in `patience` comparisons in a row gets one WARNING naming it, its
node, its local rank and the fix that fits the cause.

The default margin, 0.5, is measured (BENCHMARKS.md, "Straggler margin: fault-free runs"): in 8
fault-free 500-step runs of 2 ranks on this project's 2-core machines, idle and beside 1 or 2 other
jobs, a rank's own time reached 1.74x the other's in single 10-step windows and stayed above 1.3x
for up to 5 windows in a row, never above 1.5x for 2.

A slow link holds every rank back alike, so no rank's own time shows it. When no rank is behind and
communication is most of the median rank's step, every rank times its incoming ring link as `lockstep doctor` does
(lockstep.train.links: a go, then 512 KiB back, 5 rounds), at most once every PROBE_EVERY
comparisons (the probe adds its own bytes to a link that is the bottleneck already); a link more than
1.5x slower than the others of its kind is named at once, in a WARNING (its 5 rounds are the
evidence a streak of comparisons is for a rank), once per link. train.probe_links=false turns the
probe off (a benchmark that counts a link's bytes).

Every rank gathers (one all-gather per log line) and compares alike, so that all of them probe the
links together; rank 0 alone logs.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Callable

from lockstep.collectives import gather_objects
from lockstep.runtime import Runtime
from lockstep.train.links import SLOW_LINK_FIX, probe_ring, slow_links
from lockstep.train.step_clock import PHASES, WAITS, RankTimes, StepClock, gather_times

MIN_STEPS = 10  # steps a comparison covers at least: log windows are pooled up to it
# A rank is behind only by more than this much of its own time per step as well: a small model's
# step of a few ms is shaken by the scheduler alone (fault-free 500-step runs of the tiny GPT on 2
# ranks beside 3 busy processes on 2 cores read 1.5-1.9x, 4-8 ms more: BENCHMARKS.md, "Straggler
# margin"), while a fault worth a warning costs tens of ms a step or more.
MIN_EXCESS_S = 0.010
PROBE_EVERY = 10  # comparisons between two probes of the links


def pooled(pool: list[RankTimes], times: list[RankTimes]) -> list[RankTimes]:
    """`times` (a window) added to `pool` (the windows before it), each rank's means weighted by
    steps; a window with other ranks (an elastic job's new world) starts a new pool."""
    if [t.rank for t in pool] != [t.rank for t in times]:
        return list(times)
    out = []
    for old, new in zip(pool, times):
        steps = old.steps + new.steps
        phases = {
            p: (old.phases[p] * old.steps + new.phases[p] * new.steps) / max(steps, 1)
            for p in PHASES
        }
        out.append(RankTimes(new.rank, new.host, new.local_rank, phases, steps))
    return out


FIXES = {
    "data": "more loader workers (data.num_workers) or faster storage for the data on {host}",
    "compute": "a throttled, busy or different device on {host}: `lockstep doctor` on each node "
    "compares them",
    "optimizer": "a throttled, busy or different device on {host}: `lockstep doctor` on each node "
    "compares them",
    "checkpoint": "checkpoint.async_save (disk saves then run in the background), a longer "
    "checkpoint.memory_interval (the node's memory snapshots are written by its lowest rank), or "
    "faster storage for checkpoints on {host}",
    "other": "another process on {host} competing for its cores (top, or `lockstep doctor`)",
}


@dataclass(frozen=True)
class Behind:
    """The slowest rank of a window, when it is behind: its own time against the median of the
    others', and its cause with its time per step and the others' median."""

    times: RankTimes
    median: float
    cause: str
    cause_s: float
    others_s: float

    @property
    def ratio(self) -> float:
        return self.times.own / self.median

    @property
    def key(self) -> tuple:
        return (self.times.rank, self.cause)

    @property
    def fix(self) -> str:
        return FIXES[self.cause].format(host=self.times.host)

    def describe(self) -> str:
        t = self.times
        return (
            f"rank {t.rank} ({t.host}, local rank {t.local_rank}) is behind: {1000 * t.own:.0f} ms "
            f"of its own per step against the others' {1000 * self.median:.0f} ms "
            f"({self.ratio:.2f}x); {self.cause} {1000 * self.cause_s:.0f} ms per step (others: "
            f"{1000 * self.others_s:.0f} ms)"
        )


@dataclass(frozen=True)
class SlowLink:
    """A ring link much slower than the others of its kind (lockstep.train.links.slow_links)."""

    src: int
    dst: int
    line: str
    fix = SLOW_LINK_FIX

    @property
    def key(self) -> tuple:
        return ("link", self.src, self.dst)

    def describe(self) -> str:
        return f"communication is most of every rank's step, and the link {self.line}"


def communication_bound(times: list[RankTimes]) -> bool:
    """Whether the median rank spends more of its step waiting in collectives than on its own."""
    return len(times) > 1 and statistics.median(
        t.phases["comm"] for t in times
    ) > statistics.median(t.own for t in times)


def probe_links(rt: Runtime, times: list[RankTimes]) -> SlowLink | None:
    """Every rank: its incoming ring link timed, all gathered; the slowest link that is slow."""
    rings = gather_objects(rt, probe_ring(rt))
    facts = [{"rank": t.rank, "host": t.host, "ring": ring} for t, ring in zip(times, rings)]
    slow = slow_links(facts)
    if not slow:
        return None
    dst, line = max(slow, key=lambda found: rings[found[0]]["seconds"])
    return SlowLink(rings[dst]["from"], dst, line)


def behind(times: list[RankTimes], margin: float) -> Behind | None:
    """The slowest rank, if its own time per step is more than `margin` above the others' median
    and more than MIN_EXCESS_S a step above it."""
    if len(times) < 2:
        return None
    slow = max(times, key=lambda t: t.own)
    others = [t for t in times if t is not slow]
    median = statistics.median(t.own for t in others)
    if median <= 0 or slow.own <= max((1 + margin) * median, median + MIN_EXCESS_S):
        return None
    usual = {p: statistics.median(t.phases[p] for t in others) for p in PHASES if p not in WAITS}
    cause = max(usual, key=lambda p: slow.phases[p] - usual[p])
    return Behind(slow, median, cause, slow.phases[cause], usual[cause])


class StragglerWatch:
    """Rank 0: compares the ranks once the log windows since the last comparison cover MIN_STEPS;
    warns once a rank stays behind, for the same cause, `patience` comparisons in a row (and again
    only after it has caught up)."""

    def __init__(
        self, margin: float, patience: int, log: logging.Logger, probe_links: bool = True
    ) -> None:
        self.margin, self.patience, self.log = margin, patience, log
        self.streak: tuple[int, str] | None = None
        self.count = 0
        self.pool: list[RankTimes] = []  # the windows not compared yet, pooled
        # comparisons since the links were last probed (None: never probe); links warned about
        self.since_probe: int | None = PROBE_EVERY if probe_links else None
        self.warned: set[tuple] = set()

    def compare(self, rt: Runtime, clock: StepClock) -> list[dict]:
        """Every rank, at a log line: every rank's window gathered and the clock's reset; every rank
        compares (and probes the links alike), rank 0 logs. Returns the rows a metrics.jsonl record
        keeps."""
        times = gather_times(rt, clock)
        clock.reset()
        self.note(times, lambda window: probe_links(rt, window), speak=rt.is_main)
        return [t.row() for t in times]

    def note(
        self,
        times: list[RankTimes],
        probe: Callable[[list[RankTimes]], SlowLink | None] | None = None,
        speak: bool = True,
    ) -> Behind | SlowLink | None:
        """Pool a window; once the pool covers MIN_STEPS, compare it: the rank behind; else, when
        communication is most of the step (and the links were not probed in the last PROBE_EVERY
        comparisons), the slow link `probe` finds; or None."""
        self.pool = pooled(self.pool, times)
        if not self.pool or self.pool[0].steps < MIN_STEPS:
            return None
        times, self.pool = self.pool, []
        found = behind(times, self.margin)
        # a rank behind makes the others wait: then that wait is its doing, not a link's
        link = self._probed(times, probe) if found is None else None
        if link is not None:
            if speak and link.key not in self.warned:
                self.log.warning("straggler: %s; the fix that fits: %s", link.describe(), link.fix)
            self.warned.add(link.key)
            return link
        key = found.key if found else None
        self.count = self.count + 1 if key is not None and key == self.streak else int(bool(key))
        self.streak = key
        if found is not None and speak and self.count != self.patience:
            self.log.info("%s", found.describe())
        if found is not None and speak and self.count == self.patience:
            self.log.warning(
                "straggler: %s, in the last %d comparisons (each of %d steps or more); the fix "
                "that fits: %s",
                found.describe(),
                self.count,
                MIN_STEPS,
                found.fix,
            )
        return found

    def _probed(self, times: list[RankTimes], probe) -> SlowLink | None:
        """The slow link `probe` finds, when it is the links' turn and communication is most of
        the step; else None."""
        if self.since_probe is None or probe is None:
            return None
        self.since_probe += 1
        if self.since_probe <= PROBE_EVERY or not communication_bound(times):
            return None
        self.since_probe = 0
        return probe(times)
