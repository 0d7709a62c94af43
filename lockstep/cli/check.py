"""Check that a model trains correctly under DDP: unused parameters per step, the settings chosen, ranks agreeing.

Takes the same config and flags as `lockstep train`. Exit status 0 when DDP with the chosen
settings ran the checked steps with identical gradients on every rank, 1 otherwise.
"""

from __future__ import annotations

import argparse

from lockstep.cli.train_flags import add_arguments as add_train_arguments
from lockstep.cli.train_flags import overrides_from_args
from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.launch.elastic import launch_local
from lockstep.parallel.mesh import resolve_batch
from lockstep.runtime import check_local_launch, default_local_processes, under_launcher


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config_file", nargs="?", metavar="CONFIG", help="config file (same as --config)"
    )
    add_train_arguments(p)
    p.add_argument(
        "--steps", dest="parallel.check_steps", metavar="K", help="steps to check (default 2)"
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.config_file and args.config and args.config_file != args.config:
        raise ConfigError(
            f"two config files given ({args.config_file} and --config {args.config}); pass one"
        )
    cfg = load_config(args.config_file or args.config, overrides_from_args(args))
    from lockstep.tools.check import run_check

    if under_launcher() or cfg.distributed.rank is not None:
        return 0 if run_check(cfg).problem is None else 1
    nproc = cfg.distributed.world_size or default_local_processes(cfg.distributed)
    check_local_launch(cfg.distributed, nproc, nproc, cfg.train.mixed_precision)
    resolve_batch(cfg.train, nproc)
    if (
        cfg.parallel.data_parallel != "ddp"
        or cfg.parallel.tensor_parallel > 1
        or cfg.parallel.pipeline_parallel > 1
    ):
        raise ConfigError(
            "lockstep check tests DDP settings; with parallel.data_parallel: fsdp or tensor/pipeline "
            "parallelism there is no DDP reducer, and unused parameters need no setting"
        )
    if nproc == 1:
        return 0 if run_check(cfg).problem is None else 1
    # raises WorkerFailed on exit 1
    launch_local(["lockstep", *argv], nproc, cfg.distributed.master_port)
    return 0
