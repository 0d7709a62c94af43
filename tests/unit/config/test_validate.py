"""lockstep/config/validate.py: the rules checked before any process starts, each refusal with the value, the
rule and the fix (the keys set as the command line sets them)."""

from __future__ import annotations

import pytest

from lockstep.config import Config, apply_overrides
from lockstep.config.validate import parse_profile_steps, validate_config
from lockstep.errors import ConfigError


def checked(overrides: dict) -> Config:
    cfg = Config()
    apply_overrides(cfg, overrides, "command line")
    validate_config(cfg)
    return cfg


def test_a_valid_config_passes_and_profile_steps_parse():
    assert checked({"train.max_steps": 3, "train.profile_steps": "2:4"}).train.max_steps == 3
    assert parse_profile_steps("10:15") == (10, 15)
    for spec, words in (("2-4", "must look like 'A:B'"), ("4:2", "needs 0 <= A < B")):
        with pytest.raises(ConfigError, match=words):
            checked({"train.profile_steps": spec})


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"model.kind": "hf"}, "needs model.path"),
        ({"model.kind": "custom"}, "needs model.factory"),
        ({"data.kind": "chatml", "data.path": "x.jsonl"}, "set model.kind: hf"),
        ({"model.use_lora": "true"}, "needs model.kind = 'hf'"),
        ({"model.kind": "hf", "model.path": "m", "data.kind": "audio"}, "needs data.path"),
        (
            {"model.kind": "custom", "model.factory": "m:f"},
            "takes its batches from data.kind = 'custom'",
        ),
        ({"data.factory": "m:f"}, "are for data.kind = 'custom'"),
        ({"train.batch_size": "null"}, "train.micro_batch_size"),
        ({"parallel.static_graph": "maybe"}, "'auto', 'true', 'false'"),
    ],
)
def test_model_and_data_kinds_must_fit_together(overrides, needle):
    with pytest.raises(ConfigError) as e:
        checked(overrides)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        (
            "parallel.grad_compression",
            "zip",
            "parallel.grad_compression = 'zip' (from command line) is not one of 'none', "
            "'bf16', 'fp16', 'powersgd'; pick one of those",
        ),
        (
            "parallel.powersgd_rank",
            0,
            "parallel.powersgd_rank = 0 must be > 0; set a positive value",
        ),
        (
            "parallel.powersgd_start_step",
            1,
            "parallel.powersgd_start_step = 1 must be >= 2: PowerSGD keeps per-bucket "
            "state, and DDP rebuilds its buckets after the first step; set 2 or more",
        ),
        (
            "parallel.bucket_cap_mb",
            0,
            "parallel.bucket_cap_mb = 0.0 must be > 0; set a positive value",
        ),
    ],
)
def test_grad_compression_settings_are_checked(key, value, needle):
    with pytest.raises(ConfigError) as e:
        checked({key: value})
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"optim.warmup_ratio": "1.0"}, "optim.warmup_ratio = 1.0 must be in [0, 1)"),
        ({"optim.warmup_ratio": "-0.1"}, "optim.warmup_ratio = -0.1 must be in [0, 1)"),
        (
            {"optim.warmup_ratio": "0.1", "optim.warmup_steps": "20"},
            "optim.warmup_steps = 20 and optim.warmup_ratio = 0.1 both set the warmup",
        ),
        ({"optim.schedule": "polynomial"}, "'polynomial'"),
    ],
)
def test_warmup_ratio_and_schedule_are_checked(overrides, needle):
    with pytest.raises(ConfigError) as e:
        checked(overrides)
    assert needle in str(e.value)
