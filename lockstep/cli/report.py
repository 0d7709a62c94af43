"""Where a run's step time went, by rank and cause: a table, and RUN/step_times.png; and its loss
curve, RUN/loss.png (what a run with `train.plots: false` did not draw at its end).

Exit status 0 when the run's metrics.jsonl holds per-rank step times, 1 otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.config import TrainConfig
from lockstep.errors import ConfigError
from lockstep.metrics import plot_loss
from lockstep.train.step_report import plot, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holding metrics.jsonl)")
    p.add_argument(
        "--margin",
        type=float,
        default=TrainConfig.straggler_margin,
        help="a rank is behind when its own time is this share above the others' median "
        f"(train.straggler_margin's default, {TrainConfig.straggler_margin})",
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    metrics = Path(args.run_dir) / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no such file; RUN_DIR is a run's output_dir")
    if args.margin <= 0:
        raise ConfigError(f"--margin {args.margin}: must be above 0, e.g. 0.5")
    print(table(metrics, args.margin))
    loss = plot_loss(metrics, metrics.parent / "loss.png")
    if loss:
        print(f"\nloss curve: {loss}")
    png = plot(metrics, metrics.parent / "step_times.png", args.margin)
    if png is None:
        return 1
    print(f"\npicture: {png}")
    return 0
