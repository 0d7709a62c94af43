"""A batch: samples collated into one, checked, and moved to the device field by field.

Batches can be tensors, or dicts, lists, tuples, namedtuples and dataclasses of them; numbers and strings
travel as they are.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.utils.data import default_collate

from lockstep.errors import DataError


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def collate_samples(samples: list[Any], where: str = "sample") -> Any:
    """torch's default_collate, plus dataclass samples (collated field by field into one dataclass) and optional
    fields: a field that is None in every sample of the batch stays None (the model's "absent" case)."""
    first = samples[0]
    nones = sum(s is None for s in samples)
    if nones == len(samples):
        return None
    if nones:
        other = next(type(s).__name__ for s in samples if s is not None)
        raise DataError(
            f"{where} is None in {nones} of the {len(samples)} samples of a batch and a {other} in the "
            "others, which cannot be stacked into one batch; give every sample a value of one shape (e.g. "
            "zeros plus a mask for 'absent'), or pass data.collate to batch it yourself"
        )
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(
            first,
            **{
                f.name: collate_samples([getattr(s, f.name) for s in samples], f"{where}.{f.name}")
                for f in dataclasses.fields(first)
                if f.init
            },
        )
    if isinstance(first, Mapping):  # recursed here so that dataclasses inside dicts batch too
        out = {
            key: collate_samples([s[key] for s in samples], f"{where}[{key!r}]") for key in first
        }
        try:
            return type(first)(out)  # keeps OrderedDict, BatchEncoding, ...
        except TypeError:
            return out
    try:
        return default_collate(samples)
    except TypeError as e:  # torch names the type, not where it sits in the sample
        raise DataError(
            f"{where} cannot be batched: {e}; make it a tensor, a number or a string (or a dataclass, "
            "dict or tuple of them), or pass data.collate to batch it yourself"
        ) from None


def move_to_device(batch: Any, device: torch.device | str) -> Any:
    """A copy of batch with every tensor on device; containers keep their type, other leaves are shared.

    non_blocking: a copy from pinned host memory overlaps with compute (the next op on the device
    stream waits for it); from pageable memory it is an ordinary copy.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if _is_dataclass_instance(batch):  # before Mapping: HF ModelOutput is both
        changes = {
            f.name: move_to_device(getattr(batch, f.name), device)
            for f in dataclasses.fields(batch)
            if f.init
        }
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


# moved by value: the model gets them as they are
_PASS_AS_IS = (int, float, bool, str, bytes, type(None))


def check_movable(batch: Any, where: str = "batch") -> None:
    """DataError naming the first leaf of `batch` that is neither a tensor nor a plain value."""
    if isinstance(batch, torch.Tensor) or isinstance(batch, _PASS_AS_IS):
        return
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            check_movable(getattr(batch, f.name), f"{where}.{f.name}")
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            check_movable(value, f"{where}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            check_movable(value, f"{where}[{i}]")
    else:
        raise DataError(
            f"{where} is a {type(batch).__module__}.{type(batch).__qualname__}, which lockstep cannot move to the "
            "device (it moves tensors, and passes numbers and strings as they are); make it a torch.Tensor in the "
            "dataset or in data.collate (e.g. torch.as_tensor)"
        )
