"""Your own model: a factory named in the config, and the glue to feed it batches and find its loss.

`model.factory = "package.module:function"` returns an nn.Module; `model.loss` optionally names a
`function(output, batch) -> scalar loss`. Batches are whatever your collate function builds: tensors inside
dicts, lists, tuples, namedtuples or dataclasses. This module never imports `torch.distributed`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from lockstep.config import ConfigError, ModelConfig


def import_object(spec: str, key: str) -> Any:
    """The callable that `spec` ("package.module:function") names; `key` is the config key, for messages."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"{key} = {spec!r} must be 'package.module:function' with exactly one colon, "
                          "e.g. 'mypackage.models:build_model'")
    module_name, attr = spec.split(":")
    # the `lockstep` console script, unlike `python -m`, does not put the working directory on sys.path;
    # factories next to the config (`model.factory: my_model:build`) should import either way
    if not any(os.path.abspath(p or ".") == os.getcwd() for p in sys.path):
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name) and module_name[len(e.name):][:1] in ("", "."):
            cwd = os.getcwd()
            on_path = "is" if any(os.path.abspath(p or ".") == cwd for p in sys.path) else "is not"
            raise ConfigError(
                f"{key} = {spec!r}: module {module_name!r} could not be imported ({type(e).__name__}: {e}); "
                f"put the directory that holds it on PYTHONPATH or `pip install -e` your package "
                f"(the current directory, {cwd}, {on_path} on sys.path)") from None
        raise ConfigError(f"{key} = {spec!r}: module {module_name!r} imports {e.name!r}, which is not installed "
                          f"({type(e).__name__}: {e}); install it in this environment") from e
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything while it runs
        raise ConfigError(f"{key} = {spec!r}: importing module {module_name!r} raised {type(e).__name__}: {e} "
                          f"(at {where_raised(e)}); fix the error in that module") from e
    if not hasattr(module, attr):
        have = _callables(module)
        close = difflib.get_close_matches(attr, have, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        listed = ", ".join(have[:10]) + (", ..." if len(have) > 10 else "") if have else "none"
        raise ConfigError(f"{key} = {spec!r}: module {module_name!r} ({module.__file__}) has no attribute "
                          f"{attr!r}; {hint}callables it has: {listed}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise ConfigError(f"{key} = {spec!r} names an object of type {type(obj).__name__}, which is not "
                          "callable; point it at a function (or class) to call")
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


def build_custom_model(cfg: ModelConfig) -> nn.Module:
    """Call model.factory with no arguments; it must return an nn.Module."""
    if not cfg.factory:
        raise ConfigError("model.kind = 'custom' needs model.factory = 'package.module:function'")
    factory = import_object(cfg.factory, "model.factory")
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory may raise anything
        raise ConfigError(f"model.factory {cfg.factory!r} raised {type(e).__name__}: {e} (at {where_raised(e)}); "
                          "fix the error in the factory") from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory = {cfg.factory!r} returned {_describe(model)}, not a torch.nn.Module; "
                          "make it return the model itself")
    return model


def build_custom_loss(cfg: ModelConfig) -> Callable[[Any, Any], torch.Tensor] | None:
    """model.loss as a function(output, batch) -> loss, or None to take the loss from the output."""
    return import_object(cfg.loss, "model.loss") if cfg.loss else None


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def move_to_device(batch: Any, device: torch.device | str) -> Any:
    """A copy of batch with every tensor on device; containers keep their type, other leaves are shared.

    non_blocking: a copy from pinned host memory overlaps with compute (the next op on the device
    stream waits for it); from pageable memory it is an ordinary copy.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if _is_dataclass_instance(batch):  # before Mapping: HF ModelOutput is both
        changes = {f.name: move_to_device(getattr(batch, f.name), device)
                   for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **changes)
    if isinstance(batch, Mapping):
        moved = {k: move_to_device(v, device) for k, v in batch.items()}
        if isinstance(batch, MutableMapping):  # keeps OrderedDict, defaultdict, BatchEncoding, ...
            out = copy.copy(batch)
            out.update(moved)
            return out
        return moved
    if _is_namedtuple(batch):
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def call_model(model: nn.Module, batch: Any) -> Any:
    """dict -> model(**batch); list or plain tuple -> model(*batch); anything else -> model(batch)."""
    if isinstance(batch, Mapping) and not _is_dataclass_instance(batch):
        return model(**batch)
    if isinstance(batch, (list, tuple)) and not _is_namedtuple(batch):
        return model(*batch)
    return model(batch)


def extract_loss(output: Any, batch: Any, loss_fn: Callable[[Any, Any], Any] | None = None) -> torch.Tensor:
    """The scalar loss: loss_fn(output, batch), else a scalar tensor output, else output.loss or
    output["loss"]."""
    if loss_fn is not None:
        loss, source = loss_fn(output, batch), "model.loss"
    elif isinstance(output, torch.Tensor) and output.ndim == 0:
        loss, source = output, "the model's output"
    elif getattr(output, "loss", None) is not None:
        loss, source = output.loss, "output.loss"
    elif isinstance(output, Mapping) and output.get("loss") is not None:
        loss, source = output["loss"], "output['loss']"
    else:
        none = " (its loss is None: for Hugging Face models, put 'labels' in the batch)" if (
            getattr(output, "loss", 0) is None or (isinstance(output, Mapping) and "loss" in output)) else ""
        raise ConfigError(f"cannot find the loss in the model's output, {_describe(output)}{none}; return a scalar "
                          "tensor, an object with .loss, or a dict with 'loss' from forward, or set "
                          "model.loss = 'module:function' taking (output, batch) and returning the loss")
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"the loss from {source} is {_describe(loss)}, not a tensor; return a scalar "
                          "torch.Tensor that autograd can differentiate")
    if loss.ndim != 0:
        raise ConfigError(f"the loss from {source} has shape {tuple(loss.shape)}, not a scalar; reduce it "
                          "(e.g. .mean() over the batch)")
    return loss


def _describe(x: Any, depth: int = 0) -> str:
    """A short description for messages: type plus shape, keys or fields."""
    if isinstance(x, torch.Tensor):
        return f"a Tensor of shape {tuple(x.shape)}"
    if _is_dataclass_instance(x):
        return f"a {type(x).__name__} with fields {[f.name for f in dataclasses.fields(x)]}"
    if isinstance(x, Mapping):
        return f"a {type(x).__name__} with keys {list(x)[:10]}"
    if isinstance(x, (list, tuple)) and depth == 0:
        kind = type(x).__name__
        return f"a {kind} of {len(x)} ({', '.join(_describe(v, 1) for v in x[:4])}{', ...' if len(x) > 4 else ''})"
    return f"a {type(x).__name__}"
