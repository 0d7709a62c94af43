"""HF Trainer names (lockstep/cli/hf_args.py): the TTS team's torchrun command resolved into lockstep's config, both
spellings, HF's boolean values, the names refused with their reason, conflicts with lockstep's own flags, --help,
--print-config, and `lockstep slurm` rendering the same job for 2 nodes x 8 GPUs."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml
from conftest import run_lockstep, run_main

from lockstep.cli import build_parser
from lockstep.cli.hf_args import KEYS, hf_settings
from lockstep.cli.train_flags import overrides_from_args
from lockstep.config import Config, config_to_dict, load_config
from lockstep.errors import ConfigError


def team_flags(data) -> list[str]:
    """The TTS team's command line, as they pass it to torchrun -m lockstep train."""
    return [
        "--model_path",
        "bosonai/higgs-audio-v2-generation-3B-base",
        "--audio_tokenizer_path",
        "bosonai/higgs-audio-v2-tokenizer",
        "--train_data_file",
        str(data),
        "--output_dir",
        "./output_expmt_v1",
        "--save_steps",
        "5000",
        "--disable_evaluation",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "5e-5",
        "--num_train_epochs",
        "3",
        "--logging_steps",
        "50",
        "--warmup_steps",
        "500",
        "--bf16",
        "--use_lora",
    ]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train_chatml_samples.json"
    path.write_text("[]")
    return path


def resolve(*argv) -> Config:
    parser, _ = build_parser()
    args = parser.parse_args(["train", *map(str, argv)])
    return load_config(args.config, overrides_from_args(args))


def refusal(capsys, *argv) -> str:
    code, out, err = run_main(capsys, "train", *argv, "--print-config")
    assert code == 2 and out == "" and err.count("\n") == 1, (argv, code, out, err)
    assert err.startswith("lockstep train: error: "), err
    return err.removeprefix("lockstep train: error: ").rstrip("\n")


def test_the_team_command_resolves(data):
    cfg = resolve(*team_flags(data))
    t, m, d, o, c = cfg.train, cfg.model, cfg.data, cfg.optim, cfg.checkpoint
    # global = world x 2 x 1
    assert (t.micro_batch_size, t.batch_size, t.grad_accum) == (2, None, None)
    assert (t.epochs, t.max_steps) == (3.0, None)
    assert (c.save_interval, c.output_dir) == (5000, "./output_expmt_v1")
    assert (t.eval_interval, d.eval_fraction) == (0, 0.0)
    assert (t.mixed_precision, m.use_lora, o.warmup_steps, o.learning_rate, t.log_interval) == (
        "bf16",
        True,
        500,
        5e-5,
        50,
    )
    assert (m.kind, m.path, m.audio_tokenizer_path) == (
        "hf",
        "bosonai/higgs-audio-v2-generation-3B-base",
        "bosonai/higgs-audio-v2-tokenizer",
    )
    assert (d.kind, d.path) == ("chatml", str(data))


def test_print_config_in_a_real_process(data):
    printed = yaml.safe_load(run_lockstep("train", *team_flags(data), "--print-config").stdout)
    assert printed["train"]["micro_batch_size"] == 2 and printed["train"]["batch_size"] is None
    assert printed["train"]["epochs"] == 3.0 and printed["train"]["max_steps"] is None
    assert printed["data"]["kind"] == "chatml" and printed["model"]["use_lora"] is True
    assert (
        printed["checkpoint"]["save_interval"] == 5000 and printed["data"]["eval_fraction"] == 0.0
    )


def test_dashed_spellings_mean_the_same(data):
    dashed = [f.replace("_", "-") if f.startswith("--") else f for f in team_flags(data)]
    assert "--per-device-train-batch-size" in dashed and "--num-train-epochs" in dashed
    assert config_to_dict(resolve(*dashed)) == config_to_dict(resolve(*team_flags(data)))


