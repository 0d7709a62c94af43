"""`lockstep sample`'s arguments (lockstep/cli/sample.py): the generation settings and their defaults, and a path
without a checkpoint refused in one line. Samples from trained checkpoints: tests/e2e/test_cli_run.py and
tests/unit/tools/test_sample.py."""

from __future__ import annotations

from conftest import run_main
from lockstep.cli import build_parser


def test_defaults_and_values():
    parser, _ = build_parser()
    args = parser.parse_args(["sample", "runs/a"])
    assert (args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed) == \
           ("runs/a", "def ", 200, 0.8, 50, 0)
    args = parser.parse_args(["sample", "runs/a", "--prompt", "x", "--max-new-tokens", "5", "--temperature", "0",
                              "--top-k", "0", "--seed", "3"])
    assert (args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed) == ("x", 5, 0.0, 0, 3)


def test_bad_values(tmp_path, capsys):
    code, out, err = run_main(capsys, "sample", "runs/a", "--temperature", "hot")
    assert code == 2 and out == "" and "argument --temperature: invalid float value: 'hot'" in err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    code, out, err = run_main(capsys, "sample", tmp_path / "run")
    assert code == 1 and out == "" and err == (
        f"lockstep sample: error: run directory {tmp_path / 'run'} holds no committed checkpoint yet "
        f"({tmp_path / 'run' / 'checkpoints'} has no step_N directory: its training saved none); pass a run directory "
        "that has checkpoints, or one of its checkpoints (RUN/checkpoints/step_N)\n")
