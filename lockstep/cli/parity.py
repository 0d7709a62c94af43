"""Train the same seed for K steps on 1 process and on N processes (ddp, fsdp, tp or pp as configured); compare losses.

Exit status 0 when every step's loss agrees within --tolerance (relative), 1 otherwise.
--reference DIR compares with the 1-process run of an earlier parity (its parity/reference folder)
instead of training it again: the reference is the same for every layout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.cli.train_flags import add_arguments as add_train_arguments
from lockstep.cli.train_flags import overrides_from_args
from lockstep.config import load_config
from lockstep.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config_file", nargs="?", metavar="CONFIG", help="config file (same as --config)"
    )
    add_train_arguments(p)
    p.add_argument("--steps", type=int, default=20, help="steps to compare (default %(default)s)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest relative loss difference accepted (default 1e-4 in fp32, 2e-2 with bf16/fp16)",
    )
    p.add_argument(
        "--reference",
        metavar="DIR",
        default=None,
        help="the parity/reference folder of an earlier `lockstep parity` with the same "
        "options: compare with its losses instead of training the 1-process run "
        "(refused when its config differs)",
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_config(args.config_file or args.config, overrides_from_args(args))
    world = cfg.distributed.world_size
    if not world or world < 2:
        raise ConfigError(
            f"parity compares 1 process with N: pass --world-size N with N >= 2 (got {world})"
        )
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be >= 1")
    tolerance = (
        args.tolerance
        if args.tolerance is not None
        else (1e-4 if cfg.train.mixed_precision == "no" else 2e-2)
    )
    if cfg.model.dropout > 0:
        print(
            f"lockstep parity: model.dropout = {cfg.model.dropout}: ranks draw different dropout masks, so losses "
            "differ by more than rounding; set --dropout 0 for a tight comparison",
            flush=True,
        )
    from lockstep.tools.parity import run_parity

    out = Path(cfg.checkpoint.output_dir) / "parity"
    reference = Path(args.reference) if args.reference is not None else None
    report = run_parity(cfg, world, args.steps, out, tolerance, reference_dir=reference)
    print(report.format())
    print(f"runs and logs: {out}")
    return 0 if report.ok else 1
