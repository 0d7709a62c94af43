"""`lockstep split`'s arguments (lockstep/cli/split.py): the parts it wrote, one per line, and bad values. The
split itself: tests/unit/tools/test_split.py."""

from __future__ import annotations

from conftest import run_lockstep, run_main

from ..tools.test_split import jsonl  # noqa: F401  (the fixture, written once)


def test_cli(jsonl, tmp_path, capsys):  # noqa: F811
    # a real `lockstep` process: the entry point (lockstep.cli.entry), its stdout and exit code
    proc = run_lockstep(
        "split", str(jsonl), "--parts", "2", "-o", str(tmp_path / "out"), "--seed", "4"
    )
    assert proc.stdout.split() == [
        str(tmp_path / "out" / f"part-0000{i}-of-00002.jsonl") for i in range(2)
    ]
    code, _, err = run_main(capsys, "split", str(jsonl), "--parts", "99", "-o", str(tmp_path / "x"))
    assert code == 1 and "pass --parts 23 or fewer" in err


def test_in_process_with_force(jsonl, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    parts = [str(out / f"part-0000{i}-of-00003.jsonl") for i in range(3)]
    assert run_main(capsys, "split", jsonl, "--parts", "3", "-o", out) == (
        0,
        "\n".join(parts) + "\n",
        "",
    )
    code, _, err = run_main(capsys, "split", jsonl, "--parts", "2", "-o", out)
    assert code == 1 and err.startswith(f"lockstep split: error: output {out} is not empty (")
    assert run_main(capsys, "split", jsonl, "--parts", "2", "-o", out, "--force")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "part-00000-of-00002.jsonl",
        "part-00001-of-00002.jsonl",
        "split.json",
    ]


def test_bad_values(jsonl, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    code, _, err = run_main(capsys, "split", jsonl, "-o", out)
    assert code == 2 and "the following arguments are required: --parts" in err
    code, _, err = run_main(capsys, "split", jsonl, "--parts", "two", "-o", out)
    assert code == 2 and "argument --parts: invalid int value: 'two'" in err
    assert run_main(capsys, "split", jsonl, "--parts", "0", "-o", out) == (
        1,
        "",
        "lockstep split: error: --parts 0 must be an integer >= 1; pass how many parts (copies to train) you "
        "want\n",
    )
    assert not out.exists()
