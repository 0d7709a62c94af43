"""Dotted-key overrides: coercion to each field's type, and the hint an unknown key gets."""

from __future__ import annotations

import pytest
from conftest import run_main

from lockstep.config import Config
from lockstep.config.overrides import all_keys, apply_overrides, flatten
from lockstep.errors import ConfigError


def test_flatten_turns_sections_into_dotted_keys():
    assert flatten({"train": {"batch_size": 8, "seed": 1}, "model": {"layers": 2}}, "x.yaml") == {
        "train.batch_size": 8,
        "train.seed": 1,
        "model.layers": 2,
    }


def test_strings_are_coerced_to_the_fields_types_and_recorded_as_set():
    cfg = Config()
    apply_overrides(
        cfg,
        {
            "train.max_steps": "1_000",
            "optim.learning_rate": "3e-4",
            "train.record_samples": "yes",
            "train.peak_flops": "none",
            "train.mixed_precision": False,
        },
        "command line",
    )
    assert (
        cfg.train.max_steps == 1000
        and cfg.optim.learning_rate == 3e-4
        and cfg.train.record_samples is True
    )
    assert cfg.train.peak_flops is None
    assert cfg.train.mixed_precision == "no"  # YAML reads `no` as False
    assert {"train.max_steps", "train.record_samples", "train.mixed_precision"} <= cfg.set_keys
    assert "train.batch_size" not in cfg.set_keys


@pytest.mark.parametrize(
    "key, needle",
    [
        ("train.batchsize", "did you mean 'train.batch_size'"),
        ("batch_size", "did you mean 'train.batch_size'"),
        # the field where it is, not a look-alike here
        ("model.batch_size", "did you mean 'train.batch_size'"),
        ("nothing.like.this", "valid keys: model.kind"),
    ],
)
def test_an_unknown_key_names_the_closest_valid_one(key, needle):
    with pytest.raises(ConfigError, match="unknown config key") as e:
        apply_overrides(Config(), {key: 1}, "run.yaml")
    assert needle in str(e.value) and "(from run.yaml)" in str(e.value)


@pytest.mark.parametrize(
    "key",
    [
        "model.quantization",
        "model.quantization_config",
        "model.load_in_8bit",
        "model.bnb_4bit_quant_type",
        "model.bnb_4bit_use_double_quant",
        "model.use_bnb_nested_quant",
        "load_in_4bit",
    ],
)
def test_quantization_keys_get_what_lockstep_supports(key):
    """One line on QLoRA, not a look-alike key (model.quantization got 'model.attention_heads')."""
    with pytest.raises(ConfigError) as e:
        apply_overrides(Config(), {key: "nf4"}, "--set")
    assert str(e.value) == (
        f"unknown config key {key!r} (from --set): lockstep's one quantized base is "
        "model.load_in_4bit (QLoRA: LoRA adapters on a frozen NF4 base with double quantization, "
        "by bitsandbytes; built, runs on CUDA only, its tests run in the GPU tier): pass "
        "--load-in-4bit with --use-lora"
    )


def test_a_value_of_the_wrong_type_names_value_type_and_source():
    with pytest.raises(ConfigError) as e:
        apply_overrides(Config(), {"train.max_steps": "ten"}, "command line")
    assert str(e.value) == "train.max_steps = 'ten' (from command line) must be an integer; got str"
    with pytest.raises(ConfigError, match="is not one of 'auto', 'no', 'bf16', 'fp16'"):
        apply_overrides(Config(), {"train.mixed_precision": "fp8"}, "command line")


def test_the_cli_refuses_an_unknown_key_or_a_wrong_type_with_exit_2(tmp_path, capsys):
    """`lockstep train`: a mistyped key from --set or a config file gets the closest valid one, a
    value of the wrong type its key; exit 2, before any worker starts."""
    yaml = tmp_path / "c.yaml"
    yaml.write_text("optim:\n  learning_rat: 0.1\n")
    cases = [
        (["--set", "train.batch_sise=3"], "did you mean 'train.batch_size'"),
        (["--config", yaml], "did you mean 'optim.learning_rate'"),
        (["--global-batch-size", "abc"], "train.batch_size = 'abc'"),
        (["--learning-rate", "fast"], "must be a number"),
    ]
    for argv, needle in cases:
        code, out, err = run_main(capsys, "train", *argv)
        assert code == 2 and "Traceback" not in err, (argv, err)
        assert "starting 2 workers" not in out, "workers were started before the input was checked"
        assert needle in err, (argv, err)


def test_all_keys_lists_every_field_of_every_section():
    keys = all_keys(Config())
    assert (
        "train.batch_size" in keys
        and "checkpoint.output_dir" in keys
        and len(keys) == len(set(keys))
    )


def test_each_key_records_where_its_value_came_from(tmp_path):
    from lockstep.config import Overrides, load_config

    config = tmp_path / "run.yaml"
    config.write_text("train: {batch_size: 64}\noptim: {warmup_steps: 5}\n")
    flags = Overrides(
        {"train.micro_batch_size": "4", "train.seed": "3"},
        {"train.micro_batch_size": "--micro-batch-size 4"},
    )  # train.seed: no label given
    cfg = load_config(config, flags)
    assert cfg.sources == {
        "train.batch_size": str(config),
        "optim.warmup_steps": str(config),
        "train.micro_batch_size": "--micro-batch-size 4",
        "train.seed": "command line",
    }
    assert cfg.set_keys == set(cfg.sources)  # set_keys keeps working for the code that reads it
    assert flags == {
        "train.micro_batch_size": "4",
        "train.seed": "3",
    }  # still a plain mapping of values
    assert Config().sources == {}  # defaults have no source: they read as "default"


def test_parse_sets_keeps_values_as_typed_and_labels_each():
    from lockstep.config.overrides import parse_sets

    sets = parse_sets(
        ["parallel.grad_compression=bf16", " train.max_steps =20", "data.path=a=b.txt"]
    )
    assert dict(sets) == {
        "parallel.grad_compression": "bf16",
        "train.max_steps": "20",
        "data.path": "a=b.txt",
    }
    assert sets.labels["train.max_steps"] == "--set  train.max_steps =20"
    with pytest.raises(
        ConfigError,
        match=r"^--set 'model.layers' is not KEY=VALUE; e.g. --set train.batch_size=64$",
    ):
        parse_sets(["model.layers"])
