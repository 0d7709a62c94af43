"""Batches: samples collated into one (dataclasses and optional fields too), checked, and moved to the device
field by field (lockstep/data/batch.py)."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import pytest
import torch
from conftest import Batch, Pair

from lockstep.data.batch import check_movable, collate_samples, move_to_device
from lockstep.errors import DataError


@dataclass
class Cond:
    speaker: torch.Tensor
    prompt: torch.Tensor | None


@dataclass
class Sample:
    tokens: torch.Tensor
    cond: Cond


@dataclass(frozen=True)
class Frozen:
    y: torch.Tensor


# ---------------------------------------------------------------- collate_samples


def test_optional_fields_collate_to_none_only_when_absent_from_the_whole_batch():
    none = [Sample(torch.zeros(3), Cond(torch.tensor(1), None)) for _ in range(2)]
    batch = collate_samples(none)
    assert (
        batch.cond.prompt is None
        and batch.tokens.shape == (2, 3)
        and batch.cond.speaker.tolist() == [1, 1]
    )
    mixed = [Sample(torch.zeros(3), Cond(torch.tensor(1), p)) for p in (None, torch.ones(2), None)]
    with pytest.raises(
        DataError,
        match=r"sample.cond.prompt is None in 2 of the 3 samples of a batch and a Tensor in "
        r"the others, which cannot be stacked",
    ):
        collate_samples(mixed)


def test_collate_stacks_leaves_and_keeps_the_sample_types():
    samples = [
        OrderedDict(
            ids=torch.tensor([i, i + 1]), n=i, text=f"s{i}", pair=Pair(torch.tensor(float(i)), "p")
        )
        for i in range(3)
    ]
    batch = collate_samples(samples)
    assert type(batch) is OrderedDict and list(batch) == ["ids", "n", "text", "pair"]
    assert batch["ids"].tolist() == [[0, 1], [1, 2], [2, 3]] and batch["n"].tolist() == [0, 1, 2]
    assert batch["text"] == ["s0", "s1", "s2"]  # strings travel as a list
    assert type(batch["pair"]) is Pair and batch["pair"].features.tolist() == [0.0, 1.0, 2.0]
    assert list(batch["pair"].name) == ["p", "p", "p"]


def test_collate_dataclass_samples_field_by_field():
    samples = [
        Batch(x=torch.full((4,), float(i)), extras=[torch.tensor(i)], tag="eval") for i in range(2)
    ]
    batch = collate_samples(samples)
    assert type(batch) is Batch and batch.x.shape == (2, 4) and batch.x[:, 0].tolist() == [0.0, 1.0]
    assert [e.tolist() for e in batch.extras] == [[0, 1]] and batch.tag == ["eval", "eval"]
    assert batch.size == 2  # init=False fields are not collated: __post_init__ sees the batched x


def test_collate_names_the_leaf_that_cannot_be_batched():
    class Style:
        pass

    with pytest.raises(DataError) as info:
        collate_samples([{"tokens": torch.zeros(2), "style": Style()} for _ in range(2)])
    message = str(info.value)
    assert message.startswith("sample['style'] cannot be batched: ") and "Style" in message
    assert message.endswith(
        "make it a tensor, a number or a string (or a dataclass, dict or tuple of them), or pass "
        "data.collate to batch it yourself"
    )
    assert collate_samples([None, None]) is None  # an optional sample field absent everywhere


# ---------------------------------------------------------------- check_movable


def test_check_movable_names_the_field_and_its_type():
    # a collate function that lets it through: the check after collation names the field and the type
    with pytest.raises(DataError) as info:
        check_movable({"tokens": torch.zeros(2), "cond": Cond(torch.zeros(2), np.zeros(3))})
    assert str(info.value).startswith(
        "batch['cond'].prompt is a numpy.ndarray, which lockstep cannot move to the device"
    ), str(info.value)
    assert "torch.as_tensor" in str(info.value)
    check_movable(
        {"ids": torch.zeros(2), "text": ["a", "b"], "n": 3, "cond": Cond(torch.zeros(1), None)}
    )  # fine


def test_check_movable_path_through_lists_and_tuples():
    with pytest.raises(DataError, match=r"^inputs\[1\]\[1\]\['mask'\] is a builtins.set, "):
        check_movable([torch.zeros(1), (2.5, {"mask": {1, 2}})], "inputs")
    check_movable(Pair(torch.zeros(1), b"raw"))  # bytes, bools and None pass as they are
    check_movable([True, None, "x", 1.0])


# ---------------------------------------------------------------- move_to_device


def test_move_to_device_keeps_containers_and_moves_tensors():
    t = torch.arange(6.0).view(2, 3)
    name = "utt-1"
    nested = {
        "dict": OrderedDict(a=t, b=defaultdict(list, c=t)),
        "tuple": (t, 3, name),
        "named": Pair(features=t, name=name),
        "dc": Batch(x=t, extras=[t, (t,)], tag="eval"),
        "frozen": Frozen(t),
        "list": [t, None],
    }
    moved = move_to_device(nested, "meta")  # the meta device shows the move without a GPU
    assert type(moved) is dict and moved is not nested
    assert type(moved["dict"]) is OrderedDict and type(moved["dict"]["b"]) is defaultdict
    assert moved["dict"]["b"].default_factory is list
    assert (
        type(moved["tuple"]) is tuple
        and moved["tuple"][1:] == (3, name)
        and moved["tuple"][2] is name
    )
    assert type(moved["named"]) is Pair and moved["named"].name is name
    assert type(moved["dc"]) is Batch and moved["dc"].tag == "eval" and moved["dc"].size == 2
    assert type(moved["dc"].extras) is list and type(moved["dc"].extras[1]) is tuple
    assert type(moved["frozen"]) is Frozen and moved["list"][1] is None
    tensors = [
        moved["dict"]["a"],
        moved["dict"]["b"]["c"],
        moved["tuple"][0],
        moved["named"].features,
        moved["dc"].x,
        moved["dc"].extras[0],
        moved["dc"].extras[1][0],
        moved["frozen"].y,
        moved["list"][0],
    ]
    assert all(x.is_meta and x.shape == (2, 3) for x in tensors)
    # the input batch is untouched
    assert nested["dc"].x is t and nested["named"].features is t and not t.is_meta


def test_move_to_device_leaves():
    assert move_to_device(torch.ones(2), "meta").is_meta
    assert move_to_device("text", "meta") == "text"
    assert move_to_device(None, "meta") is None


def test_a_read_only_mapping_moves_into_a_plain_dict():
    t = torch.ones(2)
    moved = move_to_device(MappingProxyType({"x": t, "n": 1}), "meta")
    assert type(moved) is dict and moved["x"].is_meta and moved["n"] == 1
