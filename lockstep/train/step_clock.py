"""Where each rank's step time goes: data wait, compute, exposed communication, optimizer,
checkpoint stall and the rest, per rank, over each log window.

The loop marks the end of each phase of a step with lap(PHASE): the time since the last lap goes to
that phase (one clock read; on a GPU a CUDA event on the current stream, read once per log window,
so no step waits for the device). Under DDP a hook on every parameter (watch_gradients) notes when
its gradient was accumulated: DDP all-reduces each bucket as it fills and waits for all of them at
the end of the backward, so the time from the last gradient to the end of the backward is the
communication compute did not hide, taken out of compute. Under PP the time in the schedule
outside the stage's own forward and backward chunks is the bubble (lockstep.parallel.pp.ChunkLaps):
waiting for the neighbouring stages. Under FSDP and TP the collectives run inside the layout's own
hooks: on a CPU the time the training thread waits in them is timed
(lockstep.train.collective_waits) and told to waited(), and a lap moves it out of its phase into
comm; on a GPU those waits are stream waits and stay in compute.

At each log line every rank sends its window's per-step means over the control group (one small
all-gather), and rank 0 compares them: in a synchronous step every rank's step takes as long as
the slowest's, and the others wait in the next collective, so a rank's own time is its step minus
its exposed communication. lockstep.train.stragglers names the rank behind and its cause.

No process group of its own; the loop owns the clock.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from lockstep.collectives import gather_objects
from lockstep.runtime import Runtime
from lockstep.train.collective_waits import timed_waits

PHASES = ("data", "compute", "comm", "bubble", "optimizer", "checkpoint", "other")
WAITS = ("comm", "bubble")  # waiting for other ranks: not a rank's own time


class StepClock:
    """This rank's time per phase over the log window. lap(phase) ends `phase`; the window's first
    lap starts at reset()."""

    def __init__(self, device: torch.device, watch=(), clock=time.perf_counter) -> None:
        """watch: parameters whose gradients mark the end of compute (watch_gradients: DDP's)."""
        self.device, self.cuda, self.clock = device, device.type == "cuda", clock
        self.reset()
        watch_gradients(self, watch)
        self._timing = contextlib.ExitStack()

    def __enter__(self) -> StepClock:
        """While open, this thread's waits in collectives are timed
        (lockstep.train.collective_waits) and told to waited()."""
        self._timing.enter_context(timed_waits(self.device, self.waited))
        return self

    def __exit__(self, *exc) -> None:
        self._timing.close()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._events: list[tuple[str, object, object]] = []  # (phase, start, end) on a GPU
        self._last = self._now()
        self.ready: object = None  # when this backward's last gradient was accumulated
        self._waited = 0.0  # seconds waited in collectives since the last lap (on a CPU)

    def _now(self) -> object:
        if not self.cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def waited(self, seconds: float) -> None:
        """This rank's thread waited `seconds` for a collective (lockstep.train.collective_waits):
        the next lap counts them as comm, not as its own phase."""
        self._waited += seconds

    def mark_ready(self) -> None:
        """A gradient was accumulated: the last of a backward marks the end of its compute. On a
        GPU one event per backward, recorded again by each gradient."""
        if not self.cuda:
            self.ready = self.clock()
            return
        if self.ready is None:
            self.ready = torch.cuda.Event(enable_timing=True)
        self.ready.record()

    def lap(self, phase: str) -> None:
        """The time since the last lap, spent in `phase`."""
        now = self._now()
        self._add(phase, self._last, now)
        self._last = now

    def lap_backward(self) -> None:
        """The end of forward and backward: compute, but for the time after the last gradient was
        accumulated (watch_gradients), which is communication compute did not hide."""
        ready, self.ready = self.ready, None
        if ready is None:  # gradients not watched: a layout whose collectives stay in compute
            return self.lap("compute")
        self._add("compute", self._last, ready)
        self._last = ready
        self.lap("comm")

    def _add(self, phase: str, start: object, end: object) -> None:
        if self.cuda:
            self._events.append((phase, start, end))
            return
        span, waited, self._waited = end - start, self._waited, 0.0
        if phase not in WAITS:  # a wait in a collective is no rank's own time
            waited = min(waited, span)
            self.seconds["comm"] += waited
            span -= waited
        self.seconds[phase] += span

    def skip(self) -> None:
        """The time since the last lap belongs to no step (an evaluation)."""
        self._last = self._now()
        self._waited = 0.0

    def step_done(self) -> None:
        self.steps += 1

    def means(self) -> dict[str, float]:
        """Seconds per step in each phase over the window (reads the GPU's events: one sync)."""
        if self._events:
            torch.cuda.synchronize()
            for phase, start, end in self._events:
                self.seconds[phase] += start.elapsed_time(end) / 1000
            self._events.clear()
        return {phase: s / max(self.steps, 1) for phase, s in self.seconds.items()}


def watch_gradients(clock: StepClock, params) -> list:
    """Note in `clock` when each parameter's gradient is accumulated: the last of a backward marks
    the end of its compute (DDP all-reduces each bucket as it fills and waits for them all at the
    end of the backward). Returns the hooks' handles."""

    def ready(_param) -> None:
        clock.mark_ready()

    return [p.register_post_accumulate_grad_hook(ready) for p in params if p.requires_grad]


@dataclass(frozen=True)
class RankTimes:
    """One rank's per-step means over a log window, and where it runs."""

    rank: int
    host: str
    local_rank: int
    phases: dict[str, float] = field(default_factory=dict)
    steps: int = 0  # the window's steps

    def row(self) -> dict:
        """This rank in metrics.jsonl: where it runs, the window's steps, and milliseconds per step in
        each phase."""
        ms = {f"{phase}_ms": 1000 * s for phase, s in self.phases.items()}
        where = {"rank": self.rank, "host": self.host, "local_rank": self.local_rank}
        return {**where, "steps": self.steps, **ms}

    @property
    def own(self) -> float:
        """The rank's own time per step: all of it but the waits for the others."""
        return sum(s for phase, s in self.phases.items() if phase not in WAITS)


def gather_times(rt: Runtime, clock: StepClock) -> list[RankTimes]:
    """Every rank: every rank's window, in rank order (one all-gather of a few floats)."""
    mine = (rt.hostname, rt.local_rank, clock.means(), clock.steps)
    return [
        RankTimes(rank, host, local, phases, steps)
        for rank, (host, local, phases, steps) in enumerate(gather_objects(rt, mine))
    ]
