"""`lockstep verify`'s arguments and exit status (lockstep/cli/verify.py): the report on stdout, 0 when what was
checked is good, 1 otherwise. Reports on trained checkpoints: tests/unit/checkpoint/test_report.py and
tests/e2e/test_bad_input.py."""

from __future__ import annotations

from conftest import run_main


def test_a_run_without_checkpoints_is_good(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert run_main(capsys, "verify", tmp_path / "run") == (
        0,
        f"run {tmp_path / 'run'}: 0 checkpoints\nlatest: missing\n--resume auto would take: nothing (start fresh)\n",
        "",
    )


def test_what_is_not_good_exits_1(tmp_path, capsys):
    damaged = tmp_path / "run" / "checkpoints" / "step_00000001"
    damaged.mkdir(parents=True)
    code, out, _ = run_main(capsys, "verify", damaged)
    assert code == 1 and out.splitlines() == [
        f"checkpoint {damaged}",
        "  problem: manifest.json: missing (the save never finished)",
        "verdict: DAMAGED",
    ]
    code, out, _ = run_main(capsys, "verify", tmp_path / "nope")
    assert code == 1 and out == (
        f"{tmp_path / 'nope'} does not exist; pass a run dir (it holds checkpoints/) or a "
        "checkpoint dir (RUN/checkpoints/step_NNNNNNNN, it holds manifest.json)\n"
    )
    code, _, err = run_main(capsys, "verify")
    assert code == 2 and "the following arguments are required: RUN_OR_CHECKPOINT_DIR" in err
