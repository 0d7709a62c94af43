"""lockstep/runtime/hang_report.py: which ranks are behind (less progress, no state, the odd line out, no answer),
the report's message and table, and a blocked thread's innermost frame outside torch and the stdlib."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from lockstep.runtime.hang_report import build_report, find_behind, innermost_user_frame


def _state(rank: int, step: int, ordinal: int, where: str) -> dict:
    return {
        "rank": rank,
        "host": "h",
        "step": step,
        "phase": ["forward", "allreduce", "eval"][ordinal],
        "ordinal": ordinal,
        "idle": 6.0,
        "where": where,
    }


def test_find_behind():
    a, b = "train.py:10 in step", "train.py:20 in evaluate"
    # less progress: behind, wherever it waits
    assert find_behind({0: _state(0, 3, 1, a), 1: _state(1, 3, 0, b)})[0] == [1]
    assert find_behind({0: _state(0, 2, 2, a), 1: _state(1, 3, 0, a), 2: _state(2, 3, 0, a)})[
        0
    ] == [0]
    # same progress: the odd line out
    assert find_behind({0: _state(0, 3, 1, a), 1: _state(1, 3, 1, b), 2: _state(2, 3, 1, a)})[
        0
    ] == [1]
    # same progress, two ranks, two lines: nobody can be singled out
    assert find_behind({0: _state(0, 3, 1, a), 1: _state(1, 3, 1, b)})[0] == [0, 1]
    # a rank that never published anything
    assert find_behind({0: _state(0, 3, 1, a), 1: None})[0] == [1]
    # same progress, but one rank did not answer the hang check (frozen): that one
    assert find_behind({0: _state(0, 3, 1, a), 1: _state(1, 3, 1, ""), 2: _state(2, 3, 1, b)})[
        0
    ] == [1]


def test_report_names_the_ranks_behind(tmp_path):
    states = {
        0: _state(0, 12, 1, "train.py:10 in step"),
        1: _state(1, 12, 0, "loop.py:7 in train_step"),
    }
    message, table = build_report(states, 30, tmp_path / "hang")
    assert message.startswith(
        "hang: no progress for 6 s; behind: rank 1 at step 12 (forward), loop.py:7 in train_step"
    ), message
    assert table.splitlines()[2].split("\t") == [
        "1",
        "h",
        "12",
        "forward",
        "6.0",
        "BEHIND",
        "loop.py:7 in train_step",
    ]


def test_innermost_user_frame_skips_torch_and_stdlib():
    event = threading.Event()

    def blocked() -> None:
        event.wait(30)  # USER-LINE

    t = threading.Thread(target=blocked, daemon=True)
    t.start()
    try:
        time.sleep(0.05)
        where = innermost_user_frame(sys._current_frames()[t.ident])
    finally:
        event.set()
        t.join()
    line = next(
        i for i, s in enumerate(Path(__file__).read_text().splitlines(), 1) if "# USER-LINE" in s
    )
    # the path as imported: unit/runtime/test_hang_report.py
    assert where == f"{__name__.replace('.', '/')}.py:{line} in blocked"
