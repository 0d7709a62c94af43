"""HF Trainer's defaults against lockstep's (lockstep/cli/hf_defaults.py): the table matches
transformers' own TrainingArguments, the HF defaults lockstep behaves as are what lockstep does,
and the start-up line names the differing defaults a command left unset."""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

from lockstep.cli import build_parser
from lockstep.cli.hf_args import uses_hf_names
from lockstep.cli.hf_defaults import HF_DEFAULTS, NOOPS, SAME_MEANING, differing_defaults
from lockstep.cli.train_flags import overrides_from_args
from lockstep.config import Config, load_config
from lockstep.data.sampler import steps_per_epoch


def resolve(*argv: str) -> Config:
    args = build_parser()[0].parse_args(["train", *argv])
    return load_config(args.config, overrides_from_args(args))


def test_the_table_is_transformers_own_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    assert {name: fields[name] for name in HF_DEFAULTS} == HF_DEFAULTS
    # save_safetensors: 4.x's default True; 5 always saves safetensors
    gone = "not in transformers 5"
    no_op_defaults = {name: fields.get(name, gone) for name in NOOPS}
    assert no_op_defaults == {
        "dataloader_pin_memory": True,
        "dataloader_drop_last": False,
        "dataloader_persistent_workers": False,
        "remove_unused_columns": True,
        "save_safetensors": gone,
        "logging_first_step": False,
        "disable_tqdm": None,
        "include_num_input_tokens_seen": "no",
        "log_level": "passive",
    }


def test_the_defaults_left_out_of_the_line_are_equal():
    cfg = Config()
    # were one to change, the line says it
    for name in ("adam_beta1", "adam_epsilon", "max_grad_norm"):
        section, field = SAME_MEANING[name].split(".")
        assert getattr(getattr(cfg, section), field) == HF_DEFAULTS[name], name


def test_the_line_names_what_differs_and_was_not_set():
    line = differing_defaults(
        resolve("--per_device_train_batch_size", "2", "--learning_rate", "5e-5")
    )
    assert line.startswith(
        "lockstep defaults that differ from HF Trainer's, not set by this command: "
        "optim.weight_decay 0.1 (HF "
        "--weight_decay 0), optim.beta2 0.95 (HF --adam_beta2 0.999), schedule cosine to 0.1 x "
        "peak (HF linear "
        "to 0), warmup 50 steps (HF 0), train.seed 1337 (HF --seed 42), train.max_steps 600 (HF 3 "
        "epochs), "
        "evaluation every 100 steps on a held-out 0.02 of the data (HF none), "
        "train.mixed_precision auto: bf16 "
        "where supported (HF fp32), train.log_interval 10 (HF --logging_steps 500)"
    )
    assert line.endswith("; set one with its HF name or --set KEY=VALUE") and "\n" not in line
    assert "learning_rate" not in line and "train.batch_size" not in line  # set by the command
    quiet = resolve(
        "--weight_decay",
        "0",
        "--adam_beta2",
        "0.999",
        "--lr_scheduler_type",
        "linear",
        "--warmup_steps",
        "0.1",
        "--seed",
        "42",
        "--num_train_epochs",
        "3",
        "--disable_evaluation",
    )
    line = differing_defaults(quiet)
    assert "optim.weight_decay" not in line and "schedule" not in line and "warmup" not in line
    assert "seed" not in line and "max_steps" not in line and "evaluation" not in line
    assert line.startswith(
        "lockstep defaults that differ from HF Trainer's, not set by this "
        "command: "
        "optim.learning_rate 0.002 (HF --learning_rate 5e-05), train.batch_size "
        "32"
    )


def test_a_command_without_hf_names_gets_no_line():
    parser = build_parser()[0]
    assert not uses_hf_names(parser.parse_args(["train", "--learning-rate", "1e-3"]))
    assert uses_hf_names(parser.parse_args(["train", "--learning_rate", "1e-3"]))
    assert uses_hf_names(parser.parse_args(["train", "--dataloader_pin_memory"]))


def test_the_no_ops_are_what_lockstep_does():
    # dataloader_drop_last true: an epoch of 10 samples at global batch 4 is 2 steps, the last 2
    # dropped
    assert steps_per_epoch(10, 4) == 2
    assert NOOPS["dataloader_drop_last"][0] is True and NOOPS["logging_first_step"][0] is False
