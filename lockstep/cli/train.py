"""Train a model (the built-in GPT, a Hugging Face model or your own) on this machine, under
torchrun or srun.

Outside a launcher, `--world-size N` starts N local workers through torchrun's elastic agent, after
the checks that need no worker (the layout, the plan's memory check, the port, the run directory);
under torchrun or srun, or started by hand with `--rank`, the process joins the existing group. Its
flags (lockstep's own, HF Trainer's and Lightning's names, `--set`): lockstep/cli/train_flags.py.
"""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.checkpoint.report import mark_latest, stop_note
from lockstep.cli.hf_args import uses_hf_names
from lockstep.cli.hf_defaults import differing_defaults
from lockstep.cli.launch_options import options_from
from lockstep.cli.train_flags import add_arguments, overrides_from_args
from lockstep.config import Config, dump_config, load_config
from lockstep.errors import CheckpointError, ConfigError, DataError
from lockstep.launch.elastic import LaunchStopped, launch_local
from lockstep.models.quantize import check_4bit_training
from lockstep.parallel.buffers import check_sync_batchnorm
from lockstep.run_dir import check_run_dir_writable
from lockstep.runtime import (
    check_local_launch,
    check_port_free,
    default_local_processes,
    pick_device,
    read_launch_env,
    under_launcher,
)
from lockstep.train.mlflow_tracker import check_tracking_uri

if TYPE_CHECKING:
    from lockstep.train.run import Preflight

__all__ = ["add_arguments", "run", "train_here", "reporting_stops"]  # add_arguments: the flags'


def run(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_config(args.config, overrides_from_args(args))
    options = options_from(args)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    # HF names in use: say once which lockstep defaults differ from HF Trainer's (the process that
    # parsed the flags; the workers `lockstep train` itself starts stay quiet)
    note = (
        differing_defaults(cfg) if uses_hf_names(args) and not args.launched_by_lockstep else None
    )
    if note and read_launch_env(cfg.distributed).rank == 0:
        print(f"lockstep: {note}", flush=True)
    if under_launcher() or cfg.distributed.rank is not None:
        if args.max_restarts and not args.launched_by_lockstep:
            raise ConfigError(
                f"--max-restarts {args.max_restarts}: this process was started by a launcher, which "
                "decides the restarts (torchrun --max-restarts, `lockstep launch --max-restarts`); "
                "drop it here"
            )
        env = read_launch_env(cfg.distributed)
        preflight = None  # lockstep's own launcher checked before it started this worker
        if not args.launched_by_lockstep:
            from lockstep.plan.check import check_on_rank0

            preflight = check_on_rank0(cfg, env)
        # every rank runs this command: global rank 0 alone says what a stop left, unless our
        # launcher does
        train_here(cfg, speaks=not args.launched_by_lockstep and env.rank == 0, preflight=preflight)
        return 0  # a signal-stopped worker exits 0: its launcher reports the signal itself
    nproc = cfg.distributed.world_size or default_local_processes(cfg.distributed)
    check_local_launch(cfg.distributed, nproc, nproc, cfg.train.mixed_precision)
    # a 4-bit base off CUDA, under FSDP or without bitsandbytes: one line, before a worker loads it
    device = pick_device(cfg.distributed, 0, nproc)
    check_4bit_training(cfg.model, cfg.parallel.data_parallel, device)
    # SyncBatchNorm off CUDA: one line here, not one per worker after they start
    check_sync_batchnorm(cfg.parallel.sync_batchnorm, cfg.parallel.data_parallel, device, nproc)
    from lockstep.parallel.mesh import check_layout
    from lockstep.plan.check import check_before_launch

    check_layout(cfg, nproc)  # layout and batch arithmetic fail here, before any worker starts
    # a step that would not fit its device: refused (or a warning) here, not OOM in every worker
    warning = check_before_launch(cfg, nproc, nproc, device)
    if warning:
        print(f"lockstep: WARNING: {warning}", file=sys.stderr, flush=True)
    if cfg.distributed.master_port is not None:
        check_port_free("127.0.0.1", cfg.distributed.master_port)
    check_run_dir_writable(cfg.checkpoint.output_dir)
    # an MLflow server that does not answer fails here, before any worker starts
    check_tracking_uri(cfg.train)
    if cfg.data.kind == "text":
        from lockstep.data.text import prepare_tokens

        # tokenize once here; workers find the cache
        prepare_tokens(cfg.data, seq_len=cfg.model.max_seq_length)
    if nproc == 1 and not options.max_restarts:  # restarts need torch's agent, even for one worker
        stop_signal = train_here(cfg, speaks=True)
        return 128 + stop_signal if stop_signal else 0
    restarts = f", restarts on a failure: {options.max_restarts}" if options.max_restarts else ""
    workers = f"{nproc} worker{'s' if nproc != 1 else ''}"
    print(
        f"lockstep: starting {workers} with torchrun's elastic agent{restarts}; logs in "
        f"{cfg.checkpoint.output_dir}/logs/",
        flush=True,
    )
    with reporting_stops(cfg):
        launch_local(
            ["lockstep", *argv, "--launched-by-lockstep"],
            nproc,
            cfg.distributed.master_port,
            max_restarts=options.max_restarts,
        )
    return 0


def train_here(cfg: Config, speaks: bool, preflight: Preflight | None = None) -> int | None:
    """run_training in this process (`preflight`: rank 0's check, plan.check.check_on_rank0); the
    signal that stopped it early (after its commit), or None when it finished.

    When `speaks`, a stop (signal, Ctrl-C, crash) also says what the run left on disk: the
    checkpoint it committed or that it committed none, and what the same command would resume
    from.
    """
    # heavy imports only once the config is known to be good
    from lockstep.tools.final import write_final_outputs
    from lockstep.train.run import run_training

    run_dir = Path(cfg.checkpoint.output_dir)
    before = mark_latest(run_dir)

    def note() -> str:  # read when it stops: what is on disk and in this node's memory then
        return stop_note(run_dir, before, cfg.checkpoint.resume, cfg.checkpoint.memory_dir)

    try:
        result = run_training(cfg, preflight)
        write_final_outputs(cfg, result)  # rank 0 of a run that finished; the group is gone
        stop_signal = result.stop_signal
    # a second Ctrl-C, or one before the loop: no stop-time commit was waited for
    except KeyboardInterrupt:
        if speaks:
            print(
                f"lockstep train: interrupted by Ctrl-C; {note()}",
                file=sys.stderr,
                flush=True,
            )
        return signal.SIGINT
    except (ConfigError, DataError, CheckpointError):
        raise  # the user's to fix, and the message says how
    except Exception as e:
        if speaks:
            e.stop_note = note()  # type: ignore[attr-defined]
        raise
    if stop_signal and speaks:
        print(
            f"lockstep train: stopped by signal {stop_signal} ({signal.Signals(stop_signal).name}); "
            f"{note()}",
            file=sys.stderr,
            flush=True,
        )
    return stop_signal


@contextmanager
def reporting_stops(cfg: Config, speaks: bool = True):
    """Workers started here that end early (a signal, a crash, a hang) end the launcher's message
    with what the run left on disk; `speaks` False (a node that does not hold global rank 0) leaves
    that to rank 0's node."""
    run_dir = Path(cfg.checkpoint.output_dir)
    before = mark_latest(run_dir)
    try:
        yield
    except LaunchStopped as e:
        if speaks:
            e.note = stop_note(run_dir, before, cfg.checkpoint.resume, cfg.checkpoint.memory_dir)
        raise
