"""`--help` of the config flags: what each does, its default and key (lockstep/cli/flag_help.py)."""

from __future__ import annotations

import argparse

from lockstep.cli.flag_help import flag_help, flag_metavar
from lockstep.cli.train_flags import FLAGS, SWITCHES, add_config_flags


def test_help_says_what_the_flag_does_then_key_and_default():
    assert flag_help("--learning-rate", "optim.learning_rate") == (
        "peak learning rate, reached at the end of warmup (then --lr-schedule) "
        "(optim.learning_rate, default 0.002)"
    )
    assert flag_help("--lr-schedule", "optim.schedule") == (
        "after warmup: cosine or linear decay to --min-lr-ratio x the peak at the last step, or "
        "constant at the peak (optim.schedule, default cosine)"
    )
    assert flag_help("--warmup-ratio", "optim.warmup_ratio") == (
        "warmup as a share of the run's optimizer steps, rounded up (as HF Trainer); replaces "
        "--warmup-steps (optim.warmup_ratio, default unset)"
    )
    assert flag_metavar("optim.schedule") == "{cosine,linear,constant}"
    assert (
        flag_help("--hidden-size", "model.hidden_size")
        == "width of the residual stream (model.hidden_size, default 256)"
    )
    assert flag_help("--grad-accum", "train.grad_accum").endswith(
        "(train.grad_accum, default unset)"
    )
    assert flag_help("--use-lora", "model.use_lora").endswith("(model.use_lora, default false)")


def test_metavars_say_what_the_value_is():
    assert [
        flag_metavar(k)
        for k in (
            "train.max_steps",
            "optim.learning_rate",
            "data.path",
            "train.epochs",
            "distributed.master_addr",
        )
    ] == ["N", "X", "PATH", "X", "TEXT"]
    assert flag_metavar("parallel.data_parallel") == "{ddp,fsdp}"


def test_every_flags_help_is_more_than_its_key():
    p = argparse.ArgumentParser()
    add_config_flags(p)
    ours = {*FLAGS, *SWITCHES, "--mixed-precision", "--per-device-batch-size", "--batch-size"}
    helps = {
        a.option_strings[0]: a.help
        for a in p._actions
        if a.option_strings and a.option_strings[0] in ours
    }
    assert set(helps) == ours
    for flag, text in helps.items():
        # before "(key, default D)"
        what = text.split(f" ({FLAGS.get(flag) or SWITCHES.get(flag)}, default")[0]
        assert len(what) >= 20 and "." not in what.split()[0], (flag, text)
        assert "%" not in text.replace("%%", ""), flag  # argparse formats help strings
