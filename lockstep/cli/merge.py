"""Average the weights of checkpoints of one model (copies trained on parts of the data) into a new run dir."""

from __future__ import annotations

import argparse

from lockstep.errors import ConfigError
from lockstep.tools.merge import merge_checkpoints


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CHECKPOINT_OR_RUN_DIR",
        help="2 or more; a run dir stands for its newest checkpoint that verifies",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="new run dir: OUT/checkpoints/step_N (+ OUT/final for hf models)",
    )
    p.add_argument(
        "--weights",
        metavar="W1,W2,...",
        help="one weight per checkpoint, >= 0, normalized to sum 1 (default: equal)",
    )


def parse_weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--weights {text!r} is not a comma-separated list of numbers; e.g. --weights 0.7,0.3"
        ) from None


def run(args: argparse.Namespace, argv: list[str]) -> int:
    merge_checkpoints(args.checkpoints, args.output, parse_weights(args.weights))
    return 0
