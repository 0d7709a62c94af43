"""Plan a job before booking its devices: memory per rank by part, communication per step and the
step's time for a layout at any world size, on a device profile (lockstep/plan/).

Takes the same config and flags as `lockstep train` (every --set too), plus the world it would run
on (--nnodes x --gpus-per-node, or --world-size) and --device-profile. Exit status 0 when the plan
fits the device's memory, 1 when it does not (with what one setting changed would need), 2 for a
layout lockstep refuses, with train's own message (with --choose, and the layouts it can train
instead).
"""

from __future__ import annotations

import argparse

from lockstep.cli.train_flags import add_arguments as add_train_arguments
from lockstep.cli.train_flags import overrides_from_args
from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.plan.profiles import PROFILES, load_profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config_file", nargs="?", metavar="CONFIG", help="config file (same as --config)"
    )
    add_train_arguments(p)
    where = p.add_argument_group("plan")
    where.add_argument("--nnodes", type=int, default=1, help="nodes the job would run on")
    where.add_argument(
        "--gpus-per-node", type=int, default=8, metavar="N", help="devices per node (default 8)"
    )
    where.add_argument(
        "--device-profile",
        default="h100-80gb",
        metavar="NAME|YAML|JSON",
        help=f"{', '.join(PROFILES)} (default h100-80gb), a YAML file of a device's values, or "
        "the report of `lockstep doctor --json` (the cluster as measured)",
    )
    where.add_argument(
        "--choose",
        action="store_true",
        help="compare the layouts that fit (DDP, FSDP2, TP, PP, activation checkpointing, "
        "micro-batch) and print the fastest with its flags",
    )


def world_size(args: argparse.Namespace, configured: int | None) -> int:
    if args.nnodes < 1 or args.gpus_per_node < 1:
        raise ConfigError(
            f"--nnodes {args.nnodes} --gpus-per-node {args.gpus_per_node}: both must be >= 1"
        )
    world = args.nnodes * args.gpus_per_node
    if configured is not None and configured != world and args.nnodes != 1:
        raise ConfigError(
            f"--world-size {configured} but --nnodes {args.nnodes} x --gpus-per-node "
            f"{args.gpus_per_node} = {world}; give one of them"
        )
    return configured or world


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from lockstep.plan.build import make_plan
    from lockstep.plan.choose import choose, fixes
    from lockstep.plan.report import choice_lines, describe

    if args.config_file and args.config and args.config_file != args.config:
        raise ConfigError(
            f"two config files given ({args.config_file} and --config {args.config}); pass one"
        )
    cfg = load_config(args.config_file or args.config, overrides_from_args(args))
    profile = load_profile(args.device_profile)
    world = world_size(args, cfg.distributed.world_size)
    gpus = min(args.gpus_per_node, world)
    if cfg.train.mixed_precision == "auto":  # every profile's device computes bf16
        cfg.train.mixed_precision = "bf16"
    try:
        plan = make_plan(cfg, world, gpus, profile)
    except ConfigError as e:
        if not args.choose:
            raise
        # the layout asked for is refused, but the choice among those lockstep can train stands
        print(f"the layout asked for is refused: {e}\n")
        print("\n".join(choice_lines(*choose(cfg, world, gpus, profile))))
        return 2
    print("\n".join(describe(plan)))
    if args.choose:
        plans, refused = choose(cfg, world, gpus, profile)
        print("\n" + "\n".join(choice_lines(plans, refused)))
    if plan.fits:
        return 0
    print(
        f"\nthis layout needs {plan.peak / 2**30:.1f} GiB per device of "
        f"{profile.usable_bytes / 2**30:.1f} usable on {profile.name}; one setting changed:"
    )
    print(
        "\n".join(f"  {line}" for line in fixes(plan))
        or "  (none of FSDP, checkpointing, a "
        "smaller micro-batch alone; try --choose, or more devices)"
    )
    return 1
