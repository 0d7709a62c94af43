"""`lockstep parity`'s arguments (lockstep/cli/parity.py): N >= 2 processes, --steps, --tolerance
and --reference, refused before anything runs. Parity runs: tests/e2e/test_parity.py and, with
--reference, tests/e2e/test_train_parallel.py."""

from __future__ import annotations

from conftest import run_main

from lockstep.cli import build_parser


def test_help_and_defaults(capsys):
    code, out, _ = run_main(capsys, "parity", "--help")
    assert (
        code == 0
        and "--steps STEPS" in out
        and "--tolerance TOLERANCE" in out
        and "--world-size" in out
    )
    parser, _ = build_parser()
    args = parser.parse_args(["parity", "run.yaml"])
    assert (args.config_file, args.steps, args.tolerance) == ("run.yaml", 20, None)
    assert "--reference DIR" in out and args.reference is None
    assert parser.parse_args(["parity", "--tolerance", "1e-3"]).tolerance == 1e-3


def test_refused_before_anything_runs(tmp_path, capsys):
    out_dir = tmp_path / "run"
    cases = [
        ([], "parity compares 1 process with N: pass --world-size N with N >= 2 (got None)"),
        (
            ["--world-size", "1"],
            "parity compares 1 process with N: pass --world-size N with N >= 2 (got 1)",
        ),
        (["--world-size", "2", "--steps", "0"], "--steps 0 must be >= 1"),
    ]
    for argv, message in cases:
        assert run_main(capsys, "parity", "--output-dir", out_dir, *argv) == (
            2,
            "",
            f"lockstep parity: error: {message}\n",
        ), argv
    assert not out_dir.exists()


def test_a_value_of_the_wrong_type_is_argparses_error(capsys):
    code, out, err = run_main(capsys, "parity", "--world-size", "2", "--steps", "x")
    assert code == 2 and out == "" and "argument --steps: invalid int value: 'x'" in err


def test_a_folder_that_is_no_parity_reference_is_refused_before_anything_runs(tmp_path, capsys):
    # the messages of every refusal: tests/unit/tools/test_parity.py
    out_dir, folder = tmp_path / "run", tmp_path / "earlier"
    folder.mkdir()
    code, out, err = run_main(
        capsys,
        "parity",
        "--world-size",
        "2",
        "--steps",
        "3",
        "--output-dir",
        out_dir,
        "--reference",
        folder,
    )
    assert (code, out) == (2, "") and err == (
        f"lockstep parity: error: --reference {folder}: no parity-config.yaml there; --reference "
        "takes the parity/reference folder of an earlier `lockstep parity` (it holds "
        "parity-config.yaml and metrics.jsonl): pass that folder, or drop --reference to train the "
        "1-process reference\n"
    )
    assert not out_dir.exists()
