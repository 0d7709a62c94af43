"""The errors a user must fix (lockstep/errors.py): their hierarchy, and how `lockstep <command>` reports each one,
on real bad commands run in-process: the message alone on one line, exit code 2 for a config, 1 for the rest."""

from __future__ import annotations

import pytest

from lockstep.cli import USER_ERRORS, main
from lockstep.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    GradientDivergence,
    UnusedParameterError,
)


def test_the_hierarchy_the_cli_relies_on():
    # user input errors are ValueErrors (a caller's `except ValueError` sees them); the unused-parameter stop is
    # a setting to change, so it exits like a config error
    assert issubclass(UnusedParameterError, ConfigError)
    assert all(issubclass(e, ValueError) for e in (ConfigError, DataError, CheckpointError))
    assert not issubclass(DataError, ConfigError) and not issubclass(CheckpointError, ConfigError)
    assert issubclass(GradientDivergence, RuntimeError) and not issubclass(
        GradientDivergence, ValueError
    )
    for error in (
        ConfigError,
        DataError,
        CheckpointError,
        UnusedParameterError,
        GradientDivergence,
        FileNotFoundError,
    ):
        assert isinstance(error("x"), USER_ERRORS), error  # printed as a message, never a traceback
    assert not isinstance(ValueError("x"), USER_ERRORS)  # lockstep's own bugs keep their traceback


@pytest.mark.parametrize(
    "argv, code, message",
    [
        # ConfigError: 2
        (
            ["train", "--set", "train.nosuch=1", "--print-config"],
            2,
            "lockstep train: error: unknown config key 'train.nosuch' (from command line); did you mean 'train.epochs'?",
        ),
        (
            ["train", "--global-batch-size", "abc", "--print-config"],
            2,
            "lockstep train: error: train.batch_size = 'abc' (from command line) must be an integer; got str",
        ),
        (
            ["merge", "a", "b", "-o", "out", "--weights", "a,b"],
            2,
            "lockstep merge: error: --weights 'a,b' is not a comma-separated list of numbers; e.g. --weights 0.7,0.3",
        ),
        # DataError: 1
        (
            ["split", "{tmp}/nope.jsonl", "--parts", "2", "-o", "{tmp}/out"],
            1,
            "lockstep split: error: '{tmp}/nope.jsonl' does not exist; pass a data file, a folder or a glob (",
        ),
        # CheckpointError: 1
        (
            ["export", "{tmp}/file.txt", "-o", "{tmp}/out"],
            1,
            "lockstep export: error: {tmp}/file.txt is a file, not a checkpoint directory; pass a run directory that has "
            "checkpoints, or one of its checkpoints (RUN/checkpoints/step_N)",
        ),
        # FileNotFoundError: 1
        (
            ["sample", "{tmp}/nope"],
            1,
            "lockstep sample: error: {tmp}/nope does not exist; pass a run directory (RUN), one of its checkpoints "
            "(RUN/checkpoints/step_N), or a model directory lockstep wrote (RUN/final, or the output of `lockstep export`)",
        ),
    ],
)
def test_a_user_error_is_one_line_and_an_exit_code(tmp_path, capsys, argv, code, message):
    (tmp_path / "file.txt").write_text("not a checkpoint")
    assert main([a.format(tmp=tmp_path) for a in argv]) == code
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(message.format(tmp=tmp_path)), err
    assert not (tmp_path / "out").exists()  # refused before anything was written
