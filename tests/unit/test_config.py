"""Config: YAML + overrides, validation messages, batch arithmetic, the train CLI's flags."""

from __future__ import annotations

import pytest

from lockstep.cli import main
from lockstep.config import TrainConfig, load_config
from lockstep.errors import ConfigError
from lockstep.parallel.mesh import resolve_batch


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  layers: 3\ntrain:\n  batch_size: 48\n  mixed_precision: no\n")
    cfg = load_config(path, {"train.batch_size": "64", "optim.learning_rate": "3e-4"})
    assert (cfg.model.layers, cfg.train.batch_size, cfg.optim.learning_rate) == (3, 64, 3e-4)
    assert cfg.train.mixed_precision == "no"  # YAML reads a bare `no` as False


def test_unknown_key_names_closest_match(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown config key 'train.batch_sise'.*did you mean 'train.batch_size'"
    ):
        load_config(None, {"train.batch_sise": 3})
    path = tmp_path / "bad.yaml"
    path.write_text("modell:\n  layers: 3\n")
    with pytest.raises(ConfigError, match=r"'modell.layers' \(from .*bad.yaml\).*'model.layers'"):
        load_config(path)


def test_wrong_type_names_value_and_type():
    with pytest.raises(ConfigError, match=r"train.batch_size = 'abc' .* must be an integer"):
        load_config(None, {"train.batch_size": "abc"})
    with pytest.raises(
        ConfigError,
        match=r"train.mixed_precision = 'fp8' .* not one of 'auto', 'no', 'bf16', 'fp16'",
    ):
        load_config(None, {"train.mixed_precision": "fp8"})
    with pytest.raises(
        ConfigError,
        match=r"model.hidden_size \(100\) is not divisible by model.attention_heads \(3\)",
    ):
        load_config(None, {"model.hidden_size": 100, "model.attention_heads": 3})


@pytest.mark.parametrize(
    "world,mb,acc,expect",
    [
        (2, None, None, (16, 1)),
        (2, 4, None, (4, 4)),
        (2, None, 4, (4, 4)),
        (4, 2, 4, (2, 4)),
        (1, 8, None, (8, 4)),
    ],
)
def test_batch_plan(world, mb, acc, expect):
    plan = resolve_batch(TrainConfig(batch_size=32, micro_batch_size=mb, grad_accum=acc), world)
    assert (plan.micro_batch, plan.grad_accum) == expect
    assert plan.world_size * plan.micro_batch * plan.grad_accum == 32


def test_batch_not_divisible_shows_arithmetic():
    with pytest.raises(ConfigError) as e:
        resolve_batch(TrainConfig(batch_size=30, micro_batch_size=2), 4)
    assert str(e.value) == (
        "global batch 30 is not divisible by world_size(4) x micro_batch_size(2) = 8; "
        "set train.batch_size to a multiple of 8"
    )
    with pytest.raises(
        ConfigError, match=r"32 != world_size\(2\) x micro_batch_size\(4\) x grad_accum\(2\) = 16"
    ):
        resolve_batch(TrainConfig(batch_size=32, micro_batch_size=4, grad_accum=2), 2)


def test_cli_gpt_team_flags_print_config(capsys):
    argv = [
        "train",
        "--world-size",
        "4",
        "--rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29600",
        "--backend",
        "gloo",
        "--no-nccl",
        "--vocab-size",
        "512",
        "--hidden-size",
        "128",
        "--attention-heads",
        "8",
        "--layers",
        "6",
        "--max-seq-length",
        "256",
        "--learning-rate",
        "5e-4",
        "--global-batch-size",
        "64",
        "--epochs",
        "2",
        "--gradient-clip-norm",
        "0.5",
        "--save-interval",
        "50",
        "--mixed-precision",
        "--use-gradient-checkpointing",
        "--grad-accum",
        "2",
        "--warmup-steps",
        "10",
        "--eval-interval",
        "20",
        "--log-interval",
        "5",
        "--seed",
        "7",
        "--output-dir",
        "somewhere",
        "--resume",
        "none",
        "--print-config",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for line in (
        "world_size: 4",
        "rank: 1",
        "master_addr: 10.0.0.1",
        "master_port: 29600",
        "no_nccl: true",
        "vocab_size: 512",
        "attention_heads: 8",
        "layers: 6",
        "max_seq_length: 256",
        "learning_rate: 0.0005",
        "epochs: 2.0",
        "max_steps: null",
        "gradient_clip_norm: 0.5",
        "save_interval: 50",
        "mixed_precision: bf16",
        "gradient_checkpointing: true",
        "grad_accum: 2",
        "seed: 7",
        "output_dir: somewhere",
        "resume: none",
    ):
        assert line in out, line


def test_cli_unknown_flag_and_bad_value(capsys):
    assert main(["train", "--hiden-size", "64"]) == 2
    assert "did you mean --hidden-size" in capsys.readouterr().err
    assert main(["train", "--backend", "nccx", "--print-config"]) == 2
    assert "'nccx'" in capsys.readouterr().err
    assert main(["train", "--rank", "3", "--world-size", "2", "--print-config"]) == 2
    assert "ranks run 0..1" in capsys.readouterr().err


def test_per_device_batch_sets_the_global_batch(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    # the TTS team's way: per-device batch 2, no global batch; YAML booleans for the DDP switches
    cfg_file.write_text(
        "train: {batch_size: null, micro_batch_size: 2}\nparallel: {static_graph: false}\n"
    )
    cfg = load_config(cfg_file)
    assert cfg.parallel.static_graph == "false"
    plan = resolve_batch(cfg.train, 16)
    assert (plan.global_batch, plan.micro_batch, plan.grad_accum) == (32, 2, 1)


def test_warmup_ratio_alone_keeps_the_default_steps_unused():
    cfg = load_config(None, {"optim.warmup_ratio": "0.25", "optim.schedule": "linear"})
    assert (cfg.optim.warmup_ratio, cfg.optim.schedule, cfg.optim.warmup_steps) == (
        0.25,
        "linear",
        50,
    )
