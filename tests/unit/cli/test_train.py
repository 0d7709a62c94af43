"""`lockstep train`'s arguments (lockstep/cli/train.py): flags mapped to config keys, the resolved config printed,
and what is refused before any worker starts, with its one-line message and exit code. Training runs: tests/e2e."""

from __future__ import annotations

import os
import re

import yaml
from conftest import run_lockstep, run_main

from lockstep.cli import build_parser
from lockstep.cli.train import FLAGS, SECTIONS, SWITCHES, overrides_from_args
from lockstep.config import Config, config_to_dict
from lockstep.runtime import free_port


def overrides(*argv: str) -> dict:
    parser, _ = build_parser()
    return overrides_from_args(parser.parse_args(["train", *argv]))


def test_help_lists_every_flag_with_its_config_key(capsys):
    code, out, _ = run_main(capsys, "train", "--help")
    assert code == 0
    for flag, key in {**FLAGS, **SWITCHES}.items():
        assert flag in out and key in out, flag
    assert "--print-config" in out and "--set KEY=VALUE" in out
    assert "--launched-by-lockstep" not in out  # set by lockstep's own launcher on its workers only


def test_every_flag_names_a_config_key():
    sections = config_to_dict(Config())
    for key in [*FLAGS.values(), *SWITCHES.values(), "train.mixed_precision"]:
        section, name = key.split(".")
        assert name in sections[section], key


def test_flags_become_overrides():
    assert overrides(
        "--hidden-size",
        "64",
        "--learning-rate",
        "3e-4",
        "--use-lora",
        "--mixed-precision",
        "--set",
        "data.max_bytes=1000",
        "--set",
        " train.seed = 5",
    ) == {
        "model.hidden_size": "64",
        "optim.learning_rate": "3e-4",
        "model.use_lora": True,
        "train.mixed_precision": "bf16",
        "data.max_bytes": "1000",
        "train.seed": " 5",
    }  # the config layer coerces
    assert overrides("--mixed-precision", "fp16") == {"train.mixed_precision": "fp16"}
    assert overrides() == {}  # nothing given: the config file and defaults decide
    # --epochs alone means "train for that many epochs"; with --max-steps both stay
    assert overrides("--epochs", "3") == {"train.epochs": "3", "train.max_steps": None}
    assert overrides("--epochs", "3", "--max-steps", "10") == {
        "train.epochs": "3",
        "train.max_steps": "10",
    }


