"""How a lockstep process ends: as sys.exit would, but without the interpreter's finalization.

A gloo process group runs its collectives on worker threads of its own, and a DDP communication hook's Python
callbacks (the bf16/fp16 hooks' decompress step, PowerSGD's) run there. After a collective completes, the thread
still drops that callback and what it holds, under the GIL (and so, likely, for a tensor whose Python object
only the collective still held: the doctor, which registers no hook, aborted the same way). When the main thread
has meanwhile reached interpreter finalization, Python ends any other thread that asks for the GIL with
pthread_exit; here that unwinds through a noexcept C++ frame, so the process dies with std::terminate
("terminate called without an active exception", SIGABRT) after a run that finished. The group cannot be torn
down first: once DDP has used it, torch keeps it (and its threads) until the process ends, whatever
destroy_process_group does. Seen in this project's CI about once in three suites (core dump: a pt_gloo_runloop
thread in PyThread_exit_thread while the main thread was in Py_FinalizeEx).

So a lockstep process does what a normal exit does up to finalization (it waits for its non-daemon threads, runs
the atexit handlers, which include logging.shutdown and multiprocessing's clean-up, and flushes the standard
streams) and leaves with os._exit. Every lockstep process does, with a group or without: finalizing the modules
of torch takes longer than many commands (a median 1.3 s of every process: BENCHMARKS.md, "Process start and
end"), and what lockstep writes it closes itself. What is lost is what only finalization would do: the
`__del__` of an object still held at the end.
No library offers this; torch's own launchers leave it to the worker.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Leave the process with `code`: everything a normal exit does but finalization."""
    # as a normal exit: it waits for every non-daemon thread first
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    gc.collect()  # files nobody holds any more are closed (and flushed) by their finalizers, as at a normal exit
    atexit._run_exitfuncs()  # the handlers sys.exit would run; the group's threads may still take the GIL here
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        # closed, or a pipe whose reader is gone: nothing more can be said there
        except (OSError, ValueError):
            pass
    os._exit(code)