def test_every_alias_sets_its_key():
    special = {
        "model.dtype": "bfloat16",
        "distributed.backend": "gloo",
        "distributed.timeout_seconds": "900",
        "model.lora_target_modules": "q_proj,v_proj",
        "data.num_workers": "3",
        "optim.warmup_ratio": "0.1",
    }
    for name, (key, _, _) in KEYS.items():
        section, field = key.split(".")
        default = getattr(getattr(Config(), section), field)
        raw = special.get(key) or (
            "0.5" if isinstance(default, float) else "x" if isinstance(default, str) else "7"
        )
        assert config_to_dict(resolve(f"--{name}", raw)) == config_to_dict(
            resolve("--set", f"{key}={raw}")
        ), name
        assert config_to_dict(resolve(f"--{name}", raw)) != config_to_dict(Config()), name


def test_hf_boolean_values():
    assert resolve("--bf16", "True").train.mixed_precision == "bf16"
    # HF: neither bf16 nor fp16 = fp32
    assert resolve("--bf16", "False").train.mixed_precision == "no"
    assert resolve("--bf16", "false", "--fp16", "true").train.mixed_precision == "fp16"
    assert resolve("--model_path", "m", "--use_lora", "false").model.use_lora is False
    assert resolve("--gradient_checkpointing").model.gradient_checkpointing is True
    assert (
        resolve("--disable_evaluation", "false").train.eval_interval == Config().train.eval_interval
    )
    assert resolve("--do_eval", "False").data.eval_fraction == 0.0  # HF scripts: no eval dataset
    assert resolve("--do_train", "--do_eval").train.eval_interval == Config().train.eval_interval
    assert (
        resolve("--ddp_find_unused_parameters", "False").parallel.find_unused_parameters == "false"
    )
    assert resolve("--ddp_broadcast_buffers", "false").parallel.broadcast_buffers is False
    assert resolve("--ddp_broadcast_buffers", "True").parallel.broadcast_buffers is True
    assert resolve("--use_cpu").distributed.device == "cpu"


def test_steps_epochs_and_resume():
    # HF: max_steps > 0 overrides the epochs
    cfg = resolve("--num_train_epochs", "2", "--max_steps", "100")
    assert (cfg.train.epochs, cfg.train.max_steps) == (None, 100)
    # -1: HF's "train num_train_epochs"
    cfg = resolve("--num_train_epochs", "2", "--max_steps", "-1")
    assert (cfg.train.epochs, cfg.train.max_steps) == (2.0, None)
    assert resolve("--resume_from_checkpoint", "true").checkpoint.resume == "auto"
    assert resolve("--overwrite_output_dir").checkpoint.resume == "none"
    # HF's cosine decays to 0
    assert resolve("--lr_scheduler_type", "cosine").optim.min_lr_ratio == 0.0
    cfg = resolve(
        "--optim",
        "adamw_torch",
        "--report_to",
        "tensorboard",
        "--save_strategy",
        "steps",
        "--eval_strategy",
        "steps",
        "--local-rank=3",
        "--local_rank",
        "0",
    )
    assert config_to_dict(cfg) == config_to_dict(Config())  # accepted, nothing to change
    assert resolve("--report_to", "mlflow", "wandb").train.report_to == "mlflow,wandb"
    assert resolve("--report_to", "all").train.report_to == "tensorboard,mlflow,wandb"
    assert resolve("--report_to", "none").train.report_to == "none"


def test_chatml_is_inferred_for_json_files_and_folders(tmp_path):
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "a.jsonl").write_text("")
    for path, kinds in [
        (tmp_path / "chats", ["chatml"]),
        ("x.jsonl", ["chatml"]),
        ("corpus.txt", []),
    ]:
        settings = [s for _, s in hf_settings({"train_data_file": str(path)})]
        assert [s.value for s in settings if s.key == "data.kind"] == kinds, path


