"""bench/start_costs.py: it imports lockstep from the tree it is given and prints one line per measurement."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "start_costs.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_parser_is_timed_from_the_tree_given():
    proc = _run("parser", ".")
    assert proc.returncode == 0, proc.stderr
    tree, ms = re.fullmatch(r"parser (\S+) ([\d.]+) ms\n", proc.stdout).groups()
    assert tree == str(REPO) and 0 < float(ms) < 10_000


def test_an_unknown_measurement_is_refused():
    proc = _run("startup", ".")
    assert (
        proc.returncode == 1
        and proc.stderr == "start_costs.py: 'startup': expected parser or probe\n"
    )
