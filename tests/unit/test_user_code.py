"""The user's own code, named as "package.module:function": importing it, and saying where it raised
(lockstep/user_code.py)."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import USER_MODULE, run_main
from torch import nn

from lockstep.errors import ConfigError
from lockstep.user_code import import_object, where_raised


def test_import_object_good(write_module):
    mod = write_module(USER_MODULE)
    assert isinstance(import_object(f"{mod}:build_model", "model.factory")(), nn.Linear)
    assert import_object(f"{mod}:Net", "model.factory").__name__ == "Net"


@pytest.mark.parametrize("spec", ["mypackage.models.build_model", "a:b:c", ":build", "mod:"])
def test_import_object_needs_one_colon(spec):
    with pytest.raises(
        ConfigError,
        match=r"model\.factory = .* must be 'package\.module:function' with exactly "
        r"one colon, e\.g\. 'mypackage\.models:build_model'",
    ):
        import_object(spec, "model.factory")


def test_import_object_missing_module():
    with pytest.raises(ConfigError) as info:
        import_object("no_such_pkg_xyz.models:build", "model.factory")
    msg = str(info.value)
    assert "module 'no_such_pkg_xyz.models' could not be imported" in msg
    assert "ModuleNotFoundError: No module named 'no_such_pkg_xyz'" in msg
    assert "PYTHONPATH" in msg and "pip install -e" in msg and "on sys.path" in msg


def test_a_factory_that_does_not_import_stops_the_cli_with_a_config_error(tmp_path, capsys):
    """`lockstep train` imports the factories inside run_training (one process here, as the CLI runs
    it): the same message, and exit 2 as for every config error."""
    from .train.tiny import drop_log_handlers

    try:
        code, out, err = run_main(
            capsys,
            "train",
            "--model-kind",
            "custom",
            "--set",
            "model.factory=no_such_module:build",
            "--set",
            "data.kind=custom",
            "--set",
            "data.factory=no_such_module:data",
            "--output-dir",
            tmp_path / "run",
        )
    finally:
        drop_log_handlers()  # the run's log file and console: later tests' logs must not reach them
    assert code == 2
    assert "no_such_module" in err and "PYTHONPATH" in err, err


def test_import_object_module_with_missing_dependency(write_module):
    mod = write_module("import not_installed_dep_xyz\n")
    with pytest.raises(
        ConfigError,
        match=rf"module '{mod}' imports 'not_installed_dep_xyz', which is not "
        r"installed \(ModuleNotFoundError: No module named",
    ):
        import_object(f"{mod}:build", "model.factory")


def test_import_object_missing_attribute_lists_callables(write_module):
    mod = write_module(USER_MODULE)
    with pytest.raises(ConfigError) as info:
        import_object(f"{mod}:bulid_model", "model.factory")
    msg = str(info.value)
    assert f"module '{mod}'" in msg and "has no attribute 'bulid_model'" in msg
    assert "did you mean 'build_model'?" in msg
    # the module's own callables come first, imported ones (torch's) after
    assert "callables it has: Net, build_model, build_pair, my_loss" in msg
    assert "VALUE" not in msg


def test_import_object_module_raises_on_import(write_module, tmp_path):
    mod = write_module("""
        SETTING = 1
        RATIO = SETTING / 0
    """)
    with pytest.raises(ConfigError) as info:
        import_object(f"{mod}:build", "data.factory")
    msg = str(info.value)
    assert msg.startswith(
        f"data.factory = '{mod}:build': importing module '{mod}' raised ZeroDivisionError: "
        "division by zero"
    )
    assert f"{tmp_path / mod}.py:3" in msg
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_import_object_not_callable(write_module):
    mod = write_module(USER_MODULE)
    with pytest.raises(ConfigError, match="names an object of type int, which is not callable"):
        import_object(f"{mod}:VALUE", "model.loss")


def test_a_module_next_to_the_config_imports_without_pythonpath(tmp_path, monkeypatch):
    # the `lockstep` console script does not put the working directory on sys.path, as `python -m` does
    (tmp_path / "lockstep_user_beside.py").write_text("def build():\n    return 'built here'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != str(tmp_path)]
    )
    try:
        assert import_object("lockstep_user_beside:build", "model.factory")() == "built here"
        assert sys.path[-1] == str(tmp_path)
    finally:
        sys.modules.pop("lockstep_user_beside", None)


def _innermost():
    raise KeyError("row 3")


def _outer():
    _innermost()


def test_where_raised_names_the_innermost_frame():
    with pytest.raises(KeyError) as info:
        _outer()
    line = _innermost.__code__.co_firstlineno + 1
    assert where_raised(info.value) == f"{__file__}:{line}"
    assert where_raised(ValueError("never raised")) == "unknown location"
