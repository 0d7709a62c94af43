"""A hang's report: which ranks hold the others up (find_behind), where each rank's main thread is (its
innermost frame outside torch, the stdlib and the watchdog), and the message and table every rank logs
and the lowest one writes to RUN_DIR/hang/report.txt (lockstep.runtime.watchdog)."""

from __future__ import annotations

import os
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from types import FrameType

import torch

# Frames in these trees are never "the user's line": the collective's Python wrappers, the stdlib
# (threading, queue, contextlib) and the watchdog's own files. The innermost frame outside them is.
_SKIP_DIRS = tuple(
    str(Path(p).resolve()) + os.sep
    for p in (
        Path(torch.__file__).parent,
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
    )
)
_WATCHDOG_FILES = (
    str(Path(__file__).resolve()),
    str(Path(__file__).with_name("watchdog.py").resolve()),
)


def innermost_user_frame(frame: FrameType | None) -> str:
    """'file:line in func' of the innermost frame outside torch, the stdlib and the watchdog."""
    innermost = None
    while frame is not None:
        filename = str(Path(frame.f_code.co_filename).resolve())
        innermost = innermost or frame
        if filename not in _WATCHDOG_FILES and not filename.startswith(_SKIP_DIRS):
            return (
                f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
            )
        frame = frame.f_back
    if innermost is None:
        return "?"
    return f"{short_path(innermost.f_code.co_filename)}:{innermost.f_lineno} in {innermost.f_code.co_name}"


def short_path(filename: str) -> str:
    """The path as imported: relative to the sys.path entry that holds it ('lockstep/train/loop.py')."""
    path = Path(filename).resolve()
    best = str(path)
    for entry in sys.path:
        try:
            rel = str(path.relative_to(Path(entry or ".").resolve()))
        except (ValueError, OSError):
            continue
        if len(rel) < len(best):
            best = rel
    return best


def find_behind(states: dict[int, dict | None]) -> tuple[list[int], str]:
    """The ranks holding the others up, and why they were chosen.

    Progress is (step, ordinal of the phase within the step). Ranks without any published state
    are behind (never started, or died). Otherwise the ranks with less progress than the furthest
    rank are behind; then the ranks that did not answer the hang check while others did (a frozen
    process cannot). When all made the same progress and answered, they wait in different places for each
    other: the ranks whose line differs from the one most ranks share are named, or all ranks
    when no line is shared by more than one.
    """
    missing = [r for r, s in states.items() if s is None]
    known = {r: s for r, s in states.items() if s is not None}
    if missing:
        return sorted(missing), "no progress report"
    progress = {r: (s["step"], s["ordinal"]) for r, s in known.items()}
    furthest = max(progress.values())
    behind = [r for r, p in progress.items() if p < furthest]
    if behind:
        return sorted(behind), "less progress than the others"
    silent = [r for r, s in known.items() if not s.get("where")]
    # the others answered the hang check; these could not run Python at all
    if 0 < len(silent) < len(known):
        return sorted(
            silent
        ), "did not answer the hang check (process frozen, or stuck outside Python)"
    places = Counter(s.get("where") for s in known.values())
    common, count = places.most_common(1)[0]
    if count > 1 and count < len(known):
        return sorted(
            r for r, s in known.items() if s.get("where") != common
        ), "same step and phase as the others, but waiting at a different line"
    return sorted(known), "all at the same step and phase; compare their lines"


def build_report(
    states: dict[int, dict | None], stall_seconds: float, hang_dir: Path
) -> tuple[str, str]:
    """(one-line message for the logs, one line per rank for report.txt)."""
    behind, why = find_behind(states)

    def describe(r: int) -> str:
        s = states[r]
        if s is None:
            return f"rank {r} (no report)"
        at = "before the first step" if s["step"] < 0 else f"at step {s['step']} ({s['phase']})"
        return f"rank {r} {at}, {s.get('where') or 'location unknown: it sent no stack report'}"

    idle = max((s["idle"] for s in states.values() if s is not None), default=stall_seconds)
    message = (
        f"hang: no progress for {idle:.0f} s; behind: {'; '.join(describe(r) for r in behind)} [{why}]; "
        f"stacks in {hang_dir}/"
    )
    rows = ["rank\thost\tstep\tphase\tidle_s\tbehind\twhere"]
    for r in sorted(states):
        s = states[r] or {}
        where = s.get("where") or ("stopped" if s.get("stopped") else "no stack report")
        rows.append(
            f"{r}\t{s.get('host', '?')}\t{s.get('step', '?')}\t{s.get('phase', '?')}\t"
            f"{s.get('idle', '?')}\t{'BEHIND' if r in behind else '-'}\t{where}"
        )
    return message, "\n".join(rows) + "\n"


def write_report(path: Path, message: str, table: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(message + "\n\n" + table)
    os.replace(tmp, path)
