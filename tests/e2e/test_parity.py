"""`lockstep parity`: 1 process vs N, per-step losses compared, on real runs. What it refuses
before anything runs: tests/unit/cli/test_parity.py, in-process."""

from __future__ import annotations

import json

import pytest
from conftest import TINY, run_lockstep

pytestmark = pytest.mark.slow


def _parity(tmp_path, corpus, token_cache, *extra: str, check: bool = True):
    return run_lockstep(
        "parity",
        "--world-size",
        "2",
        "--steps",
        "4",
        "--data",
        corpus,
        "--output-dir",
        tmp_path / "run",
        *TINY,
        "--global-batch-size",
        "8",
        "--mixed-precision",
        "no",
        "--set",
        f"data.cache_dir={token_cache}",
        *extra,
        check=check,
        timeout=400,
    )


def test_ddp_matches_one_process_step_by_step(tmp_path, corpus, token_cache):
    proc = _parity(tmp_path, corpus, token_cache)
    report = json.loads((tmp_path / "run" / "parity" / "parity.json").read_text())
    assert report["ok"] and [s["step"] for s in report["steps"]] == [1, 2, 3, 4]
    assert report["max_rel_diff"] < 1e-4, report
    assert report["steps"][0]["reference"] != report["steps"][-1]["reference"]  # it trained
    assert "within the tolerance" in proc.stdout


def test_dropout_breaks_parity_and_the_exit_status_says_so(tmp_path, corpus, token_cache):
    # different dropout masks per rank: the comparison must be able to fail
    proc = _parity(
        tmp_path, corpus, token_cache, "--dropout", "0.3", "--tolerance", "1e-6", check=False
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "OUTSIDE the tolerance" in proc.stdout and "dropout" in proc.stdout