def test_implied_keys_give_way(tmp_path, data):
    # the global batch, given
    cfg = resolve("--per_device_train_batch_size", "2", "--global-batch-size", "32")
    assert (cfg.train.batch_size, cfg.train.micro_batch_size) == (32, 2)
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {kind: hf, path: m}\ndata: {kind: audio}\ntrain: {batch_size: 64}\n"
        "optim: {min_lr_ratio: 0.05}\n"
    )
    cfg = resolve(
        "--config",
        config,
        "--train_data_file",
        tmp_path / "manifest.jsonl",
        "--lr_scheduler_type",
        "cosine",
        "--per_device_train_batch_size",
        "2",
    )
    assert cfg.data.kind == "audio" and cfg.optim.min_lr_ratio == 0.05  # the file's keys stay
    # HF meaning: the per-device batch decides, as lockstep's --epochs does
    assert cfg.train.batch_size is None


def test_conflicts_name_both_flags(capsys):
    assert refusal(capsys, "--per_device_train_batch_size", "2", "--micro-batch-size", "4") == (
        "--micro-batch-size 4 and --per_device_train_batch_size 2 give train.micro_batch_size different values "
        "('4' and '2'); both name the same setting: pass one of them"
    )
    assert refusal(
        capsys, "--set", "train.grad_accum=1", "--gradient_accumulation_steps", "2"
    ).startswith(
        "--set train.grad_accum=1 and --gradient_accumulation_steps 2 give train.grad_accum different values"
    )
    assert refusal(capsys, "--disable_evaluation", "--eval_steps", "100").startswith(
        "--eval_steps 100 and --disable_evaluation give train.eval_interval different values"
    )
    assert refusal(capsys, "--lora_rank", "16", "--lora_r", "8").startswith(
        "--lora_rank 16 and --lora_r 8 give"
    )
    assert refusal(capsys, "--bf16", "--mixed-precision", "no").startswith(
        "--mixed-precision no and --bf16 give train.mixed_precision different values"
    )
    assert refusal(capsys, "--bf16", "--fp16") == (
        "--bf16 --fp16: both are true, and a run autocasts to one of them; pass --bf16 or --fp16"
    )
    assert (
        resolve("--learning_rate", "5e-5", "--learning-rate", "0.00005").optim.learning_rate == 5e-5
    )  # one value


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--deepspeed", "ds.json"],
            "--deepspeed ds.json: not supported: lockstep has no DeepSpeed integration; "
            "to shard parameters, gradients and optimizer state it uses FSDP2: "
            "--set parallel.data_parallel=fsdp",
        ),
        (
            ["--fsdp", "full_shard auto_wrap"],
            "--fsdp full_shard auto_wrap: not supported: lockstep's FSDP is FSDP2",
        ),
        (
            ["--report_to", "comet_ml"],
            "--report_to comet_ml: comet_ml is not supported; lockstep reports to tensorboard, "
            "mlflow and wandb",
        ),
        (
            ["--report_to", "tensorboard", "clearml"],
            "--report_to tensorboard clearml: clearml is not supported",
        ),
        (
            ["--push_to_hub"],
            "--push_to_hub: not supported: lockstep does not upload to the Hugging Face Hub",
        ),
        (["--optim", "adafactor"], "--optim adafactor: lockstep trains with torch.optim.AdamW"),
        (
            ["--lr_scheduler_type", "polynomial"],
            "--lr_scheduler_type polynomial: lockstep runs HF's linear, cosine, constant, "
            "constant_with_warmup, cosine_with_min_lr (linear warmup, then optim.schedule cosine, linear or constant down to "
            "optim.min_lr_ratio x the peak); pass one of those, or drop it (cosine to 0.1 x the peak)",
        ),
        (
            ["--lr_scheduler_type", "warmup_stable_decay"],
            "--lr_scheduler_type warmup_stable_decay: lockstep runs HF's",
        ),
        (
            ["--warmup_steps", "2.5"],
            "--warmup_steps 2.5: must be a whole number of optimizer steps (>= 0) or, as in transformers "
            "5, a share of the run's steps below 1; pass e.g. --warmup_steps 500 or --warmup_steps 0.1",
        ),
        (
            ["--warmup_steps", "ten"],
            "--warmup_steps ten: must be a whole number of optimizer steps",
        ),
        (
            ["--lr_scheduler_type", "constant", "--warmup_steps", "10"],
            "--lr_scheduler_type constant with --warmup_steps 10: HF's constant schedule has no warmup; "
            "for a warmup then a constant learning rate pass --lr_scheduler_type constant_with_warmup",
        ),
        (
            ["--lr_scheduler_type", "constant", "--warmup-ratio", "0.1"],
            "--lr_scheduler_type constant with optim.warmup_ratio = 0.1: HF's constant schedule has no "
            "warmup",
        ),
        (
            ["--lr_scheduler_type", "cosine_with_min_lr"],
            "--lr_scheduler_type cosine_with_min_lr --lr_scheduler_kwargs (none): neither min_lr nor "
            "min_lr_rate given; lockstep reads exactly one of min_lr_rate and min_lr, as HF; pass --lr_scheduler_kwargs "
            "'{\"min_lr_rate\": 0.1}' (the floor as a share of the peak) or '{\"min_lr\": 1e-5}' with "
            "--learning_rate",
        ),
        (
            [
                "--lr_scheduler_type",
                "cosine_with_min_lr",
                "--lr_scheduler_kwargs",
                '{"min_lr": 1e-5, "min_lr_rate": 0.1}',
            ],
            '--lr_scheduler_type cosine_with_min_lr --lr_scheduler_kwargs {"min_lr": 1e-5, '
            '"min_lr_rate": 0.1}: both min_lr and min_lr_rate given',
        ),
        (
            [
                "--lr_scheduler_type",
                "cosine_with_min_lr",
                "--lr_scheduler_kwargs",
                '{"num_cycles": 1}',
            ],
            '--lr_scheduler_type cosine_with_min_lr --lr_scheduler_kwargs {"num_cycles": 1}: num_cycles '
            "is not read",
        ),
        (
            [
                "--lr_scheduler_type",
                "cosine_with_min_lr",
                "--lr_scheduler_kwargs",
                '{"min_lr": 1e-5}',
            ],
            '--lr_scheduler_kwargs {"min_lr": 1e-5}: min_lr is converted to optim.min_lr_ratio with the '
            "learning rate, and this command sets none; pass --learning_rate LR too, or give min_lr_rate",
        ),
        (
            ["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}'],
            '--lr_scheduler_kwargs {"min_lr_rate": 0.1}: lockstep reads it only with '
            "--lr_scheduler_type cosine_with_min_lr",
        ),
        (
            ["--dataloader_pin_memory", "false"],
            "--dataloader_pin_memory false: not supported: lockstep pins the host memory of its batches "
            "when it trains on CUDA (on CPU there is no copy to speed up). Drop it (lockstep accepts "
            "only --dataloader_pin_memory true, what it does anyway)",
        ),
        (
            ["--logging_first_step"],
            "--logging_first_step true: not supported: lockstep logs every "
            "--logging_steps steps and at the last step; --logging_steps 1 logs "
            "every step",
        ),
        (["--log_level", "debug"], "--log_level debug: not supported: lockstep logs at INFO"),
        (
            ["--include_num_input_tokens_seen", "all"],
            "--include_num_input_tokens_seen all: not supported: lockstep logs tokens_per_s",
        ),
        (
            ["--eval_data_file", "eval.json"],
            "--eval_data_file eval.json: not supported: lockstep evaluates on a held-out",
        ),
        (
            ["--validation_file", "eval.json"],
            "--validation_file eval.json: not supported: lockstep evaluates on",
        ),
        (
            ["--per_device_eval_batch_size", "4", "--per_device_train_batch_size", "2"],
            "--per_device_eval_batch_size 4: lockstep evaluates with the training micro-batch",
        ),
        (
            ["--save_strategy", "epoch"],
            "--save_strategy epoch: lockstep commits a checkpoint every N steps",
        ),
        (
            ["--eval_strategy", "epoch"],
            "--eval_strategy epoch: lockstep evaluates every train.eval_interval steps",
        ),
        (["--do_train", "false"], "--do_train false: lockstep train always trains; drop it"),
        (
            ["--bf16", "maybe"],
            "--bf16 'maybe' is not true or false; pass --bf16 alone (true), or --bf16 false",
        ),
        (
            ["--max_steps", "0"],
            "--max_steps 0: must be a positive number of optimizer steps, or -1",
        ),
        (
            ["--label_smoothing_factor", "0.1"],
            "--label_smoothing_factor 0.1: an HF TrainingArguments name lockstep has "
            "no equivalent for; drop it.",
        ),
    ],
)
def test_unsupported_names_say_why_before_training(capsys, argv, message):
    assert refusal(capsys, *argv).startswith(message)


