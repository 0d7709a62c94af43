"""The flags of `lockstep train`, which `plan`, `check` and `parity` take as they are and `launch`
and `slurm` in part: lockstep's own (one argument group per config section in --help), the HF
Trainer and Lightning names (lockstep/cli/hf_args.py, lightning_args.py) and TRL's 4-bit one, and
the overrides they make (`overrides_from_args`); a flag registered as refused is answered in one
line (`refusal`): the value received, why, and the flag to use.
"""

from __future__ import annotations

import argparse

from lockstep.cli.flag_help import flag_help, flag_metavar
from lockstep.cli.hf_args import DEST, add_hf_arguments, merge_hf_names
from lockstep.cli.launch_options import add_launch_options
from lockstep.cli.lightning_args import add_lightning_arguments, merge_lightning_names
from lockstep.config import DistributedConfig, Overrides, parse_sets
from lockstep.config.overrides import QLORA_SUPPORT
from lockstep.errors import ConfigError
from lockstep.runtime import read_launch_env

# flag -> dotted config key; the GPT team's flag names, then what a trainer needs
FLAGS = {
    "--world-size": "distributed.world_size",
    "--rank": "distributed.rank",
    "--master-addr": "distributed.master_addr",
    "--master-port": "distributed.master_port",
    "--backend": "distributed.backend",
    "--device": "distributed.device",
    "--vocab-size": "model.vocab_size",
    "--hidden-size": "model.hidden_size",
    "--attention-heads": "model.attention_heads",
    "--layers": "model.layers",
    "--max-seq-length": "model.max_seq_length",
    "--dropout": "model.dropout",
    "--learning-rate": "optim.learning_rate",
    "--warmup-steps": "optim.warmup_steps",
    "--gradient-clip-norm": "optim.gradient_clip_norm",
    "--weight-decay": "optim.weight_decay",
    "--lr-scaling": "optim.lr_scaling",
    "--lr-schedule": "optim.schedule",
    "--warmup-ratio": "optim.warmup_ratio",
    "--min-lr-ratio": "optim.min_lr_ratio",
    "--global-batch-size": "train.batch_size",
    "--micro-batch-size": "train.micro_batch_size",
    "--grad-accum": "train.grad_accum",
    "--epochs": "train.epochs",
    "--max-steps": "train.max_steps",
    "--eval-interval": "train.eval_interval",
    "--log-interval": "train.log_interval",
    "--seed": "train.seed",
    "--profile-steps": "train.profile_steps",
    "--peak-flops": "train.peak_flops",
    "--save-interval": "checkpoint.save_interval",
    "--keep-last": "checkpoint.keep_last",
    "--output-dir": "checkpoint.output_dir",
    "--resume": "checkpoint.resume",
    "--data": "data.path",
    "--tokenizer": "data.tokenizer",
    "--num-workers": "data.num_workers",
    "--data-kind": "data.kind",
    "--max-files": "data.max_files",
    "--eval-fraction": "data.eval_fraction",
    "--model-kind": "model.kind",
    "--model": "model.path",
    "--task": "model.task",
    "--lora-rank": "model.lora_rank",
    "--grad-compression": "parallel.grad_compression",
}
SWITCHES = {
    "--no-nccl": "distributed.no_nccl",
    "--use-gradient-checkpointing": "model.gradient_checkpointing",
    "--use-lora": "model.use_lora",
    "--check-grads": "parallel.check_grads",
    "--compile": "train.compile",
    "--load-in-4bit": "model.load_in_4bit",
}
FLAG_OF = {
    key: flag
    for flag, key in [
        *FLAGS.items(),
        *SWITCHES.items(),
        ("--mixed-precision", "train.mixed_precision"),
    ]
}
# config section -> the one line under its header in --help
SECTIONS = {
    "distributed": "processes, ranks and the rendezvous: how many workers start and how they meet",
    "model": "which model and its shape; Hugging Face models, LoRA and 4-bit QLoRA",
    "data": "what the model trains on, how it is read, and the share held out for evaluation",
    "optim": "AdamW and the learning-rate schedule",
    "train": "batch sizes, how long to train, evaluation, logging and precision",
    "checkpoint": "the run directory: checkpoints, how many are kept, and where a run resumes from",
    "parallel": "how the model is spread over ranks: DDP or FSDP, gradient compression",
}
# HF Trainer's per-device batch under a lockstep name (cli/hf_args.py)
PER_DEVICE = "--per-device-batch-size"
# TRL's quantization flags other than --load_in_4bit: answered with what lockstep supports (refusal)
TRL_QUANTIZATION = (
    "load_in_8bit",
    "bnb_4bit_quant_type",
    "use_bnb_nested_quant",
    "quantization_config",
)
# global in lockstep before, per device in HF Trainer and the GPT team's CLI: refused
AMBIGUOUS = "--batch-size"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML", help="config file; flags below override it")
    add_config_flags(p)
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config key, e.g. --set data.max_bytes=1000000",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    # --max-restarts of the local workers (`lockstep launch` has the multi-node flags)
    add_launch_options(p)
    # set by lockstep's own launcher on its workers: it reports how the run stopped, they need not
    p.add_argument("--launched-by-lockstep", action="store_true", help=argparse.SUPPRESS)


