"""The value rules of HF Trainer names (lockstep/cli/hf_values.py), called directly: schedules,
warmup as steps or a share, the no-op defaults; the whole command line is tested in
test_hf_args.py."""

from __future__ import annotations

import pytest

from lockstep.cli.hf_values import Setting, check_noop, schedule, warmup_steps
from lockstep.errors import ConfigError


@pytest.mark.parametrize(
    "raw, setting",
    [
        ("0.1", Setting("optim.warmup_ratio", "0.1")),
        ("0.999", Setting("optim.warmup_ratio", "0.999")),
        ("0", Setting("optim.warmup_steps", "0")),
        ("0.0", Setting("optim.warmup_steps", "0")),
        ("1", Setting("optim.warmup_steps", "1")),
        ("500.0", Setting("optim.warmup_steps", "500")),
    ],
)
def test_warmup_steps_is_steps_from_1_and_a_share_below(raw, setting):
    assert warmup_steps(raw) == [setting]


@pytest.mark.parametrize("raw", ["2.5", "-1", "-0.1", "nan", "inf", "ten", ""])
def test_warmup_steps_refuses_what_is_neither(raw):
    with pytest.raises(
        ConfigError, match=f"--warmup_steps {raw}: must be a whole number of optimizer steps"
    ):
        warmup_steps(raw)


def test_schedules():
    def run(kind, **given):
        return schedule("lr_scheduler_type", kind, {"lr_scheduler_type": kind, **given}, {})

    assert run("linear") == [
        Setting("optim.schedule", "linear"),
        Setting("optim.min_lr_ratio", "0", "all"),
    ]
    assert run("constant") == [
        Setting("optim.schedule", "constant"),
        Setting("optim.warmup_steps", "0"),
    ]
    assert run("constant_with_warmup") == [Setting("optim.schedule", "constant")]
    assert run(
        "cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr": 2e-5}', learning_rate="1e-4"
    ) == [Setting("optim.schedule", "cosine"), Setting("optim.min_lr_ratio", "0.2")]
    with pytest.raises(ConfigError, match="not a JSON object"):
        run("cosine_with_min_lr", lr_scheduler_kwargs="min_lr_rate=0.1")
    with pytest.raises(
        ConfigError,
        match=r"--lr_scheduler_type constant with optim.warmup_steps = "
        r"5",
    ):
        schedule(
            "lr_scheduler_type",
            "constant",
            {"lr_scheduler_type": "constant"},
            {"optim.warmup_steps": "5"},
        )


def test_no_ops_accept_lockstep_behaviour_only():
    for name, raw in [
        ("dataloader_pin_memory", "true"),
        ("dataloader_pin_memory", "1"),
        ("logging_first_step", "False"),
        ("log_level", "INFO"),
        ("log_level", "passive"),
        ("include_num_input_tokens_seen", "false"),
    ]:
        check_noop(name, raw)  # accepted
    for name, raw in [
        ("dataloader_drop_last", "false"),
        ("save_safetensors", "false"),
        ("disable_tqdm", "true"),
        ("log_level", "warning"),
        ("include_num_input_tokens_seen", "non_padding"),
        ("remove_unused_columns", "false"),
        ("dataloader_persistent_workers", "false"),
    ]:
        with pytest.raises(
            ConfigError, match=f"--{name} {raw}: not supported: lockstep.*. Drop it"
        ):
            check_noop(name, raw)
    with pytest.raises(ConfigError, match="'maybe' is not true or false"):
        check_noop("dataloader_pin_memory", "maybe")
