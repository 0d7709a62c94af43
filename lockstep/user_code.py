"""The user's own code, named in the config as "package.module:function": importing it, and saying where it raised."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import traceback
from typing import Any

from lockstep.errors import ConfigError


def import_object(spec: str, key: str) -> Any:
    """The callable that `spec` ("package.module:function") names; `key` is the config key, for messages."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(
            f"{key} = {spec!r} must be 'package.module:function' with exactly one colon, "
            "e.g. 'mypackage.models:build_model'"
        )
    module_name, attr = spec.split(":")
    # the `lockstep` console script, unlike `python -m`, does not put the working directory on sys.path;
    # factories next to the config (`model.factory: my_model:build`) should import either way
    if not any(os.path.abspath(p or ".") == os.getcwd() for p in sys.path):
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if (
            e.name is not None
            and module_name.startswith(e.name)
            and module_name[len(e.name) :][:1] in ("", ".")
        ):
            cwd = os.getcwd()
            on_path = "is" if any(os.path.abspath(p or ".") == cwd for p in sys.path) else "is not"
            raise ConfigError(
                f"{key} = {spec!r}: module {module_name!r} could not be imported ({type(e).__name__}: {e}); "
                f"put the directory that holds it on PYTHONPATH or `pip install -e` your package "
                f"(the current directory, {cwd}, {on_path} on sys.path)"
            ) from None
        raise ConfigError(
            f"{key} = {spec!r}: module {module_name!r} imports {e.name!r}, which is not installed "
            f"({type(e).__name__}: {e}); install it in this environment"
        ) from e
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything while it runs
        raise ConfigError(
            f"{key} = {spec!r}: importing module {module_name!r} raised {type(e).__name__}: {e} "
            f"(at {where_raised(e)}); fix the error in that module"
        ) from e
    if not hasattr(module, attr):
        have = _callables(module)
        close = difflib.get_close_matches(attr, have, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        listed = ", ".join(have[:10]) + (", ..." if len(have) > 10 else "") if have else "none"
        raise ConfigError(
            f"{key} = {spec!r}: module {module_name!r} ({module.__file__}) has no attribute "
            f"{attr!r}; {hint}callables it has: {listed}"
        )
    obj = getattr(module, attr)
    if not callable(obj):
        raise ConfigError(
            f"{key} = {spec!r} names an object of type {type(obj).__name__}, which is not "
            "callable; point it at a function (or class) to call"
        )
    return obj


def where_raised(e: BaseException) -> str:
    """file:line of the innermost frame: where in the user's code the exception was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown location"


def _callables(module: Any) -> list[str]:
    """Public callables, the module's own (defined there) first."""
    names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
    own = [n for n in names if getattr(getattr(module, n), "__module__", None) == module.__name__]
    return own + [n for n in names if n not in own]
