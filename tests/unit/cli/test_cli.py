"""`lockstep <command>` (lockstep/cli/__init__.py): run_command's exit codes and what it prints for a user's error
and for an unexpected one; the process around it ends through runtime/process_end.py."""

from __future__ import annotations

import pytest

from lockstep import cli
from lockstep.errors import ConfigError


def _raising(error: BaseException):
    def run(args, argv):
        raise error

    return run


def test_an_unexpected_error_prints_its_traceback_once_and_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(cli.COMMANDS["verify"], "run", _raising(RuntimeError("disk on fire")))
    assert cli.run_command(["verify", "somewhere"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.rstrip().endswith(
        "RuntimeError: disk on fire"
    )
    logged = RuntimeError("already in the rank's log")
    logged.traceback_logged = True  # run_training logged it with its traceback: not twice
    monkeypatch.setattr(cli.COMMANDS["verify"], "run", _raising(logged))
    assert cli.run_command(["verify", "somewhere"]) == 1
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "error, code", [(ConfigError("bad value"), 2), (FileNotFoundError("no such run"), 1)]
)
def test_a_users_error_is_one_line_naming_the_command(monkeypatch, capsys, error, code):
    monkeypatch.setattr(cli.COMMANDS["verify"], "run", _raising(error))
    assert cli.run_command(["verify", "somewhere"]) == code
    assert capsys.readouterr().err == f"lockstep verify: error: {error}\n"
