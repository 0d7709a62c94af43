"""`lockstep report RUN_DIR` (lockstep/cli/report.py): the table printed, the pictures drawn,
exit 0; a run without per-rank times exits 1 (its loss curve drawn); a wrong directory or margin
gets the rule and the fix."""

from __future__ import annotations

import argparse

import pytest

from lockstep.cli import report
from lockstep.errors import ConfigError

from ..train.test_step_report import write_run


def _run(*argv: str) -> int:
    p = argparse.ArgumentParser()
    report.add_arguments(p)
    return report.run(p.parse_args(list(argv)), list(argv))


def test_the_table_and_the_picture_of_a_run(tmp_path, capsys):
    write_run(tmp_path)
    assert _run(str(tmp_path), "--margin", "0.8") == 0
    out = capsys.readouterr().out
    assert "more than 80% above the other ranks' median" in out and "| 3 of 5 |" in out
    assert _run(str(tmp_path), "--margin", "2") == 0  # 41.5 ms against 23.5 is not 3x
    assert "| 0 of 5 |" in capsys.readouterr().out
    assert "| 2 | node-b | 0 | 19.0 |" in out and out.rstrip().endswith(
        f"picture: {tmp_path / 'step_times.png'}"
    )
    assert (tmp_path / "step_times.png").is_file()
    assert f"loss curve: {tmp_path / 'loss.png'}" in out and (tmp_path / "loss.png").is_file()


def test_what_it_refuses(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"metrics.jsonl: no such file; RUN_DIR is a run's"):
        _run(str(tmp_path))
    write_run(tmp_path)
    with pytest.raises(ConfigError, match=r"--margin -1.0: must be above 0, e.g. 0.5"):
        _run(str(tmp_path), "--margin", "-1")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 2.0}\n')
    (tmp_path / "loss.png").unlink(missing_ok=True)
    assert _run(str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "no record holds per-rank step times" in out
    assert "loss curve:" in out and (tmp_path / "loss.png").is_file()  # drawn all the same
