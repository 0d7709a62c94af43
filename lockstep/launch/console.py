"""The launcher's console: C++ stack frames kept in the node's log, the rest shown as it comes.

When a node's rendezvous host goes away, torch's agent and c10d's C++ client log each failed store
call with its C++ frames, written straight to fd 2 by C++, dozens of lines above the one line that
says what to do. Python cannot filter C++'s writes, so `CppFramesToLog` makes fd 2 a pipe that a
thread reads: the node's log gets every byte, the console everything but the frames
(README.md, "Where it runs").
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

# The lines of a C++ stack trace that torch's c10 errors carry after their message (c10d's logged
# warnings too).
_CPP_FRAME = re.compile(
    rb"(Exception raised from .* \(most recent call first\):|frame #\d+: .*"
    rb"|<omitting python frames>)"
)


# set for the workers by CppFramesToLog when the launcher's console is a terminal: their stderr is
# then a pipe, and lockstep.metrics still draws the progress bar (tqdm would hide it on a pipe)
CONSOLE_IS_TTY = "LOCKSTEP_CONSOLE_IS_TTY"


_FRAME_STARTS = (b"frame #", b"Exception raised from ", b"<omitting python frames>")


def _pieces(pipe) -> Iterator[bytes]:
    """What arrives on `pipe`, cut after each newline or carriage return. A piece without an end
    that cannot begin a frame line (a progress bar's redraw: "\r 40%|####  |") is passed on at
    once, not at the next newline; one that may is kept until its line is whole."""
    rest = b""
    while chunk := pipe.read(65536):
        parts = re.split(rb"(?<=[\r\n])", rest + chunk)
        rest = parts.pop()
        yield from (p for p in parts if p)
        if rest and not any(s.startswith(rest[: len(s)]) for s in _FRAME_STARTS):
            yield rest
            rest = b""
    if rest:
        yield rest


class CppFramesToLog:
    """Within it, this process's stderr (fd 2, which the workers it starts inherit) goes to `log`
    in full and to the console without C++ stack frames.

    When a node's rendezvous host goes away, torch's agent and c10d's C++ client log each failed
    store call with its frames ("Exception raised from recvBytes ... frame #0: c10::Error::Error
    ..."), written straight to fd 2 by C++: dozens of lines above the one line that says what to
    do. Python cannot catch C++'s writes, so fd 2 becomes a pipe read here: every line goes to
    the log; the console gets all but the frames (and the blank line that ends them), and, at the
    end, where they were kept.
    """

    def __init__(self, log: Path):
        self.log, self.dropped, self._console_gone = log, 0, False

    def __enter__(self) -> CppFramesToLog:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.log, "ab")  # noqa: SIM115 (the pump closes it; it may outlive us)
        sys.stderr.flush()
        if os.isatty(2):  # the workers' stderr becomes a pipe: tell their progress bar it is seen
            os.environ[CONSOLE_IS_TTY] = "1"
        self._console = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._pump = threading.Thread(
            target=self._copy, args=(read,), name="lockstep-stderr", daemon=True
        )
        self._pump.start()
        return self

    def _copy(self, read: int) -> None:
        after_frame = False
        with os.fdopen(read, "rb", buffering=0) as pipe, self._file:
            for line in _pieces(pipe):
                self._file.write(line)
                self._file.flush()
                frame = _CPP_FRAME.fullmatch(line.rstrip(b"\r\n")) is not None
                if frame or (after_frame and not line.strip()):
                    self.dropped += frame
                elif not self._console_gone:
                    try:
                        os.write(self._console, line)
                    except OSError:  # the console went away (a closed terminal): drain to the log
                        self._console_gone = True
                after_frame = frame

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self._console, 2)  # closes our end of the pipe; ended workers held the others
        self._pump.join(timeout=5)  # a worker still alive keeps it open: the rest goes to the log
        if self.dropped:
            print(
                f"lockstep: {self.dropped} lines of C++ stack frames from torch were left off "
                f"this console; the full text is in {self.log}",
                file=sys.stderr,
                flush=True,
            )
        if not self._pump.is_alive():
            os.close(self._console)
