"""Render an sbatch script for a training config and submit it (or print it with --dry-run).

One srun task per node runs torchrun with a c10d rendezvous on the allocation's first node. The job is
a config file, `lockstep train`'s flags (HF Trainer and Lightning names included), or both; each flag reaches the workers
as the --set KEY=VALUE it resolves to. The script is checked (GPUs vs processes, nodes x processes vs
distributed.world_size, batch arithmetic, variables left for the job to expand, bash syntax) before anything
is submitted. `--nodes MIN:MAX` renders an elastic job, whose batch plan at each world size is printed.
"""

from __future__ import annotations

import argparse
import sys

from lockstep.cli.launch_options import (
    add_launch_options,
    key_values,
    options_from,
    print_elastic_plan,
)
from lockstep.cli.lightning_args import DEST
from lockstep.cli.train_flags import add_config_flags, overrides_from_args
from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.launch.options import elastic_plan
from lockstep.launch.slurm import SlurmSettings, check_settings, render_sbatch
from lockstep.launch.slurm_submit import SubmitError, submit_sbatch


def _text(value: object) -> str:
    """An override as the worker's --set reads it back: none, true / false, or the string given."""
    return (
        "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config",
        metavar="CONFIG",
        nargs="?",
        help="training config (YAML) the workers load; optional when the training flags say it all",
    )
    add_launch_options(
        p,
        nodes_help="nodes (default 1), or a range for an elastic job that trains on the nodes "
        "left when one fails",
    )
    p.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node; 0 = CPU workers (default)"
    )
    p.add_argument(
        "--procs-per-node",
        type=int,
        help="CPU worker processes per node (default: one per GPU, or 1)",
    )
    p.add_argument(
        "--cpus-per-task",
        type=int,
        help="CPUs for each node's task (its torchrun and all its workers); OMP_NUM_THREADS = this / "
        "processes. Default: the partition's smallest node from sinfo (a GPU job: its GPUs' share), "
        "else 8 per GPU worker or 1 per CPU worker, at least 1 + data.num_workers each (auto "
        "counts as 1)",
    )
    p.add_argument("--time", help="time limit, e.g. 04:00:00 or 2-00:00:00")
    p.add_argument("--partition", help="partition (checked with sinfo before submission)")
    p.add_argument("--account", help="account to charge")
    p.add_argument("--job-name", default="lockstep", help="job name (default lockstep)")
    p.add_argument(
        "--env-setup",
        metavar="SHELL_LINE",
        help="activates the environment, e.g. 'source .venv/bin/activate' or 'conda activate train'",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="variable exported in the job (repeatable); $VARS expand when the job runs",
    )
    p.add_argument(
        "--log-dir", default="slurm-logs", help="directory of the job log (default slurm-logs)"
    )
    p.add_argument(
        "--requeue",
        action="store_true",
        help="on preemption / time limit: workers commit a checkpoint, the job requeues and resumes",
    )
    p.add_argument(
        "--port", type=int, default=29500, help="rendezvous port on the first node (default 29500)"
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to every worker, e.g. --set train.max_steps=5000",
    )
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="DIRECTIVE",
        help="further #SBATCH directive, e.g. --sbatch-arg=--qos=high (repeatable)",
    )
    p.add_argument(
        "--rdzv-store",
        choices=("node0", "external"),
        default="node0",
        help="an elastic job's rendezvous store: the first node's torchrun (default), or a node of "
        "its own that runs the batch script and no worker, in a heterogeneous job (MAX + 1 "
        "nodes): the job then outlives any worker node",
    )
    p.add_argument(
        "--store-partition",
        metavar="NAME",
        help="--rdzv-store external: the store node's partition (default: --partition)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the script instead of submitting it"
    )
    # as for `lockstep train`; each reaches every worker as --set KEY=VALUE, after the config file
    add_config_flags(p, heading="training flags")


# Lightning's process counts -> how `lockstep slurm` sizes the job (its own flags, not config keys)
SIZED_BY = {
    "num_nodes": "--nodes N",
    "devices": "--gpus-per-node N (GPU workers) or --procs-per-node N (CPU workers)",
}


def run(args: argparse.Namespace, argv: list[str]) -> int:
    key_values(args.sets, "--set")  # its KEY=VALUE message
    for name, flags in SIZED_BY.items():
        value = getattr(args, f"{DEST}{name}", None)
        if value is not None:
            raise ConfigError(
                f"--{name} {value}: `lockstep slurm` sizes the job with {flags}; pass that instead"
            )
    overrides = overrides_from_args(args)
    cfg = load_config(args.config, overrides)
    options = options_from(args)
    settings = SlurmSettings(
        config=args.config,
        **options.as_settings(),
        gpus_per_node=args.gpus_per_node,
        procs_per_node=args.procs_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        partition=args.partition,
        account=args.account,
        job_name=args.job_name,
        env_setup=args.env_setup,
        extra_env=key_values(args.env, "--env"),
        log_dir=args.log_dir,
        requeue=args.requeue,
        port=args.port,
        rdzv_store=args.rdzv_store,
        store_partition=args.store_partition,
        overrides={k: _text(v) for k, v in overrides.items()},
        sbatch_args=args.sbatch_arg,
    )
    script = render_sbatch(settings, cfg)
    _, plans = elastic_plan(cfg, options.min_nodes, options.nodes, check_settings(settings, cfg))
    # a --dry-run's stdout is the script alone
    print_elastic_plan("lockstep slurm", plans, file=sys.stderr)
    if args.dry_run:
        print(script, end="")
        return 0
    try:
        job_id, log = submit_sbatch(settings, script)
    except SubmitError as e:
        print(f"lockstep slurm: error: {e}", file=sys.stderr)
        return 1
    print(f"submitted job {job_id}; log: {log}")
    return 0
