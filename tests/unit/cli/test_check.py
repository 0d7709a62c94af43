"""`lockstep check`'s arguments (lockstep/cli/check.py): train's flags plus --steps, one config file, and the
layouts it refuses before any worker starts. Checks that run: tests/unit/parallel/test_ddp_check.py and tests/e2e."""

from __future__ import annotations

from conftest import run_main

from lockstep.cli import build_parser
from lockstep.cli.train_flags import FLAGS, overrides_from_args


def test_help_lists_train_flags_and_steps(capsys):
    code, out, _ = run_main(capsys, "check", "--help")
    assert code == 0 and "--steps K" in out and "steps to check (default 2)" in out
    assert all(flag in out for flag in FLAGS) and "CONFIG" in out


def test_steps_and_flags_become_overrides():
    parser, _ = build_parser()
    args = parser.parse_args(["check", "run.yaml", "--steps", "3", "--world-size", "2"])
    assert args.config_file == "run.yaml" and args.config is None
    assert overrides_from_args(args) == {"parallel.check_steps": "3", "distributed.world_size": "2"}


def test_refused_before_any_worker_starts(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("train: {max_steps: 4}\n")
    cases = [
        (
            [config, "--config", tmp_path / "other.yaml"],
            f"two config files given ({config} and --config {tmp_path / 'other.yaml'}); pass one",
        ),
        (
            ["--set", "parallel.data_parallel=fsdp", "--world-size", "2"],
            "lockstep check tests DDP settings; with parallel.data_parallel: fsdp or tensor/pipeline parallelism there "
            "is no DDP reducer, and unused parameters need no setting",
        ),
        (
            ["--world-size", "3", "--global-batch-size", "32", "--micro-batch-size", "4"],
            "global batch 32 is not divisible by world_size(3) x micro_batch_size(4) = 12; set train.batch_size to a "
            "multiple of 12",
        ),
        (
            ["--steps", "many"],
            "parallel.check_steps = 'many' (from command line) must be an integer; got str",
        ),
    ]
    for argv, message in cases:
        assert run_main(capsys, "check", *argv) == (2, "", f"lockstep check: error: {message}\n"), (
            argv
        )
