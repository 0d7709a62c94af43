"""The launch flags, declared once for `lockstep launch`, `slurm` and `k8s` (and `train`'s restarts), read
once into a LaunchOptions (lockstep.launch.options: the one rule set and the one default of each), and the
one place that prints an elastic job's batch plan."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from lockstep.errors import ConfigError
from lockstep.launch.options import ELASTIC_RESTARTS, LaunchOptions, launch_options

RESTARTS_HELP = f"restart the whole group this often on a failure (default: 0; {ELASTIC_RESTARTS} for a node range)"


def add_launch_options(
    p: argparse.ArgumentParser,
    nodes_help: str | None = None,
    *,
    join: bool = False,
    elastic: bool = True,
) -> None:
    """The launch flags, as one group: --nnodes / --nodes N|MIN:MAX (nodes_help=None leaves the node
    count out: a launch of this node's workers alone, `lockstep train`); with `join`, how this node joins
    the others (--node-rank, --rdzv-endpoint, --rdzv-store, --rdzv-id, --rdzv-timeout: `launch`,
    `doctor`); with
    `elastic`, --max-restarts and --rdzv-conf (not `doctor`'s, a fixed set of nodes measured once)."""
    g = p.add_argument_group("launch", "the job's nodes, its restarts on a failure, its rendezvous")
    if nodes_help is not None:
        g.add_argument(
            "--nnodes", "--nodes", dest="nnodes", default="1", metavar="N|MIN:MAX", help=nodes_help
        )
    if join:
        g.add_argument(
            "--node-rank",
            type=int,
            help="this node's rank; 0 hosts the rendezvous (and must stay up)",
        )
        g.add_argument(
            "--rdzv-endpoint",
            metavar="HOST:PORT",
            help="c10d rendezvous (an address of node rank 0)",
        )
        g.add_argument(
            "--rdzv-store",
            choices=("node0", "external"),
            default="node0",
            help="who serves the rendezvous: node rank 0's launcher (default; the job ends with "
            "node 0), or `lockstep rendezvous` on a host that runs no worker, at --rdzv-endpoint "
            "(the job outlives any node)",
        )
        g.add_argument(
            "--rdzv-id", help="job id shared by all nodes (default: $SLURM_JOB_ID or 'lockstep')"
        )
        g.add_argument(
            "--rdzv-timeout", type=float, default=120.0, help="seconds to wait for the other nodes"
        )
    if not elastic:
        return
    if nodes_help is not None:
        g.add_argument(
            "--rdzv-conf",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="c10d rendezvous setting, as torchrun's (e.g. last_call_timeout=10: seconds an "
            "elastic job waits for more nodes once MIN are there; default 30)",
        )
    g.add_argument("--max-restarts", type=int, help=RESTARTS_HELP)


def options_from(args: argparse.Namespace) -> LaunchOptions:
    """The group's flags as parsed by argparse -> LaunchOptions (ConfigError with the rule and the fix)."""
    nodes, restarts = getattr(args, "nnodes", "1"), getattr(args, "max_restarts", None)
    return launch_options(nodes, restarts, getattr(args, "rdzv_conf", []))


def key_values(items: list[str], flag: str) -> dict[str, str]:
    """`FLAG KEY=VALUE` (repeatable: --env, --set) -> {KEY: VALUE}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} {item!r} is not KEY=VALUE; e.g. {flag} NCCL_DEBUG=INFO")
        out[key.strip()] = value
    return out


def print_elastic_plan(command: str, plans: list[str], file: TextIO | None = None) -> None:
    """An elastic job's batch plan at each world size, once, before it starts (or its files are written)."""
    if plans:
        print(
            f"{command}: elastic job; the batch plan at each world size:\n  " + "\n  ".join(plans),
            file=file or sys.stdout,
            flush=True,
        )