def test_unknown_flags_still_fail_as_before(capsys):
    assert run_main(capsys, "train", "--foo_bar", "3") == (
        2,
        "",
        "lockstep train: error: unknown option '--foo_bar'; see `lockstep train --help`\n",
    )


def test_help_groups_the_names_with_their_meaning(capsys):
    code, out, _ = run_main(capsys, "train", "--help")
    text = " ".join(out.split())  # argparse wraps help lines
    assert code == 0 and "HF Trainer names:" in out
    assert (
        "--per_device_train_batch_size N, --per-device-train-batch-size N per-device micro-batch (HF Trainer "
        "meaning; sets train.micro_batch_size, global batch = world x this x accumulation" in text
    )
    assert "--global-batch-size N samples per optimizer step over all ranks together" in text
    assert "--bf16 [BOOL] bf16 autocast (sets train.mixed_precision=bf16" in text
    for name, (key, _, _) in KEYS.items():
        assert f"--{name}" in out and key in out, name
    # named in the description only
    assert "--deepspeed" in text and "--deepspeed DEEPSPEED" not in text
    # lockstep's --seed already means HF's seed: not registered twice (Lightning's
    # --seed_everything may be)
    assert "--seed N seeds init, data order and every rank's RNG (sets train.seed)" not in text


def test_slurm_renders_the_team_job_for_2_nodes_of_8_gpus(data, tmp_path, capsys):
    code, out, err = run_main(
        capsys,
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--log-dir",
        tmp_path / "logs",
        *team_flags(data),
        "--dry-run",
    )
    assert code == 0 and err == "", err
    assert (
        "#SBATCH --nodes=2" in out
        and "#SBATCH --gpus-per-node=8" in out
        and "--nproc-per-node 8" in out
    )
    worker = shlex.split(out.rstrip().splitlines()[-1].split("lockstep-task ", 1)[1])
    assert worker[:3] == ["-m", "lockstep", "train"] and "--config" not in worker
    sets = dict(worker[i + 1].split("=", 1) for i, a in enumerate(worker) if a == "--set")
    assert {
        "train.micro_batch_size": "2",
        "train.batch_size": "none",
        "train.epochs": "3",
        "train.max_steps": "none",
        "checkpoint.save_interval": "5000",
        "train.eval_interval": "0",
        "data.eval_fraction": "0",
        "train.mixed_precision": "bf16",
        "model.use_lora": "true",
        "model.kind": "hf",
        "data.kind": "chatml",
        "model.audio_tokenizer_path": "bosonai/higgs-audio-v2-tokenizer",
    }.items() <= sets.items()
    # every worker reads back the config `lockstep train` resolves from the team's own flags
    assert config_to_dict(resolve(*worker[3:])) == config_to_dict(resolve(*team_flags(data)))


