"""Hang watchdog: notice a stuck job, say which ranks hold it up and where, and stop it.

Protocol (docs/architecture.md, "Hang watchdog"); who is behind, and the report: lockstep.runtime.hang_report.
The training loop calls `beat(step, phase)`, which only sets a field. A daemon thread per rank
publishes that progress through the rendezvous store every poll. When this rank's progress has not
changed for `stall_seconds`, or another rank has declared a hang, the thread

1. dumps every Python thread's stack to RUN_DIR/hang/rank{r}.txt,
2. publishes its progress and its main thread's innermost user frame ("file:line in func"),
3. waits (bounded) for the other ranks' reports; the lowest rank that reported writes
   RUN_DIR/hang/report.txt, naming the ranks that are behind (hang_report.find_behind),
4. logs the message at ERROR and ends the process with exit code `HANG_EXIT_CODE`.

Every rank does this for itself, so all stop, even the ones whose launcher would not kill them.
A watchdog that cannot reach the store warns once and keeps trying: it never stops a
healthy run because of its own trouble.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType

import torch.distributed as dist

from lockstep.runtime.group import Runtime
from lockstep.runtime.hang_report import build_report, innermost_user_frame, write_report

HANG_EXIT_CODE = 124  # as `timeout(1)`: the run was stopped because it made no progress
KEY_PREFIX = "lockstep/watchdog"


class Watchdog:
    """Per-rank progress reporter and hang detector; a no-op on one process, and with stall_seconds = math.inf.

    with Watchdog(rt, run_dir, stall_seconds=300) as wd:  # the thread runs inside the block
        for step in ...:
            wd.beat(step, "forward")
    """

    def __init__(
        self,
        rt: Runtime,
        run_dir: Path,
        stall_seconds: float = 300.0,
        poll_seconds: float | None = None,
        log: logging.Logger | None = None,
    ):
        if stall_seconds <= 0:
            raise ValueError(
                f"watchdog stall_seconds = {stall_seconds}; it must be > 0 (seconds without progress "
                "before the run is stopped)"
            )
        self.rt, self.run_dir, self.stall_seconds = rt, Path(run_dir), float(stall_seconds)
        self.poll_seconds = (
            float(poll_seconds) if poll_seconds else min(self.stall_seconds / 10, 5.0)
        )
        # how long a rank that found a hang waits for the others' reports (normally they come within a poll)
        self.report_wait = max(5 * self.poll_seconds, 10.0)
        self.log = log or logging.getLogger("lockstep")
        # (step, phase, ordinal of the phase within the step, monotonic time of the last change): one tuple,
        # replaced whole, so the thread never reads a half-updated progress
        self._progress: tuple[int, str, int, float] = (-1, "start", 0, time.monotonic())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.Store | None = None
        self._store_warned = False
        self._main_thread_id = threading.main_thread().ident
        self._seq = 0
        self._announced = False

    # ------------------------------------------------------------------ caller's side (cheap)

    def start(self) -> "Watchdog":
        """Start the thread; off (beats only set a field) on one process or without a stall limit."""
        if self.rt.world_size > 1 and math.isfinite(self.stall_seconds) and self._thread is None:
            self._progress = (-1, "start", 0, time.monotonic())
            self._thread = threading.Thread(target=self._run, name="lockstep-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int, phase: str) -> None:
        """Record progress: no I/O here, the watchdog thread publishes it.

        Progress is a change of (step, phase); repeating the same pair does not reset the stall clock,
        so `stall_seconds` must exceed the longest single phase (first compiled step, eval, checkpoint).
        """
        old_step, old_phase, ordinal, _ = self._progress
        if step != old_step:
            self._progress = (step, phase, 0, time.monotonic())
        elif phase != old_phase:
            # the ordinal orders phases within a step without a fixed list of phase names:
            # every rank runs the same code, so the n-th phase of step s is the same everywhere
            self._progress = (step, phase, ordinal + 1, time.monotonic())

    def stop(self, wait: float | None = None) -> None:
        """End the thread: wait for it up to `wait` seconds (default: two store calls, so a status
        write in flight lands)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2 * self._store_timeout() + 1 if wait is None else wait)
            self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(
        self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # On an error the run is ending: the daemon thread may be blocked reconnecting to a store
        # whose host died (its clone keeps the group's long timeout), so the error is not kept
        # waiting for it (21 s when node rank 0 was lost).
        self.stop(wait=1.0 if exc_type is not None else None)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            # decided locally: a dead store cannot hide a stall
            stalled = self._idle() >= self.stall_seconds
            declared = False
            try:
                self._seq += 1
                self._publish("status", self._state())
                # add(0) reads without waiting for the key
                declared = self._store_client().add("hang", 0) > 0
            except Exception as e:  # the watchdog's own trouble must never stop a healthy run
                self._store = None  # reconnect on the next poll
                self._warn_once(
                    f"hang watchdog on rank {self.rt.rank} cannot reach the rendezvous store "
                    f"({type(e).__name__}: {e}); it keeps trying"
                )
            if stalled or declared:
                self._handle_hang()  # does not return: ends the process
        try:  # tell the others this rank left on purpose (a report then says "stopped", not "stuck")
            self._publish("status", self._state(stopped=True))
        except Exception:
            pass

    def _handle_hang(self) -> None:
        hang_dir = self.run_dir / "hang"
        try:  # first, and without the store: the stacks are what is left if all else fails
            stack_file: Path | None = self._dump_stacks(hang_dir)
        except OSError as e:
            stack_file = None
            self.log.warning("hang watchdog could not write its stack dump to %s: %s", hang_dir, e)
        mine = self._state(
            where=innermost_user_frame(sys._current_frames().get(self._main_thread_id)),
            stack_file=str(stack_file) if stack_file else None,
        )
        try:
            self._agree_on_report(mine, hang_dir)
        except Exception as e:  # no store, no comparison: say what this rank knows
            self._announce(
                f"hang: no progress for {self._idle():.0f} s on rank {self.rt.rank}, at step "
                f"{mine['step']} ({mine['phase']}), {mine['where']}; the other ranks could not be asked "
                f"({type(e).__name__}: {e}); stacks in {hang_dir}/"
            )
        # The main thread is blocked inside a C++ collective (gloo/nccl wait, GIL released): a Python
        # exception raised here would only end this thread, and a signal handler never runs while the
        # main thread sits in C++. Ending the process is the only way to stop the rank.
        os._exit(HANG_EXIT_CODE)

    def _announce(self, message: str) -> None:
        if not self._announced:
            self._announced = True
            self.log.error("%s", message)
            _flush_logs(self.log)

    def _agree_on_report(self, mine: dict, hang_dir: Path) -> None:
        """Publish this rank's report, collect the others', have one rank write report.txt; log the message."""
        store = self._store_client()
        store.add("hang", 1)  # the others join at their next poll, so every rank dumps its stacks
        self._publish(f"report/{self.rt.rank}", mine)
        world = self.rt.world_size
        report_keys = [f"report/{r}" for r in range(world)]
        deadline = time.monotonic() + self.report_wait
        while time.monotonic() < deadline and not store.check(report_keys):
            time.sleep(min(0.2, self.poll_seconds))
        reported = [r for r in range(world) if store.check([report_keys[r]])]
        # the lowest rank that reported writes the report (rank 0 unless it is gone); compare_set makes one winner
        if all(r not in reported for r in range(self.rt.rank)):
            store.compare_set("reporter", "", str(self.rt.rank))
        reporter = int(store.get("reporter")) if store.check(["reporter"]) else None

        if reporter == self.rt.rank:
            states = {
                r: self._read(f"report/{r}") or self._read(f"status/{r}") for r in range(world)
            }
            message, table = build_report(states, self.stall_seconds, hang_dir)
            write_report(hang_dir / "report.txt", message, table)
            self._publish("done", {"message": message})
        else:
            done = self._wait_for("done", self.report_wait)
            message = (
                done["message"]
                if done
                else (
                    f"hang: no progress for {self._idle():.0f} s on rank {self.rt.rank}, at step {mine['step']} "
                    f"({mine['phase']}), {mine['where']}; rank {reporter} was to write {hang_dir}/report.txt but "
                    f"did not (gone?); stacks in {hang_dir}/"
                )
            )
        self._announce(message)
        # wait (briefly) until every reporting rank has logged: the first rank to exit makes torchrun
        # terminate the rest, and their ERROR lines would be lost
        store.add("logged", 1)
        deadline = time.monotonic() + 3 * self.poll_seconds + 2
        while time.monotonic() < deadline and store.add("logged", 0) < len(reported):
            time.sleep(0.1)

    # ------------------------------------------------------------------ helpers

    def _idle(self) -> float:
        return time.monotonic() - self._progress[3]

    def _state(self, **extra: object) -> dict:
        step, phase, ordinal, _ = self._progress
        return {
            "rank": self.rt.rank,
            "host": self.rt.hostname,
            "pid": os.getpid(),
            "step": step,
            "phase": phase,
            "ordinal": ordinal,
            "idle": round(self._idle(), 1),
            "seq": self._seq,
            **extra,
        }

    def _store_timeout(self) -> float:
        return max(1.0, min(10.0, 2 * self.poll_seconds))

    def _store_client(self) -> dist.Store:
        """Our own connection to the rendezvous store, with short timeouts.

        The rendezvous (TCP) store is separate from the collectives: it keeps answering while the
        ranks are stuck in one, which is what lets them compare notes. `clone()` opens a second
        client to the same server (same key prefix, so the same job and restart attempt), so this
        thread never shares a socket or a timeout with the process group's own use of the store.
        """
        if self._store is None:
            base = dist.distributed_c10d._get_default_store().clone()
            base.set_timeout(datetime.timedelta(seconds=self._store_timeout()))
            self._store = dist.PrefixStore(KEY_PREFIX, base)
            self._store_warned = False
        return self._store

    def _publish(self, key: str, value: dict) -> None:
        self._store_client().set(key, json.dumps(value))

    def _read(self, key: str) -> dict | None:
        store = self._store_client()
        return json.loads(store.get(key)) if store.check([key]) else None

    def _wait_for(self, key: str, seconds: float) -> dict | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if (value := self._read(key)) is not None:
                return value
            time.sleep(0.1)
        return None

    def _dump_stacks(self, hang_dir: Path) -> Path:
        hang_dir.mkdir(parents=True, exist_ok=True)
        path = hang_dir / f"rank{self.rt.rank}.txt"
        step, phase, _, _ = self._progress
        lines = [
            f"rank {self.rt.rank} on {self.rt.hostname} (pid {os.getpid()}): step {step} ({phase}), "
            f"no progress for {self._idle():.1f} s\n"
        ]
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            lines.append(f"\nThread {names.get(ident, '?')} ({ident}), most recent call last:\n")
            lines.extend(traceback.format_stack(frame))
        path.write_text("".join(lines))
        return path

    def _warn_once(self, message: str) -> None:
        if not self._store_warned:
            self._store_warned = True
            self.log.warning("%s", message)


def _flush_logs(log: logging.Logger) -> None:
    for logger in (log, logging.getLogger()):
        for handler in logger.handlers:
            try:
                handler.flush()
            except Exception:
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