def test_print_config_shows_the_resolved_values(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: {hidden_size: 48}\ntrain: {max_steps: 3}\n")
    code, out, err = run_main(
        capsys,
        "train",
        "--config",
        config,
        "--layers",
        "3",
        "--set",
        "train.max_steps=7",
        "--print-config",
    )
    assert code == 0 and err == ""
    printed = yaml.safe_load(out)
    # file, then flags
    assert printed["model"]["hidden_size"] == 48 and printed["model"]["layers"] == 3
    assert printed["train"]["max_steps"] == 7  # --set overrides the file


def test_bad_input_is_one_line_and_exit_2(capsys):
    cases = [
        (
            ["--set", "foo"],
            "lockstep train: error: --set 'foo' is not KEY=VALUE; e.g. --set train.batch_size=64",
        ),
        (
            ["--hiden-size", "64"],
            "lockstep train: error: unknown option '--hiden-size'; did you mean --hidden-size?",
        ),
        (
            ["--layers", "two", "--print-config"],
            "lockstep train: error: model.layers = 'two' (from command line) must be an integer; got str",
        ),
        # the batch arithmetic is checked before any worker starts
        (
            ["--world-size", "3", "--global-batch-size", "32", "--micro-batch-size", "4"],
            "lockstep train: error: global batch 32 is not divisible by world_size(3) x micro_batch_size(4) = 12; set "
            "train.batch_size to a multiple of 12",
        ),
    ]
    for argv, message in cases:
        code, out, err = run_main(capsys, "train", *argv)
        assert (code, out, err) == (2, "", message + "\n"), argv


def help_sections(text: str) -> dict[str, str]:
    """--help text split at its group headers (after a blank line, at column 0, ending in ':'):
    header -> the text under it."""
    out, header, previous = {}, "", ""
    for line in text.splitlines():
        if not previous and line and not line[0].isspace() and line.endswith(":"):
            header = line[:-1]
        else:
            out[header] = out.get(header, "") + line + "\n"
        previous = line
    return out


def test_help_groups_native_flags_under_their_config_section(capsys):
    code, out, _ = run_main(capsys, "train", "--help")
    sections = help_sections(out)
    groups = ["", "options", *SECTIONS, "HF Trainer names", "Lightning Trainer names", "launch"]
    assert code == 0 and list(sections) == groups
    # lockstep.cli.launch_options, as launch / slurm / k8s
    assert "--max-restarts" in sections["launch"]
    for section, line in SECTIONS.items():  # each header's one-line description
        assert " ".join(sections[section].split()).startswith(line), section
    flags = {
        **FLAGS,
        **SWITCHES,
        "--mixed-precision": "train.mixed_precision",
        "--per-device-batch-size": "train.micro_batch_size",
        "--load_in_4bit": "model.load_in_4bit",
    }
    for flag, key in flags.items():
        listed = [h for h, text in sections.items() if re.search(rf"\n  {flag}( |\n)", text)]
        assert listed == [key.split(".")[0]], (flag, listed)


def test_did_you_mean_suggests_only_what_lockstep_honours(capsys):
    # --tpu_num_cores and --hub_strategy are refused HF names: never the suggestion
    cases = {
        "--tpu_num_cors": "--num_nodes",
        "--hub_strategyy": "--strategy",
        "--num_nodez": "--num_nodes",
        "--load_in_4bitt": "--load_in_4bit",
    }
    for typo, honoured in cases.items():
        code, _, err = run_main(capsys, "train", typo, "1")
        assert (code, err) == (
            2,
            f"lockstep train: error: unknown option {typo!r}; did you mean {honoured}?\n",
        )
    code, _, err = run_main(capsys, "train", "--batch_size", "8")  # refused, with both readings
    assert err.startswith(
        "lockstep train: error: --batch-size 8 is ambiguous, so lockstep refuses it"
    )
    code, _, err = run_main(capsys, "train", "--push_to_hubb")  # close only to refused names
    assert err == (
        "lockstep train: error: unknown option '--push_to_hubb'; see `lockstep train --help`\n"
    )


QLORA = (
    "lockstep's one quantized base is model.load_in_4bit (QLoRA: LoRA adapters on a frozen "
    "NF4 base with double quantization, by bitsandbytes; built, runs on CUDA only, its tests "
    "run in the GPU tier): pass --load-in-4bit with --use-lora"
)


def test_trl_quantization_flags(capsys):
    assert overrides("--load_in_4bit") == {"model.load_in_4bit": True}  # TRL's name, same meaning
    assert overrides("--load_in_4bit", "false") == {"model.load_in_4bit": "false"}
    code, _, err = run_main(capsys, "train", "--load_in_8bit", "--print-config")
    assert (code, err) == (
        2,
        "lockstep train: error: --load_in_8bit: not supported: lockstep has "
        f"no 8-bit base; {QLORA}\n",
    )
    for flag in ("--bnb_4bit_quant_type", "--use_bnb_nested_quant", "--quantization_config"):
        code, _, err = run_main(capsys, "train", flag, "x", "--print-config")
        assert (code, err) == (
            2,
            f"lockstep train: error: {flag} x: lockstep's 4-bit recipe is "
            "fixed (NF4, double quantization, bf16 compute), so it takes no "
            f"setting; drop it. {QLORA}\n",
        )
    code, _, err = run_main(capsys, "train", "--set", "model.quantization=nf4", "--print-config")
    assert (code, err) == (
        2,
        "lockstep train: error: unknown config key 'model.quantization' "
        f"(from command line): {QLORA}\n",
    )


def test_a_bad_mixed_precision_lists_the_choices(capsys):
    code, _, err = run_main(capsys, "train", "--mixed-precision", "fp8", "--print-config")
    assert code == 2 and err.startswith("lockstep train: error: train.mixed_precision = 'fp8'")
    assert "'no'" in err and "'bf16'" in err and "'fp16'" in err


def test_the_ambiguous_batch_size_is_refused_with_both_readings_and_both_flags(capsys):
    code, out, err = run_main(capsys, "train", "--batch-size", "8", "--print-config")
    assert code == 2 and out == ""
    assert err.startswith(
        "lockstep train: error: --batch-size 8 is ambiguous, so lockstep refuses it: lockstep's "
        "config means the global batch (samples per optimizer step over all ranks, train.batch_size)"
    )
    assert "HF Trainer and the GPT team's old CLI a batch per device" in err
    assert "Pass --global-batch-size 8 (8 samples per step in all;" in err
    assert (
        "or --per-device-batch-size 8 (8 per device per forward; global batch = ranks x 8 x accumulation)"
        in err
    )


def test_global_and_per_device_batch_flags(tmp_path):
    from lockstep.config import load_config

    assert overrides("--global-batch-size", "64") == {"train.batch_size": "64"}
    per_device = overrides("--per-device-batch-size", "4")
    assert per_device == {
        "train.micro_batch_size": "4",
        "train.batch_size": None,
    }  # the global batch follows the world
    cfg = load_config(None, per_device)
    assert (cfg.train.batch_size, cfg.train.micro_batch_size) == (None, 4)
    assert cfg.sources["train.micro_batch_size"] == "--per-device-batch-size 4"
    both = overrides("--per-device-batch-size", "4", "--global-batch-size", "64")
    assert both == {"train.micro_batch_size": "4", "train.batch_size": "64"}
    assert both.labels == {
        "train.micro_batch_size": "--per-device-batch-size 4",
        "train.batch_size": "--global-batch-size 64",
    }
    assert (
        overrides("--per-device-batch-size", "4", "--per_device_train_batch_size", "4")[
            "train.micro_batch_size"
        ]
        == "4"
    )


def test_two_per_device_batches_that_disagree_are_refused(capsys):
    code, _, err = run_main(
        capsys, "train", "--per-device-batch-size", "4", "--micro-batch-size", "2", "--print-config"
    )
    assert (code, err) == (
        2,
        "lockstep train: error: --micro-batch-size 2 and --per-device-batch-size 4 give "
        "train.micro_batch_size different values ('2' and '4'); both name the same setting: "
        "pass one of them\n",
    )


def test_labels_name_the_flag_as_typed():
    labels = overrides(
        "--learning-rate", "3e-4", "--use-lora", "--set", "train.seed=5", "--epochs", "2"
    ).labels
    assert labels == {
        "optim.learning_rate": "--learning-rate 3e-4",
        "model.use_lora": "--use-lora",
        "train.seed": "--set train.seed=5",
        "train.epochs": "--epochs 2",
        "train.max_steps": "--epochs 2 (without --max-steps)",
    }


CRASHES = """
    import torch
    from torch import nn

    class Crashes(nn.Module):
        '''Trains one step, then its forward fails as a bug in the user's model would.'''

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("the model's own bug")
            return self.lin(x).pow(2).mean()

    def build_model():
        return Crashes()

    def build_data():
        return [{"x": torch.randn(2)} for _ in range(16)]
"""


def test_a_crash_shows_its_traceback_once(tmp_path, write_module):
    """In this process (--world-size 1) and as a launched worker, the traceback of a crash reaches the
    console once: run_training's log line shows it, so the command does not print it again."""
    module = write_module(CRASHES)
    common = (
        "train",
        "--model-kind",
        "custom",
        "--set",
        f"model.factory={module}:build_model",
        "--set",
        "data.kind=custom",
        "--set",
        f"data.factory={module}:build_data",
        "--set",
        "data.num_workers=0",
        "--global-batch-size",
        "4",
        "--max-steps",
        "3",
        "--set",
        "parallel.check_steps=0",
        "--device",
        "cpu",
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    here = run_lockstep(
        *common, "--world-size", "1", "--output-dir", str(tmp_path / "here"), check=False, env=env
    )
    worker_env = {
        **env,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    worker = run_lockstep(
        *common,
        "--launched-by-lockstep",
        "--output-dir",
        str(tmp_path / "worker"),
        check=False,
        env=worker_env,
    )
    for proc in (here, worker):
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-6000:]
        assert "RuntimeError: the model's own bug" in proc.stderr


def test_a_run_whose_step_would_not_fit_is_refused_before_a_worker_starts(capsys, tmp_path):
    run = tmp_path / "run"
    # fmt: off
    code, _, err = run_main(
        capsys, "train", "--hidden-size", 32768, "--attention-heads", 256, "--layers", 2,
        "--max-seq-length", 16, "--global-batch-size", 2, "--world-size", 2,
        "--output-dir", run, "--set", "train.plan_check=refuse",
    )
    # fmt: on
    assert code == 2
    assert "lockstep plan: a step of this run needs" in err
    assert "to start anyway: --set train.plan_check=warn (or off)" in err
    assert not run.exists()  # no worker started, nothing written
