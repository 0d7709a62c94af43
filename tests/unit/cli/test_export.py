"""`lockstep export`'s arguments (lockstep/cli/export.py): the required output, --merge-lora, and a path without
a checkpoint refused in one line. Exports of trained checkpoints: tests/unit/tools/test_export.py and
tests/unit/tools/test_merge.py."""

from __future__ import annotations

from conftest import run_main

from lockstep.cli import build_parser


def test_arguments(capsys):
    parser, _ = build_parser()
    args = parser.parse_args(["export", "runs/a", "-o", "out", "--merge-lora"])
    assert (args.checkpoint, args.output, args.merge_lora) == ("runs/a", "out", True)
    assert parser.parse_args(["export", "runs/a", "--output", "out"]).merge_lora is False
    code, out, err = run_main(capsys, "export", "runs/a")
    assert code == 2 and out == "" and "the following arguments are required: -o/--output" in err
    code, out, _ = run_main(capsys, "export", "--help")
    assert code == 0 and "CHECKPOINT_OR_RUN_DIR" in out and "--merge-lora" in out


def test_a_path_without_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert run_main(capsys, "export", tmp_path / "empty", "-o", tmp_path / "out") == (
        1,
        "",
        f"lockstep export: error: {tmp_path / 'empty'} is an empty directory; pass a run directory that has "
        "checkpoints, or one of its checkpoints (RUN/checkpoints/step_N)\n",
    )
    assert not (tmp_path / "out").exists()