def add_config_flags(p: argparse.ArgumentParser, heading: str = "") -> None:
    """The flags that set config keys: lockstep's in one argument group per config section
    (titled "model", or "model (HEADING)"), then the HF Trainer and Lightning names, each in its
    own group."""
    groups = {
        section: p.add_argument_group(f"{section} ({heading})" if heading else section, text)
        for section, text in SECTIONS.items()
    }
    for flag, key in FLAGS.items():
        g = groups[key.split(".")[0]]
        # values stay strings here: the config layer coerces and names the rule when one is wrong
        g.add_argument(flag, dest=key, metavar=flag_metavar(key), help=flag_help(flag, key))
        if flag == "--micro-batch-size":
            g.add_argument(
                PER_DEVICE,
                dest=DEST + "per_device_batch_size",
                metavar="N",
                help="samples per device per forward, the HF Trainer way (its "
                "--per_device_train_batch_size): the global batch follows the world, ranks x N x "
                "accumulation, unless "
                "--global-batch-size is given (train.micro_batch_size, and train.batch_size=none)",
            )
            g.add_argument(
                AMBIGUOUS,
                "--batch_size",
                dest="refused:batch_size",
                metavar="N",
                help="refused as ambiguous (global in lockstep's config, per device in HF Trainer "
                "and many CLIs): pass --global-batch-size N or --per-device-batch-size N",
            )
    groups["train"].add_argument(
        "--mixed-precision",
        dest="train.mixed_precision",
        nargs="?",
        const="bf16",
        metavar="{auto,no,bf16,fp16}",
        help=flag_help("--mixed-precision", "train.mixed_precision") + "; the bare flag means bf16",
    )
    for flag, key in SWITCHES.items():
        groups[key.split(".")[0]].add_argument(
            flag, dest=key, action="store_const", const=True, help=flag_help(flag, key)
        )
    groups["model"].add_argument(
        "--load_in_4bit",
        dest="model.load_in_4bit",
        nargs="?",
        const=True,
        metavar="BOOL",
        help="TRL's name of --load-in-4bit (same meaning)",
    )
    for name in TRL_QUANTIZATION:  # hidden from --help and "did you mean"; refusal() answers them
        spellings = (f"--{name}", f"--{name.replace('_', '-')}")
        groups["model"].add_argument(
            *spellings, dest=f"refused:{name}", nargs="*", help=argparse.SUPPRESS
        )
    add_hf_arguments(p)
    add_lightning_arguments(p)  # after the HF names: --max_steps stays HF's (the same meaning)


def overrides_from_args(args: argparse.Namespace) -> Overrides:
    """Dotted key -> value from the flags, --set and the HF names; `.labels` says which flag set
    each."""
    for dest, value in vars(args).items():
        if dest.startswith("refused:") and value is not None:
            raise ConfigError(refusal(dest.removeprefix("refused:"), value))
    out = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    sources = {
        k: f"{FLAG_OF.get(k, k)} {v}" if v is not True else FLAG_OF.get(k, k)
        for k, v in out.items()
    }
    sets = parse_sets(args.sets)
    out.update(sets)
    sources.update(sets.labels)
    out = merge_hf_names(args, out, sources)  # HF Trainer names: the same key twice must agree
    # Lightning names; --devices and --num_nodes are checked against what a launcher started
    out = merge_lightning_names(args, out, sources, read_launch_env(DistributedConfig()))
    if "train.epochs" in out and "train.max_steps" not in out:
        out["train.max_steps"] = None  # --epochs alone means "train for that many epochs"
        sources["train.max_steps"] = f"{sources['train.epochs']} (without --max-steps)"
    return Overrides(out, sources)


def refusal(name: str, value: str | list[str]) -> str:
    """The one line for a flag registered as refused (dest `refused:NAME`)."""
    if name == "batch_size":
        return ambiguous_batch_size(value)
    received = " ".join([f"--{name}", *value])
    if name == "load_in_8bit":
        return f"{received}: not supported: lockstep has no 8-bit base; {QLORA_SUPPORT}"
    return (
        f"{received}: lockstep's 4-bit recipe is fixed (NF4, double quantization, bf16 "
        f"compute), so it takes no setting; drop it. {QLORA_SUPPORT}"
    )


def ambiguous_batch_size(value: str) -> str:
    return (
        f"{AMBIGUOUS} {value} is ambiguous, so lockstep refuses it: lockstep's config means the "
        "global batch (samples per optimizer step over all ranks, train.batch_size), HF Trainer "
        "and the GPT team's old CLI a batch per device, and reading one as the other trains with "
        f"a batch world-size times too small or too large. Pass --global-batch-size {value} "
        f"({value} samples per step in all; each device's micro-batch and the accumulation are "
        f"derived) or {PER_DEVICE} {value} ({value} per device per forward; global batch = ranks "
        f"x {value} x accumulation). The YAML key train.batch_size keeps its meaning: the global "
        "batch"
    )
