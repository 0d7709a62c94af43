"""`lockstep <command>`: each command is a module with `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import difflib
import sys
import traceback
from typing import NoReturn

from lockstep.cli import (
    check,
    doctor,
    evaluate,
    export,
    k8s,
    launch,
    merge,
    parity,
    plan,
    rendezvous,
    report,
    sample,
    slurm,
    split,
    train,
    verify,
)
from lockstep.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    GradientDivergence,
    GradientOverflow,
)
from lockstep.launch.elastic import LaunchInterrupted, WorkerFailed
from lockstep.runtime.process_end import exit_process

COMMANDS = {
    "train": train,
    "launch": launch,
    "doctor": doctor,
    "slurm": slurm,
    "k8s": k8s,
    "rendezvous": rendezvous,
    "verify": verify,
    "report": report,
    "sample": sample,
    "evaluate": evaluate,
    "check": check,
    "export": export,
    "parity": parity,
    "plan": plan,
    "split": split,
    "merge": merge,
}
USER_ERRORS = (
    ConfigError,
    DataError,
    CheckpointError,
    WorkerFailed,
    FileNotFoundError,
    GradientDivergence,
    GradientOverflow,
)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each command's own (for "did you mean" on a mistyped option)."""
    parser = argparse.ArgumentParser(
        prog="lockstep", description="Train PyTorch models on one process or many."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {}
    for name, module in COMMANDS.items():
        # no abbreviations: `--strateg ddp` would silently be --strategy and start a run; a mistyped
        # option gets "did you mean" instead
        commands[name] = sub.add_parser(
            name,
            help=module.__doc__.strip().splitlines()[0],
            description=module.__doc__,
            allow_abbrev=False,
        )
        module.add_arguments(commands[name])
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # only what the command honours: not the names it refuses (hidden, or dest "refused:")
        sub_options = [
            o
            for a in commands[args.command]._actions
            for o in a.option_strings
            if a.help != argparse.SUPPRESS and not a.dest.startswith("refused:")
        ]
        flag = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=")[0]
        close = difflib.get_close_matches(flag, sub_options, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; see `lockstep {args.command} --help`"
        print(f"lockstep {args.command}: error: unknown option {flag!r}{hint}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command].run(args, argv)
    except USER_ERRORS as e:
        if not getattr(e, "logged", False):
            print(f"lockstep {args.command}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except LaunchInterrupted as e:
        print(f"lockstep {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum
    except Exception as e:
        # set by `lockstep train` when training in this process crashed
        if not hasattr(e, "stop_note"):
            raise
        # run_training's log showed it (console and rank log)
        if not getattr(e, "traceback_logged", False):
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]  # the traceback above has the rest
        print(
            f"lockstep {args.command}: error: {type(e).__name__}: {first}; {e.stop_note}",
            file=sys.stderr,
        )
        return 1


def run_command(argv: list[str] | None = None) -> int:
    """main(), with an unexpected error printed as Python would (exit code 1, as Python gives)."""
    try:
        return main(argv)
    except Exception as e:
        # not twice: run_training logged it with its traceback
        if not getattr(e, "traceback_logged", False):
            traceback.print_exc()
        return 1


def entry() -> NoReturn:
    """The `lockstep` console script and `python -m lockstep`: the command, then the end of the process
    (process_end.py)."""
    exit_process(run_command())
