"""The HF TrainingArguments names lockstep refuses (lockstep/cli/hf_refused.py): each says why and what to use,
none is also a name lockstep honours, and --torch_compile, once refused, now sets train.compile."""

from __future__ import annotations

import pytest

from lockstep.cli import build_parser
from lockstep.cli.hf_args import KEYS, SPECIAL, SWITCHES
from lockstep.cli.hf_defaults import NOOPS
from lockstep.cli.hf_refused import OTHER, REFUSED
from lockstep.cli.train_flags import overrides_from_args
from lockstep.config import load_config


def test_a_refused_name_is_never_also_an_honoured_one():
    honoured = set(KEYS) | set(SPECIAL) | set(SWITCHES) | set(NOOPS)
    assert {"warmup_ratio", "lr_scheduler_kwargs", "dataloader_pin_memory", "log_level"} <= honoured
    assert honoured & set(REFUSED) == set() and honoured & set(OTHER) == set()
    assert set(REFUSED) & set(OTHER) == set()


def test_every_refusal_gives_the_lockstep_way():
    reasons = REFUSED
    assert all(len(why) > 20 for why in reasons.values()), [
        n for n, w in reasons.items() if len(w) <= 20
    ]
    assert "parallel.data_parallel=fsdp" in REFUSED["deepspeed"]
    assert (
        "inductor" in REFUSED["torch_compile_backend"]
        and "--torch_compile" in REFUSED["torch_compile_mode"]
    )


def resolve(*argv: str):
    args = build_parser()[0].parse_args(["train", *argv])
    return load_config(args.config, overrides_from_args(args))


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--torch_compile"], True),
        (["--torch_compile", "false"], False),
        (["--compile"], True),
        ([], False),
    ],
)
def test_torch_compile_sets_train_compile(argv, want):
    assert resolve(*argv).train.compile is want
