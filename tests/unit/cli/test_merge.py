"""`lockstep merge`'s arguments (lockstep/cli/merge.py): --weights parsed, and inputs refused before anything is
read or written. Merges of trained checkpoints: tests/unit/tools/test_merge.py."""

from __future__ import annotations

import pytest
from conftest import run_main

from lockstep.cli.merge import parse_weights
from lockstep.errors import ConfigError


def test_parse_weights():
    assert parse_weights("0.7,0.3") == [0.7, 0.3] and parse_weights("1, 2 ,3") == [1.0, 2.0, 3.0]
    assert parse_weights(None) is None  # equal weights
    with pytest.raises(
        ConfigError,
        match=r"^--weights '0.7;0.3' is not a comma-separated list of numbers; e.g. "
        r"--weights 0.7,0.3$",
    ):
        parse_weights("0.7;0.3")


def test_refused_before_anything_is_read(tmp_path, capsys):
    out = tmp_path / "out"
    assert run_main(capsys, "merge", tmp_path / "a", "-o", out) == (
        2,
        "",
        "lockstep merge: error: merge needs 2 or more checkpoints, got 1; pass A B [C ...]\n",
    )
    assert run_main(
        capsys, "merge", tmp_path / "a", tmp_path / "b", "-o", out, "--weights", "x,y"
    ) == (
        2,
        "",
        "lockstep merge: error: --weights 'x,y' is not a comma-separated list of numbers; e.g. --weights "
        "0.7,0.3\n",
    )
    code, _, err = run_main(capsys, "merge", tmp_path / "a", tmp_path / "b")
    assert code == 2 and "the following arguments are required: -o/--output" in err
    assert not out.exists()
