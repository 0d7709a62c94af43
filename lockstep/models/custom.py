"""Your own model: a factory named in the config, and the glue to feed it batches and find its loss.

`model.factory = "package.module:function"` returns an nn.Module; `model.loss` optionally names a
`function(output, batch) -> scalar loss`. Batches are whatever your collate function builds: tensors inside
dicts, lists, tuples, namedtuples or dataclasses. This module never imports `torch.distributed`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lockstep.config import ModelConfig
from lockstep.errors import ConfigError
from lockstep.user_code import import_object, where_raised


def build_custom_model(cfg: ModelConfig) -> nn.Module:
    """Call model.factory with no arguments; it must return an nn.Module."""
    if not cfg.factory:
        raise ConfigError("model.kind = 'custom' needs model.factory = 'package.module:function'")
    factory = import_object(cfg.factory, "model.factory")
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory may raise anything
        raise ConfigError(
            f"model.factory {cfg.factory!r} raised {type(e).__name__}: {e} (at {where_raised(e)}); "
            "fix the error in the factory"
        ) from e
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.factory = {cfg.factory!r} returned {_describe(model)}, not a torch.nn.Module; "
            "make it return the model itself"
        )
    return model


def build_custom_loss(cfg: ModelConfig) -> Callable[[Any, Any], torch.Tensor] | None:
    """model.loss as a function(output, batch) -> loss, or None to take the loss from the output."""
    return import_object(cfg.loss, "model.loss") if cfg.loss else None


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def call_model(model: nn.Module, batch: Any) -> Any:
    """dict -> model(**batch); list or plain tuple -> model(*batch); anything else -> model(batch)."""
    if isinstance(batch, Mapping) and not _is_dataclass_instance(batch):
        return model(**batch)
    if isinstance(batch, (list, tuple)) and not _is_namedtuple(batch):
        return model(*batch)
    return model(batch)


def extract_loss(
    output: Any, batch: Any, loss_fn: Callable[[Any, Any], Any] | None = None
) -> torch.Tensor:
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
        none = (
            " (its loss is None: for Hugging Face models, put 'labels' in the batch)"
            if (
                getattr(output, "loss", 0) is None
                or (isinstance(output, Mapping) and "loss" in output)
            )
            else ""
        )
        raise ConfigError(
            f"cannot find the loss in the model's output, {_describe(output)}{none}; return a scalar "
            "tensor, an object with .loss, or a dict with 'loss' from forward, or set "
            "model.loss = 'module:function' taking (output, batch) and returning the loss"
        )
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"the loss from {source} is {_describe(loss)}, not a tensor; return a scalar "
            "torch.Tensor that autograd can differentiate"
        )
    if loss.ndim != 0:
        raise ConfigError(
            f"the loss from {source} has shape {tuple(loss.shape)}, not a scalar; reduce it "
            "(e.g. .mean() over the batch)"
        )
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
