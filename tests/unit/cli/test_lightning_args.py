"""Lightning Trainer names (lockstep/cli/lightning_args.py): a Lightning user's command line
resolved into lockstep's config with Lightning's meaning, LightningCLI's --trainer.X spelling,
--devices and --num_nodes outside and under a launcher, the names and values refused with the
lockstep way, and --help."""

from __future__ import annotations

import pytest
import yaml
from conftest import run_main

from lockstep.cli import build_parser
from lockstep.cli.lightning_args import DEST, NAMES, REFUSED, lightning_settings
from lockstep.cli.train_flags import overrides_from_args
from lockstep.errors import ConfigError
from lockstep.runtime import LaunchEnv

NO_LAUNCHER = LaunchEnv("none", 0, 0, 1, 1, 0, None, None)
TORCHRUN_2X4 = LaunchEnv("torchrun", 5, 1, 8, 4, 1, "node0", 29500)  # 2 nodes x 4 processes


def overrides(*argv: str) -> dict:
    parser, _ = build_parser()
    return overrides_from_args(parser.parse_args(["train", *argv]))


def settings(launch: LaunchEnv = NO_LAUNCHER, **given) -> dict[str, object]:
    return {s.key: s.value for _, s in lightning_settings(given, launch)}


def refusal(launch: LaunchEnv = NO_LAUNCHER, **given) -> str:
    with pytest.raises(ConfigError) as e:
        lightning_settings(given, launch)
    return str(e.value)


def test_a_lightning_command_line_in_print_config(capsys):
    code, out, err = run_main(
        capsys,
        "train",
        "--devices",
        "2",
        "--precision",
        "bf16-mixed",
        "--max_epochs",
        "3",
        "--strategy",
        "ddp_find_unused_parameters_true",
        "--accumulate_grad_batches",
        "2",
        "--gradient_clip_val",
        "0.5",
        "--log_every_n_steps",
        "5",
        "--val_check_interval",
        "10",
        "--accelerator",
        "cpu",
        "--default_root_dir",
        "runs/pl",
        "--seed_everything",
        "7",
        "--print-config",
    )
    assert code == 0 and err == ""
    cfg = yaml.safe_load(out)
    assert cfg["distributed"].items() >= {"world_size": 2, "device": "cpu"}.items()
    assert (
        cfg["train"].items()
        >= {
            "mixed_precision": "bf16",
            "epochs": 3.0,
            "max_steps": None,
            "grad_accum": 2,
            "log_interval": 5,
            "seed": 7,
            "eval_interval": 5,
        }.items()
    )  # 10 batches / 2 per optimizer step
    assert (
        cfg["parallel"]["data_parallel"] == "ddp"
        and cfg["parallel"]["find_unused_parameters"] == "true"
    )
    assert (
        cfg["optim"]["gradient_clip_norm"] == 0.5 and cfg["checkpoint"]["output_dir"] == "runs/pl"
    )


def test_lightningcli_spelling_and_labels():
    out = overrides(
        "--trainer.devices", "3", "--trainer.max_epochs", "2", "--trainer.precision", "32-true"
    )
    assert out == {
        "distributed.world_size": "3",
        "train.epochs": "2",
        "train.max_steps": None,
        "train.mixed_precision": "no",
    }
    assert out.labels["distributed.world_size"] == "--devices 3"
    assert overrides("--trainer.max_steps", "40") == {"train.max_steps": "40"}


@pytest.mark.parametrize(
    "value, autocast",
    [
        ("32", "no"),
        ("32-true", "no"),
        ("16-mixed", "fp16"),
        ("16", "fp16"),
        ("bf16-mixed", "bf16"),
        ("bf16", "bf16"),
    ],
)
def test_precision_values_map_to_autocast(value, autocast):
    assert settings(precision=value) == {"train.mixed_precision": autocast}


