"""Launch training from a config on this node (all GPUs, or N CPU processes) or as one node of many.

One node:   lockstep launch run.yaml                      (one process per GPU; one process without GPUs)
            lockstep launch run.yaml --nproc 4            (4 processes)
Many nodes: lockstep launch run.yaml --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29500   (on node 0)
            lockstep launch run.yaml --nnodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29500   (on node 1)
Workers run `lockstep train --config CONFIG` under torchrun's elastic agent (c10d rendezvous).
"""

from __future__ import annotations

import argparse

from lockstep.cli.train import overrides_from_args, reporting_stops
from lockstep.errors import ConfigError
from lockstep.config import load_config
from lockstep.launch.elastic import launch_workers
from lockstep.run_dir import check_run_dir_writable
from lockstep.runtime import check_local_launch, default_local_processes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="training config (YAML)")
    p.add_argument("--nproc", type=int, help="processes on this node (default: one per GPU, else 1)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default: %(default)s)")
    p.add_argument("--node-rank", type=int, help="this node's rank; 0 hosts the rendezvous")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous (an address of node rank 0)")
    p.add_argument("--rdzv-id", help="job id shared by all nodes (default: $SLURM_JOB_ID or 'lockstep')")
    p.add_argument("--rdzv-timeout", type=float, default=120.0, help="seconds to wait for the other nodes")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the whole group this often on a failure")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override passed to every worker, e.g. --set train.max_steps=100")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_config(args.config, overrides_from_args(args))
    nproc = default_local_processes(cfg.distributed) if args.nproc is None else args.nproc  # 0 is refused, not defaulted
    if nproc < 1 or args.nnodes < 1:
        raise ConfigError(f"--nproc {nproc} and --nnodes {args.nnodes} must be at least 1; pass the processes per "
                          "node and the node count, or leave --nproc out for one per GPU (1 on a CPU)")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    world = nproc * args.nnodes
    if cfg.distributed.world_size not in (None, world):
        raise ConfigError(f"nnodes({args.nnodes}) x nproc({nproc}) = {world} != distributed.world_size"
                          f"({cfg.distributed.world_size}); change one, or drop world_size from the config")
    check_local_launch(cfg.distributed, nproc, world, cfg.train.mixed_precision)
    from lockstep.parallel.mesh import check_layout

    check_layout(cfg, world)  # layout and batch arithmetic fail here, before any worker starts
    check_run_dir_writable(cfg.checkpoint.output_dir)
    worker_args = ["lockstep", "train", "--config", args.config, *(a for s in args.sets for a in ("--set", s)),
                   "--launched-by-lockstep"]
    print(f"lockstep: {nproc} worker(s) on this node, {world} in all, through torchrun's elastic agent; "
          f"logs in {cfg.checkpoint.output_dir}/logs/", flush=True)
    # global rank 0 writes the checkpoints: its node says what a stop left (the others may not see its disk)
    with reporting_stops(cfg, speaks=args.nnodes == 1 or args.node_rank in (None, 0)):
        launch_workers(worker_args, nproc, args.nnodes, args.rdzv_endpoint, args.node_rank, args.max_restarts,
                       args.rdzv_timeout, args.rdzv_id)
    return 0
