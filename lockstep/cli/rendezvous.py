"""Serve a job's rendezvous store on a host that runs no worker, so the job outlives any node.

On a host every node reaches (not one of the job's nodes):
    lockstep rendezvous --host 10.0.0.9 --port 29400
On each node:
    lockstep launch run.yaml --nnodes 2:3 --rdzv-endpoint 10.0.0.9:29400 --rdzv-store external

It runs until SIGTERM or Ctrl-C, or with --until-closed RDZV_ID until that job has ended
(lockstep.launch.store).
"""

from __future__ import annotations

import argparse

from lockstep.launch.store import serve_store, stop_on_signals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (default: every address)"
    )
    p.add_argument("--port", type=int, default=29400, help="TCP port (default: 29400)")
    p.add_argument(
        "--until-closed",
        metavar="RDZV_ID",
        help="end once the job with this --rdzv-id has ended (its agents close the rendezvous when "
        "it finishes or its workers fail for good); by default it runs until SIGTERM or Ctrl-C",
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    stop = stop_on_signals()

    ends = "Ctrl-C or SIGTERM ends it" + (
        f", or the end of job {args.until_closed}" if args.until_closed else ""
    )

    def ready(address: str) -> None:
        print(
            f"lockstep rendezvous: serving the store at {address}; start every node with "
            f"--rdzv-endpoint {args.host if args.host != '0.0.0.0' else 'THIS_HOST'}:{args.port} "
            f"--rdzv-store external ({ends})",
            flush=True,
        )

    serve_store(args.host, args.port, stop, ready, until_closed=args.until_closed)
    return 0
