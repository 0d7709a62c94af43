"""Check the job from every rank: devices, versions, all-reduce and bandwidth, ring, filesystem, clocks, env.

Outside a launcher, `--nproc N` starts N local workers through torchrun's elastic agent (as
`lockstep train --world-size N` does); under torchrun or srun every rank joins the group. Rank 0
prints one table (or one JSON document with --json); the exit code is 1 when a check fails, and
every failure comes with a fix line. `--config CFG.yaml` (and `--set`) adds one check: the config's gradient
all-reduce per step on this cluster's measured bandwidth against its compute, and the parallel.grad_compression
that pays (lockstep.doctor.comm_check).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from lockstep.cli.launch_options import add_launch_options, options_from
from lockstep.config import Config, load_config, parse_sets
from lockstep.doctor import DEFAULT_OUTPUT_DIR, DoctorError, format_report, parse_size, run_doctor
from lockstep.errors import ConfigError
from lockstep.launch.elastic import WorkerFailed, launch_workers
from lockstep.runtime import under_launcher


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="start N local workers (outside a launcher); default one per GPU, else 1",
    )
    p.add_argument(
        "--output-dir",
        default=DEFAULT_OUTPUT_DIR,
        metavar="DIR",
        help=f"where training writes: probed for writes, sharing, free space (default {DEFAULT_OUTPUT_DIR})",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON document instead of the table"
    )
    p.add_argument(
        "--max-size",
        default="64MiB",
        metavar="SIZE",
        help="largest all_reduce in the bandwidth table",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds for rendezvous and for each collective before the doctor gives up",
    )
    p.add_argument(
        "--config",
        metavar="CFG.yaml",
        help="also estimate this training config's gradient all-reduce against its compute on this "
        "cluster, and say which parallel.grad_compression pays",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of --config (as for lockstep train); alone, of the default config",
    )
    add_launch_options(
        p,
        nodes_help="nodes in the job; run the doctor on each (default 1)",
        join=True,
        elastic=False,
    )
    # set by the launching process for its workers
    p.add_argument("--report-file", help=argparse.SUPPRESS)


def _print(report: dict, as_json: bool) -> None:
    print(json.dumps(report, indent=1) if as_json else format_report(report), flush=True)


def load_training_config(path: str | None, sets: list[str]) -> Config | None:
    """The config `--config` / `--set` describe, checked for what the estimate can model; None without both."""
    if path is None and not sets:
        return None
    from lockstep.doctor.comm_check import check_estimable

    cfg = load_config(path, parse_sets(sets))
    check_estimable(cfg)
    return cfg


def run(args: argparse.Namespace, argv: list[str]) -> int:
    options = options_from(args)
    if options.elastic:
        raise ConfigError(
            f"--nnodes {options.spec}: the doctor measures a fixed set of nodes; pass their count N "
            "(run it on each node)"
        )
    nnodes = options.nodes
    max_bytes = parse_size(args.max_size)
    config = load_training_config(args.config, args.sets)
    nproc = (torch.cuda.device_count() or 1) if args.nproc is None else args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be at least 1")
    if under_launcher() or (nproc == 1 and nnodes == 1):
        try:
            report = run_doctor(args.output_dir, max_bytes, args.timeout, config=config)
        except DoctorError as e:
            print(f"lockstep doctor: error: {e}", file=sys.stderr, flush=True)
            return 1
        # a worker of ours: its node's launching process prints and sets the exit code
        if args.report_file:
            if report.local_rank == 0:  # every rank holds the whole report; one per node writes it
                Path(args.report_file).write_text(json.dumps(report.to_dict()))
            return 0
        if report.rank == 0:
            _print(report.to_dict(), args.json)
        return 0 if report.ok else 1
    with tempfile.TemporaryDirectory(prefix="lockstep-doctor-") as tmp:
        report_file = Path(tmp) / "report.json"
        print(
            f"lockstep doctor: starting {nproc} worker(s) on this node ({nproc * nnodes} in all) with "
            "torchrun's elastic agent",
            file=sys.stderr,
            flush=True,
        )
        passed = ["--config", str(Path(args.config).absolute())] if args.config else []
        passed += [arg for item in args.sets for arg in ("--set", item)]
        try:
            launch_workers(
                [
                    "lockstep",
                    "doctor",
                    "--output-dir",
                    str(Path(args.output_dir).absolute()),
                    "--max-size",
                    str(max_bytes),
                    "--timeout",
                    str(args.timeout),
                    "--report-file",
                    str(report_file),
                    *passed,
                ],
                nproc,
                (nnodes, nnodes),
                rdzv_endpoint=args.rdzv_endpoint,
                node_rank=args.node_rank,
                rdzv_timeout=args.rdzv_timeout,
                rdzv_id=args.rdzv_id,
                external_store=args.rdzv_store == "external",
            )
        except WorkerFailed as e:
            print(
                f"lockstep doctor: error: a worker stopped before the report was written "
                f"({e.failed}); its error is above",
                file=sys.stderr,
            )
            return 1
        report = json.loads(report_file.read_text())
    _print(report, args.json)
    return 0 if report["ok"] else 1
