"""lockstep/launch/console.py: the launcher's console without torch's C++ frames, every byte in the
node's log, and a progress bar's redraw passed on at once."""

from __future__ import annotations

import os
import subprocess
import sys

from lockstep.launch.console import CppFramesToLog, _pieces
from lockstep.runtime import free_port

C10D_FRAMES = """
import datetime, sys, torch.distributed as d
print("before", flush=True, file=sys.stderr)
try:  # nothing listens there: c10d logs each failed try with its C++ frames, straight to fd 2
    d.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
               timeout=datetime.timedelta(seconds=1))
except Exception as e:
    print("caught:", type(e).__name__, file=sys.stderr)
print("after", file=sys.stderr)
"""


def test_cpp_frames_go_to_the_log_and_the_rest_to_the_console(tmp_path, capfd):
    """A real child (as a worker is) writes c10d's logged C++ frames to the fd 2 it inherited: the
    console shows its other lines in order and one line saying where the frames went; the log holds
    every line."""
    log = tmp_path / "logs" / "launcher_node1.log"
    print("pre", file=sys.stderr, flush=True)
    with CppFramesToLog(log) as console:
        subprocess.run([sys.executable, "-c", C10D_FRAMES, str(free_port())], check=True)
        os.write(2, b"from the launcher\n")  # (under capfd, sys.stderr does not go through fd 2)
    print("post", file=sys.stderr, flush=True)
    err = capfd.readouterr().err
    full = log.read_text()
    assert console.dropped > 3 and full.count("frame #") > 3 and "Exception raised from" in full
    assert "frame #" not in err and "Exception raised from" not in err and "\n\n" not in err
    lines = err.splitlines()
    assert lines[0] == "pre" and lines[1] == "before" and lines[-1] == "post"
    assert [
        line for line in lines if line in ("caught: DistNetworkError", "after", "from the launcher")
    ] == ["caught: DistNetworkError", "after", "from the launcher"]
    assert lines[-2] == (
        f"lockstep: {console.dropped} lines of C++ stack frames from torch were left off this "
        f"console; the full text is in {log}"
    )
    assert full.startswith("before\n") and full.endswith("from the launcher\n")
    assert [
        line
        for line in full.splitlines()
        if not line.startswith(("frame #", "Exception raised", "<omitting")) and line.strip()
    ] == [line for line in lines[1:-2] if line.strip()]  # the console: the log less frames


class _Chunks:
    """A pipe that returns these writes one read at a time, then end of file."""

    def __init__(self, *chunks: bytes):
        self.chunks = list(chunks)

    def read(self, n: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


def test_the_stderr_pump_passes_a_progress_bar_redraw_at_once_and_holds_a_frame_line_until_whole():
    pieces = list(
        _pieces(
            _Chunks(
                b"\r 10%|#",
                b"\r 20%|##",
                b"line one\nfra",
                b"me #3: foo\nExc",
                b"eption raised from x (most recent call first):\n",
                b"tail",
            )
        )
    )
    assert pieces == [
        b"\r",
        b" 10%|#",
        b"\r",
        b" 20%|##",
        b"line one\n",
        b"frame #3: foo\n",
        b"Exception raised from x (most recent call first):\n",
        b"tail",
    ]
