"""`lockstep train`'s flags (lockstep/cli/train_flags.py): each names a config key, --help groups
them by config section, they become overrides labelled as typed, and the refused ones (an ambiguous
batch size, TRL's quantization settings, a bad precision) get one line and exit 2."""

from __future__ import annotations

import re

from conftest import run_main

from lockstep.cli import build_parser
from lockstep.cli.train_flags import FLAGS, SECTIONS, SWITCHES, overrides_from_args
from lockstep.config import Config, config_to_dict


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


QLORA = (
    "lockstep's one quantized base is model.load_in_4bit (QLoRA: LoRA adapters on a frozen "
    "NF4 base with double quantization, by bitsandbytes; built, runs on CUDA only, its tests "
    "run in the GPU tier): pass --load-in-4bit with --use-lora"
)


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
        "config means the global batch (samples per optimizer step over all ranks, "
        "train.batch_size)"
    )
    assert "HF Trainer and the GPT team's old CLI a batch per device" in err
    assert "Pass --global-batch-size 8 (8 samples per step in all;" in err
    assert (
        "or --per-device-batch-size 8 (8 per device per forward; global batch = ranks x 8 x "
        "accumulation)" in err
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
