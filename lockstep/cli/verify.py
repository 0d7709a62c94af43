"""Check a run's checkpoints, or one checkpoint, and say what is wrong.

Exit status 0 when what was checked is good, 1 otherwise.
"""

from __future__ import annotations

import argparse

from lockstep.checkpoint.report import verify_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT_DIR")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    ok, report = verify_report(args.path)
    print(report)
    return 0 if ok else 1