def test_slurm_with_a_config_file_and_a_refused_name(data, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("train: {grad_accum: 2}\n")
    code, out, _ = run_main(
        capsys,
        "slurm",
        config,
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        *team_flags(data),
        "--dry-run",
    )
    assert code == 0 and re.search(rf"train --config {re.escape(str(config))} --set ", out)
    code, out, err = run_main(
        capsys,
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        *team_flags(data),
        "--deepspeed",
        "ds.json",
        "--dry-run",
    )
    assert (code, out) == (2, "") and err.startswith(
        "lockstep slurm: error: --deepspeed ds.json: not supported"
    )


def test_refusals_come_before_any_other_rule():
    with pytest.raises(ConfigError, match="--push_to_hub true: not supported"):
        hf_settings({"max_steps": "0", "push_to_hub": ["true"]})


def test_hf_schedules_set_lockstep_schedules():
    def opt(*argv):
        o = resolve(*argv).optim
        return o.schedule, o.min_lr_ratio, o.warmup_steps, o.warmup_ratio

    kind = "--lr_scheduler_type"
    assert opt(kind, "linear") == ("linear", 0.0, 50, None)  # HF's linear decays to 0
    assert opt(kind, "cosine") == ("cosine", 0.0, 50, None)
    # the implied floor 0 gives way to an explicit one
    assert opt(kind, "linear", "--min-lr-ratio", "0.2") == ("linear", 0.2, 50, None)
    assert opt(kind, "constant") == ("constant", 0.1, 0, None)  # HF's constant: no warmup
    assert opt(kind, "constant", "--warmup_steps", "0") == ("constant", 0.1, 0, None)
    with_warmup = opt(kind, "constant_with_warmup", "--warmup_steps", "20")
    assert with_warmup == ("constant", 0.1, 20, None)
    kwargs = '{"min_lr_rate": 0.05}'
    assert opt(kind, "cosine_with_min_lr", "--lr_scheduler_kwargs", kwargs) == (
        "cosine",
        0.05,
        50,
        None,
    )
    # min_lr is an lr: over the learning rate it is the floor's share of the peak, as HF converts it
    for lr_flag in ("--learning_rate", "--learning-rate"):
        o = resolve(
            kind, "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr": 1e-5}', lr_flag, "1e-4"
        ).optim
        assert (o.schedule, o.learning_rate) == ("cosine", 1e-4)
        assert o.min_lr_ratio == pytest.approx(0.1)
    assert opt("--lr-schedule", "linear", kind, "linear") == ("linear", 0.0, 50, None)


