"""Which worker failed first, and with what: the launcher's message names the cause, not its echoes.

When one rank raises, its peers fail a moment later in the collective it left (gloo: "Connection
closed by peer"), and the one torch's agent sees first is whichever *exits* first: a rank that
raised may still be writing its logs when a peer it broke has exited, and the agent then stops it
with SIGTERM. So a worker writes the exception it stopped on, and when, to the error file torch's
agent gives it (TORCHELASTIC_ERROR_FILE, in the format of torch's ErrorHandler, plus the time to
the microsecond: torch keeps whole seconds, and a rank and the peer it broke fail in the same one),
before it tears its process group down, so a peer's failure is always later; the launcher names the
rank that raised first, with its error, then how every rank ended. On one node the times share a
clock; across nodes they are as close as the nodes' clocks.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from lockstep.runtime.watchdog import HANG_EXIT_CODE

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torch's agent for each worker it starts


def record_failure(e: BaseException) -> None:
    """Write `e` and the time now to this worker's error file; nothing without torch's agent."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    now = time.time()
    data = {
        "message": {
            "message": f"{type(e).__name__}: {e}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(e)),
                "timestamp": str(int(now)),
                "raised_at": now,
            },
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the agent's temporary directory is gone: the rank's log has the message


def describe_failures(failures: dict[int, ProcessFailure]) -> str:
    """Every failed rank's end, the rank that raised first named first with its error."""
    raised = sorted((t, rank) for rank, f in failures.items() if (t := _raised_at(f)) is not None)
    first = raised[0][1] if raised else None
    said = []
    if first is not None:
        error = _first_line(failures[first].message["message"])
        said.append(f"rank {first} failed first ({error}) and {_ending(failures[first].exitcode)}")
    said += [describe_exit(r, f.exitcode) for r, f in sorted(failures.items()) if r != first]
    return "; ".join(said)


def describe_exit(rank: int, exitcode: int) -> str:
    """How a worker ended, for a person: its exit code, the signal that killed it, or the hang
    watchdog."""
    return f"rank {rank} {_ending(exitcode)}"


def _ending(exitcode: int) -> str:
    if exitcode == HANG_EXIT_CODE:
        watchdog = f"was stopped by the hang watchdog (exit code {exitcode}; "
        return watchdog + "see the run's hang/report.txt)"
    if exitcode < 0:  # torch elastic reports death by signal N as -N
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with an error (exit code {exitcode})"


def _raised_at(failure: ProcessFailure) -> float | None:
    message = failure.error_file_data.get("message")
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    raised_at = extra.get("raised_at")
    return float(raised_at) if isinstance(raised_at, (int, float)) else None


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "an error"
    return line if len(line) <= limit else line[: limit - 3] + "..."
