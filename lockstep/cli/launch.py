"""Launch training from a config on this node (all GPUs, or N CPU processes) or as one node of many.

One node:   lockstep launch run.yaml                      (one process per GPU; one process without GPUs)
            lockstep launch run.yaml --nproc 4            (4 processes)
Many nodes: lockstep launch run.yaml --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29500   (on node 0)
            lockstep launch run.yaml --nnodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29500   (on node 1)
Elastic:    lockstep launch run.yaml --nnodes 1:2 ...   (goes on with 1 node when one is lost, back to 2 when
            it rejoins; the global batch stays, accumulation makes up for the missing ranks)
Workers run `lockstep train --config CONFIG` under torchrun's elastic agent (c10d rendezvous).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
from pathlib import Path

from lockstep.cli.launch_options import add_launch_options, options_from, print_elastic_plan
from lockstep.cli.train import reporting_stops
from lockstep.cli.train_flags import overrides_from_args
from lockstep.config import load_config
from lockstep.config.overrides import apply_overrides
from lockstep.errors import ConfigError
from lockstep.launch.elastic import RendezvousLost, launch_workers, parse_endpoint
from lockstep.launch.options import elastic_plan
from lockstep.models.quantize import check_4bit_training
from lockstep.parallel.mesh import check_layout
from lockstep.run_dir import check_run_dir_writable
from lockstep.runtime import check_local_launch, default_local_processes, pick_device
from lockstep.train.mlflow_tracker import check_tracking_uri


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="training config (YAML)")
    p.add_argument(
        "--nproc", type=int, help="processes on this node (default: one per GPU, else 1)"
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to every worker, e.g. --set train.max_steps=100",
    )
    add_launch_options(
        p, nodes_help="nodes in the job, or a range for an elastic job (default: 1)", join=True
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    options = options_from(args)
    nodes = (options.min_nodes, options.nodes)
    if args.rdzv_endpoint is not None:
        parse_endpoint(args.rdzv_endpoint)  # a bad HOST:PORT: refused before anything starts
    overrides = overrides_from_args(args)
    cfg = load_config(args.config, overrides)
    # 0 is refused, not defaulted
    nproc = default_local_processes(cfg.distributed) if args.nproc is None else args.nproc
    if nproc < 1:
        raise ConfigError(
            f"--nproc {nproc} must be at least 1; pass the processes per node, or leave --nproc out "
            "for one per GPU (1 on a CPU)"
        )
    if args.node_rank is not None and not 0 <= args.node_rank < nodes[1]:
        raise ConfigError(
            f"--node-rank {args.node_rank} is not in 0..{nodes[1] - 1} (--nnodes {options.spec})"
        )
    worlds = [nproc * n for n in range(nodes[0], nodes[1] + 1)]
    span = str(worlds[0]) if len(worlds) == 1 else f"{worlds[0]}..{worlds[-1]}"
    if cfg.distributed.world_size is not None and [cfg.distributed.world_size] != worlds:
        raise ConfigError(
            f"nnodes({options.spec}) x nproc({nproc}) = {span} != distributed.world_size"
            f"({cfg.distributed.world_size}); change one, or drop world_size from the config"
        )
    check_local_launch(cfg.distributed, nproc, worlds[-1], cfg.train.mixed_precision)
    device = pick_device(cfg.distributed, 0, nproc)
    check_4bit_training(cfg.model, cfg.parallel.data_parallel, device)
    sets = list(args.sets)
    # batch and micro-batch fixed at the largest world; accumulation rises below it
    checked = cfg
    if options.elastic:
        batch, plans = elastic_plan(cfg, options.min_nodes, options.nodes, nproc)
        sets += [f"{k}={'none' if v is None else v}" for k, v in batch.items()]
        print_elastic_plan("lockstep", plans)
        checked = copy.deepcopy(cfg)  # as the workers will run it
        apply_overrides(checked, batch, "the elastic batch plan")
    else:
        # layout and batch arithmetic fail here, before any worker starts
        check_layout(cfg, worlds[0])
    from lockstep.plan.check import check_before_launch

    # a step that would not fit its device: refused (or a warning) here, not OOM in a worker; at the
    # smallest world (an elastic job's micro-batch is the same at every size, FSDP's shards largest)
    try:
        warning = check_before_launch(checked, worlds[0], nproc, device)
    except ConfigError as e:
        raise ConfigError(
            f"at {worlds[0]} ranks, the fewest this job may run at: {e}"
            if options.elastic
            else str(e)
        ) from None
    if warning:
        print(f"lockstep: WARNING: {warning}", file=sys.stderr, flush=True)
    check_run_dir_writable(cfg.checkpoint.output_dir)
    # an MLflow server that does not answer fails here, before any worker starts
    check_tracking_uri(cfg.train)
    worker_args = [
        "lockstep",
        "train",
        "--config",
        args.config,
        *(a for s in sets for a in ("--set", s)),
        "--launched-by-lockstep",
    ]
    print(
        f"lockstep: {nproc} worker(s) on this node, {span} in all, "
        f"through torchrun's elastic agent (restarts on a failure: {options.max_restarts}); logs in "
        f"{cfg.checkpoint.output_dir}/logs/",
        flush=True,
    )
    console_log = launcher_log(cfg.checkpoint.output_dir, 0 if nodes[1] == 1 else args.node_rank)
    # global rank 0 writes the checkpoints: its node says what a stop left (the others may not see its disk)
    try:
        with reporting_stops(cfg, speaks=nodes[1] == 1 or args.node_rank in (None, 0)):
            launch_workers(
                worker_args,
                nproc,
                nodes,
                rdzv_endpoint=args.rdzv_endpoint,
                node_rank=args.node_rank,
                max_restarts=options.max_restarts,
                rdzv_timeout=args.rdzv_timeout,
                rdzv_id=args.rdzv_id,
                rdzv_conf=options.rdzv_conf,
                console_log=console_log,
                external_store=args.rdzv_store == "external",
            )
    except RendezvousLost as e:
        print(f"lockstep launch: error: {e}", file=sys.stderr, flush=True)
        # torch's agent leaves its keep-alive thread blocked on the lost store; at interpreter exit C++ would
        # abort the process over it (SIGABRT, "terminate called without an active exception")
        os._exit(1)
    return 0


def launcher_log(output_dir: str, node_rank: int | None) -> Path:
    """RUN/logs/launcher_node<N>.log: this node's console in full, C++ frames too
    (lockstep.launch.elastic.CppFramesToLog).
    The nodes of a job may share the run directory: one file per node, named by host name when
    no --node-rank says which node this is."""
    node = socket.gethostname() if node_rank is None else f"node{node_rank}"
    return Path(output_dir) / "logs" / f"launcher_{node}.log"