def test_warmup_steps_below_one_is_a_ratio_as_in_transformers_5():
    o = resolve("--warmup_steps", "0.1").optim
    assert (o.warmup_ratio, o.warmup_steps) == (0.1, 50)  # 50: the default, unused (lockstep.optim)
    assert resolve("--warmup_steps", "500").optim.warmup_steps == 500
    assert resolve("--warmup_steps", "500.0").optim.warmup_steps == 500
    o = resolve("--warmup_steps", "0").optim
    assert (o.warmup_steps, o.warmup_ratio) == (0, None)
    assert resolve("--warmup_ratio", "0.03").optim.warmup_ratio == 0.03  # transformers 4's name
    with pytest.raises(ConfigError, match="both set the warmup"):
        resolve("--warmup_steps", "0.1", "--warmup-steps", "10")


def test_hf_defaults_lockstep_honours_are_no_ops():
    cfg = resolve(
        "--dataloader_pin_memory",
        "true",
        "--dataloader_drop_last",
        "--dataloader_persistent_workers",
        "True",
        "--remove_unused_columns",
        "--save_safetensors",
        "true",
        "--logging_first_step",
        "false",
        "--log_level",
        "passive",
        "--disable_tqdm",
        "false",
        "--include_num_input_tokens_seen",
        "no",
    )
    assert config_to_dict(cfg) == config_to_dict(Config())
    cfg = resolve("--log-level", "info", "--dataloader-pin-memory")
    assert config_to_dict(cfg) == config_to_dict(Config())