def test_true_half_and_double_precision_are_refused_with_the_reason():
    assert refusal(precision="bf16-true") == (
        "--precision bf16-true: not supported: lockstep keeps fp32 master weights and autocasts "
        "the forward "
        "(pass --precision bf16-mixed); to load a Hugging Face model's weights in bfloat16 "
        "instead, pass "
        "--set model.dtype=bfloat16"
    )
    assert "pass --precision 16-mixed" in refusal(precision="16-true")
    assert "model.dtype=float16" in refusal(precision="16-true")
    assert refusal(precision="64") == (
        "--precision 64: not supported: lockstep trains in float32 at most; "
        "pass --precision 32-true"
    )
    assert refusal(precision="8") == (
        "--precision 8: lockstep's precisions are 32-true (32), bf16-mixed "
        "(bf16) and 16-mixed (16); pass one of those"
    )


def test_strategies():
    assert settings(strategy="auto") == {}
    assert settings(strategy="ddp") == {"parallel.data_parallel": "ddp"}
    assert settings(strategy="fsdp") == {"parallel.data_parallel": "fsdp"}
    assert settings(strategy="ddp_find_unused_parameters_false") == {
        "parallel.data_parallel": "ddp",
        "parallel.find_unused_parameters": "false",
    }
    assert refusal(strategy="deepspeed_stage_3").startswith(
        "--strategy deepspeed_stage_3: not supported: lockstep has no DeepSpeed integration; to "
        "shard "
        "parameters, gradients and optimizer state it uses FSDP2: --set parallel.data_parallel=fsdp"
    )
    assert refusal(strategy="xla") == (
        "--strategy xla: lockstep runs DDP or FSDP2 (parallel.data_parallel); "
        "pass --strategy ddp, fsdp, ddp_find_unused_parameters_true or auto"
    )


def test_devices_outside_a_launcher_is_the_local_world_size():
    assert settings(devices="4") == {"distributed.world_size": "4"}
    # one per GPU: lockstep's default
    assert settings(devices="auto") == {} and settings(devices="-1") == {}
    assert settings(devices="4", num_nodes="1") == {"distributed.world_size": "4"}
    assert refusal(devices="0,1") == (
        "--devices 0,1: lockstep takes a number of processes per node (or auto / -1: one per "
        "GPU), not a list "
        "of device indices; pick GPUs with CUDA_VISIBLE_DEVICES=0,1 and pass --devices 2"
    )


def test_several_nodes_outside_a_launcher_point_to_the_launchers(capsys):
    code, out, err = run_main(capsys, "train", "--num_nodes", "2", "--print-config")
    assert (code, out) == (2, "")
    assert err == (
        "lockstep train: error: --num_nodes 2: `lockstep train` outside a launcher starts "
        "processes on "
        "this node only; for 2 nodes run `lockstep slurm --nodes 2` (SLURM), `lockstep k8s` "
        "(Kubernetes), or `torchrun --nnodes 2 ... -m lockstep train` on every node\n"
    )


def test_under_a_launcher_devices_and_nodes_must_match_it():
    # the launcher's world size stands
    assert settings(TORCHRUN_2X4, devices="4", num_nodes="2") == {}
    assert refusal(TORCHRUN_2X4, devices="8") == (
        "--devices 8 but torchrun started LOCAL_WORLD_SIZE=4 processes on this node (its "
        "--nproc_per_node); make them agree, or drop --devices"
    )
    assert refusal(TORCHRUN_2X4, num_nodes="1") == (
        "--num_nodes 1 but torchrun started 8 processes, 4 per node: 2 node(s); make --num_nodes "
        "equal the "
        "launcher's node count, or drop it"
    )
    srun = LaunchEnv("slurm", 0, 0, 16, 8, 0, "node0", 20000)
    assert refusal(srun, devices="4") == (
        "--devices 4 but srun started 8 tasks on this node "
        "(--ntasks-per-node); make them agree, or drop --devices"
    )
    assert refusal(srun, num_nodes="3").startswith(
        "--num_nodes 3 but srun started 16 processes, 8 per node"
    )


def test_devices_under_torchrun_through_the_environment(capsys, monkeypatch):
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(key, value)  # what torchrun --nproc_per_node 2 gives each worker
    assert overrides("--devices", "2", "--num_nodes", "1") == {}
    code, _, err = run_main(capsys, "train", "--devices", "4", "--print-config")
    assert code == 2 and err.startswith(
        "lockstep train: error: --devices 4 but torchrun started "
        "LOCAL_WORLD_SIZE=2 processes on this node"
    )


def test_epochs_and_steps_with_lightnings_meaning():
    # max_epochs alone: no step limit (as lockstep's --epochs);
    # with --max_steps: whichever comes first
    assert overrides("--max_epochs", "3") == {"train.epochs": "3", "train.max_steps": None}
    assert overrides("--max_epochs", "3", "--max_steps", "100") == {
        "train.epochs": "3",
        "train.max_steps": "100",
    }
    assert overrides("--max_epochs", "-1", "--max_steps", "100") == {
        "train.max_steps": "100",
        "train.epochs": None,
    }
    assert refusal(max_epochs="-1") == (
        "--max_epochs -1 trains without end in Lightning unless --max_steps "
        "stops it; lockstep needs an end: pass --max_steps N, or --max_epochs E"
    )
    assert settings(max_steps="-1") == {"train.max_steps": None}


def test_val_check_interval_counts_batches():
    assert settings(val_check_interval="50") == {"train.eval_interval": "50"}
    assert settings(val_check_interval="50", accumulate_grad_batches="5") == {
        "train.eval_interval": "10",
        "train.grad_accum": "5",
    }
    assert overrides("--val_check_interval", "8", "--grad-accum", "4")["train.eval_interval"] == "2"
    assert refusal(val_check_interval="10", accumulate_grad_batches="4") == (
        "--val_check_interval 10: counts training batches, and lockstep evaluates after an "
        "optimizer step "
        "(every 4 batches with --accumulate_grad_batches 4); pass a multiple of 4, or "
        "--eval-interval N in "
        "optimizer steps"
    )
    assert refusal(val_check_interval="0.25").startswith(
        "--val_check_interval 0.25: lockstep evaluates every N optimizer steps, not at a fraction "
        "of an epoch"
    )


def test_other_values_and_names_refused():
    assert settings(accelerator="gpu") == {"distributed.device": "cuda"}
    assert refusal(accelerator="mps") == (
        "--accelerator mps: lockstep trains on CUDA GPUs or on CPU; pass "
        "--accelerator gpu, cpu or auto"
    )
    assert settings(gradient_clip_algorithm="norm") == {}
    assert "not each value" in refusal(gradient_clip_algorithm="value")
    assert (
        refusal(limit_train_batches=["10"]) == f"--limit_train_batches 10: not supported: "
        f"{REFUSED['limit_train_batches']}"
    )
    assert refusal(check_val_every_n_epoch=["2"]).startswith(
        "--check_val_every_n_epoch 2: not supported: lockstep evaluates every N optimizer steps, "
        "not per epoch"
    )


def test_a_key_set_twice_must_agree(capsys):
    assert (
        overrides("--accumulate_grad_batches", "4", "--gradient_accumulation_steps", "4")[
            "train.grad_accum"
        ]
        == "4"
    )
    code, _, err = run_main(
        capsys, "train", "--grad-accum", "2", "--accumulate_grad_batches", "4", "--print-config"
    )
    assert (code, err) == (
        2,
        "lockstep train: error: --grad-accum 2 and --accumulate_grad_batches 4 give "
        "train.grad_accum different values ('2' and '4'); both name the same setting: "
        "pass one of them\n",
    )


def test_every_name_is_registered_once_in_its_group(capsys):
    parser, commands = build_parser()
    dests = {a.dest for a in commands["train"]._actions}
    assert {DEST + n for n in NAMES if n != "max_steps"} | {DEST + n for n in REFUSED} <= dests
    code, out, _ = run_main(capsys, "train", "--help")
    group = out.split("Lightning Trainer names:")[1]
    for name in NAMES:
        assert f"--trainer.{name}" in group, name
    # named, not listed
    assert "--limit_train_batches" in group and "--limit_train_batches N" not in group
