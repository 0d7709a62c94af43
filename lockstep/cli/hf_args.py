"""Hugging Face Trainer names for `lockstep train` (and slurm, check, parity): TrainingArguments flags as aliases.

A job written for transformers' Trainer runs as `torchrun ... -m lockstep train <its flags>`. Each HF name means
what it means in HF Trainer and sets the config keys its --help names (`--print-config` shows the result); both
spellings work (--per_device_train_batch_size, --per-device-train-batch-size). A TrainingArguments name lockstep has
no equivalent for (--deepspeed, --report_to comet_ml, --push_to_hub, ...) stops the command before training, saying
why and what to use instead. Values stay strings: the config layer coerces them and names the rule a bad one breaks.

Precedence: a key that an HF name and a lockstep flag (or --set, or another HF name) both set must get one value,
or the command stops naming both. Keys an HF name only implies (the per-device batch implies
train.batch_size = none) give way to any flag that sets them; the ones marked "all" also to the config file.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import yaml

from lockstep.cli.hf_defaults import NOOPS
from lockstep.cli.hf_refused import OTHER, REFUSED
from lockstep.cli.hf_values import (
    SCHEDULES,
    Setting,
    check_noop,
    precision,
    special,
    switch,
    to_bool,
)
from lockstep.config import Config, apply_overrides
from lockstep.errors import ConfigError

GROUP = "HF Trainer names"
DEST = "hf:"  # argparse dest prefix: no dot, so train's dotted-key overrides never pick these up


# HF name -> (the one config key it sets to the value as given, metavar, what it means)
KEYS = {
    "output_dir": (
        "checkpoint.output_dir",
        "DIR",
        "run directory: checkpoints, logs, metrics.jsonl, tensorboard/",
    ),
    "save_steps": (
        "checkpoint.save_interval",
        "N",
        "commit a checkpoint every N steps (0 = only at the end)",
    ),
    "save_total_limit": (
        "checkpoint.keep_last",
        "N",
        "committed checkpoints kept; older ones are deleted",
    ),
    "eval_steps": ("train.eval_interval", "N", "evaluate every N steps"),
    "gradient_accumulation_steps": ("train.grad_accum", "N", "micro-batches per optimizer step"),
    "learning_rate": ("optim.learning_rate", "LR", "peak learning rate of AdamW"),
    "warmup_ratio": (
        "optim.warmup_ratio",
        "R",
        "warmup as a share of the run's steps, rounded up (transformers 4; in 5: --warmup_steps R)",
    ),
    "weight_decay": (
        "optim.weight_decay",
        "WD",
        "AdamW weight decay (weight matrices and embeddings)",
    ),
    "adam_beta1": ("optim.beta1", "B1", "AdamW beta1"),
    "adam_beta2": ("optim.beta2", "B2", "AdamW beta2"),
    "adam_epsilon": ("optim.eps", "EPS", "AdamW epsilon"),
    "max_grad_norm": (
        "optim.gradient_clip_norm",
        "NORM",
        "clip the global gradient norm (0 = no clipping)",
    ),
    "seed": ("train.seed", "N", "seeds init, data order and every rank's RNG"),
    "logging_steps": ("train.log_interval", "N", "log metrics every N steps"),
    "dataloader_num_workers": ("data.num_workers", "N", "DataLoader worker processes per rank"),
    "dataloader_prefetch_factor": (
        "data.prefetch_factor",
        "N",
        "micro-batches each DataLoader worker keeps ready",
    ),
    "audio_tokenizer_path": (
        "model.audio_tokenizer_path",
        "PATH",
        "audio codec (Higgs Audio v2 tokenizer): local directory or hub id in the local cache",
    ),
    "torch_dtype": (
        "model.dtype",
        "DTYPE",
        "dtype the weights are loaded in: float32, bfloat16 or float16",
    ),
    "lora_rank": ("model.lora_rank", "R", "LoRA rank r"),
    "lora_r": ("model.lora_rank", "R", "LoRA rank r (peft's name)"),
    "lora_alpha": ("model.lora_alpha", "A", "LoRA alpha (the update is scaled by alpha / r)"),
    "lora_dropout": ("model.lora_dropout", "P", "dropout on the LoRA input"),
    "lora_target_modules": (
        "model.lora_target_modules",
        "NAMES",
        "comma-separated module names, or all-linear",
    ),
    "max_seq_length": ("model.max_seq_length", "N", "context length: tokens per training sequence"),
    "model_max_length": ("model.max_seq_length", "N", "context length, as --max_seq_length"),
    "ddp_timeout": ("distributed.timeout_seconds", "S", "collective timeout in seconds"),
    "ddp_backend": ("distributed.backend", "NAME", "process-group backend: nccl, gloo or mpi"),
    "ddp_bucket_cap_mb": ("parallel.bucket_cap_mb", "MB", "DDP gradient bucket size"),
}
# HF name -> (metavar, help) of the value flags with a rule of their own (hf_values.special)
SPECIAL = {
    "model_path": (
        "PATH",
        "Hugging Face model: a local directory or a hub id in the local cache "
        "(sets model.kind=hf and model.path)",
    ),
    "model_name_or_path": ("PATH", "as --model_path (the name HF's example scripts use)"),
    "train_data_file": (
        "PATH",
        "training data (sets data.path); a .json/.jsonl file, or a folder of them, is ChatML: "
        "data.kind=chatml unless data.kind is set",
    ),
    "train_file": ("PATH", "as --train_data_file (the name HF's example scripts use)"),
    "per_device_train_batch_size": (
        "N",
        "per-device micro-batch (HF Trainer meaning; sets train.micro_batch_size, "
        "global batch = world x this x accumulation: train.batch_size=none unless "
        "--global-batch-size is given)",
    ),
    "per_device_eval_batch_size": (
        "N",
        "accepted when equal to --per_device_train_batch_size: lockstep evaluates "
        "with the training micro-batch",
    ),
    "num_train_epochs": (
        "E",
        "passes over the data (sets train.epochs, and train.max_steps=none); with --max_steps "
        "> 0 HF ignores it, and so does lockstep",
    ),
    "max_steps": (
        "N",
        "optimizer steps (sets train.max_steps); -1, HF's default, means: train --num_train_epochs",
    ),
    "resume_from_checkpoint": (
        "PATH",
        "checkpoint or run directory to resume from; true = the newest in --output_dir "
        "(sets checkpoint.resume)",
    ),
    "lr_scheduler_type": (
        "NAME",
        f"{', '.join(SCHEDULES)}, as in HF (sets optim.schedule): linear "
        "and cosine decay to 0 (optim.min_lr_ratio=0 unless set), constant "
        "has no warmup (optim.warmup_steps=0), cosine_with_min_lr takes "
        "--lr_scheduler_kwargs; other schedules are refused",
    ),
    "lr_scheduler_kwargs": (
        "JSON",
        "with cosine_with_min_lr only: '{\"min_lr_rate\": R}' sets "
        "optim.min_lr_ratio=R, '{\"min_lr\": LR}' sets it to "
        "LR / --learning_rate",
    ),
    "warmup_steps": (
        "N",
        "linear warmup steps (sets optim.warmup_steps); below 1, as in "
        "transformers 5, a share of the run's steps, rounded up "
        "(sets optim.warmup_ratio)",
    ),
    "optim": (
        "adamw_torch",
        "adamw_torch or adamw_torch_fused: lockstep trains with torch.optim.AdamW "
        "(fused on GPU); other optimizers are refused",
    ),
    "report_to": (
        "NAME",
        "tensorboard, mlflow, wandb, all or none (sets train.report_to); OUTPUT_DIR/metrics.jsonl "
        "is always written; other trackers are refused",
    ),
    "ddp_find_unused_parameters": (
        "BOOL",
        "a step may leave parameters without a gradient (sets parallel.find_unused_parameters)",
    ),
    "ddp_static_graph": ("BOOL", "DDP static graph (sets parallel.static_graph)"),
    "ddp_broadcast_buffers": (
        "BOOL",
        "DDP sends rank 0's buffers to every rank before each forward "
        "(sets parallel.broadcast_buffers)",
    ),
    "eval_strategy": (
        "{steps,no}",
        "steps: evaluate every --eval_steps; no: as --disable_evaluation",
    ),
    "evaluation_strategy": ("{steps,no}", "older HF name of --eval_strategy"),
    "save_strategy": (
        "steps",
        "only steps: lockstep commits a checkpoint every --save_steps and at the end",
    ),
    "logging_strategy": ("steps", "only steps: lockstep logs every --logging_steps"),
    "local_rank": (
        "N",
        "ignored: older launchers (torch.distributed.launch) pass it; lockstep reads LOCAL_RANK "
        "from the environment",
    ),
}
# HF switches: bare = true, or an explicit value as HF accepts (--bf16, --bf16 true, --bf16 false)
SWITCHES = {
    "bf16": "bf16 autocast (sets train.mixed_precision=bf16; --bf16 false without --fp16 sets no)",
    "fp16": "fp16 autocast with a GradScaler, CUDA only (sets train.mixed_precision=fp16)",
    "use_lora": "train LoRA adapters (peft) instead of all weights (sets model.use_lora)",
    "gradient_checkpointing": "recompute activations in backward (sets model.gradient_checkpointing)",
    "torch_compile": "torch.compile the model (sets train.compile)",
    "disable_evaluation": "no evaluation and no held-out split (sets train.eval_interval=0 and data.eval_fraction=0)",
    "do_train": "accepted: lockstep train always trains (false is refused)",
    "do_eval": "accepted: lockstep evaluates every --eval_steps; false = as --disable_evaluation",
    "overwrite_output_dir": "do not resume from the checkpoints in --output_dir: start over (sets checkpoint.resume=none)",
    "use_cpu": "train on CPU (sets distributed.device=cpu)",
    "no_cuda": "older HF name of --use_cpu",
}


def add_hf_arguments(p: argparse.ArgumentParser) -> None:
    """The HF names as an argument group of `p`; a spelling `p` already has (--seed, --learning-rate) stays its own."""
    taken = {o for a in p._actions for o in a.option_strings}
    refused = ", ".join(f"--{n}" for n in list(REFUSED)[:8])
    g = p.add_argument_group(
        GROUP,
        (
            "Hugging Face TrainingArguments names, meaning what they mean in HF Trainer; each sets the config keys "
            "named (see --print-config). Both spellings work: --per_device_train_batch_size and "
            "--per-device-train-batch-size. Switches take an optional value: --bf16, --bf16 true, --bf16 false. "
            f"Refused before training, with the reason and the lockstep way: {refused}, "
            "--report_to comet_ml and other TrainingArguments names lockstep has no equivalent for."
        ),
    )

    def add(name: str, help: str, **kw) -> None:
        spellings = [
            s for s in dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"]) if s not in taken
        ]
        if spellings:
            g.add_argument(*spellings, dest=DEST + name, help=help, **kw)

    for name, (key, metavar, meaning) in KEYS.items():
        add(name, f"{meaning} (sets {key})", metavar=metavar)
    for name, (metavar, text) in SPECIAL.items():
        add(name, text, metavar=metavar, nargs="+" if name == "report_to" else None)
    for name, text in SWITCHES.items():
        add(name, text, metavar="BOOL", nargs="?", const="true")
    for name, (value, what) in NOOPS.items():  # HF defaults lockstep behaves as: no-ops
        shown = str(value).lower() if isinstance(value, bool) else " or ".join(value)
        metavar = "BOOL" if isinstance(value, bool) else "WORD"
        add(name, f"accepted as {shown}, a no-op: {what}", metavar=metavar, nargs="?", const="true")
    for name in [*REFUSED, *OTHER]:
        add(name, argparse.SUPPRESS, nargs="*")  # any values: the refusal, not argparse, answers


def merge_hf_names(
    args: argparse.Namespace, out: dict[str, object], sources: dict[str, str]
) -> dict[str, object]:
    """`out` (dotted key -> value, from lockstep's flags and --set; `sources` names the flag of each) with the HF
    names in `args` added; raises ConfigError for a refused name, or a key given two different values."""
    given = {
        k.removeprefix(DEST): v
        for k, v in vars(args).items()
        if k.startswith(DEST) and v is not None
    }
    if not given:
        return out
    return merge_settings(hf_settings(given, out), out, sources, lambda: _file_keys(args))


def merge_settings(
    settings: list[tuple[str, Setting]],
    out: dict[str, object],
    sources: dict[str, str],
    file_keys: Callable[[], set[str]] = set,
) -> dict[str, object]:
    """`out` with `settings` (HF's names, Lightning's: lockstep.cli.lightning_args) added; `sources` learns
    the flag behind each key. A key given two different values raises ConfigError naming both flags;
    implied values give way to any flag, and those implied "all" also to the config file (`file_keys()`)."""
    merged, implied = dict(out), []
    for label, s in settings:
        if s.implied:
            implied.append((label, s))
        elif s.key in merged and _value(s.key, merged[s.key]) != _value(s.key, s.value):
            raise ConfigError(
                f"{sources[s.key]} and {label} give {s.key} different values ({merged[s.key]!r} and {s.value!r}); "
                "both name the same setting: pass one of them"
            )
        else:
            merged[s.key], sources[s.key] = s.value, label
    in_file = file_keys() if any(s.implied == "all" for _, s in implied) else set()
    for label, s in implied:
        if s.key not in merged and not (s.implied == "all" and s.key in in_file):
            merged[s.key], sources[s.key] = s.value, label
    return merged


def hf_settings(
    given: dict[str, object], flags: dict[str, object] | None = None
) -> list[tuple[str, Setting]]:
    """(the flag as given, a key it sets) for each HF name in `given` (name -> raw value); refusals
    raise first. `flags`: the keys lockstep's own flags set, for the rules that read them (a
    warmup beside --lr_scheduler_type constant, the learning rate that converts a min_lr)."""
    for name, raw in given.items():
        if name in REFUSED or name in OTHER:
            raise ConfigError(_refusal(name, raw, given))
    out = []
    if "bf16" in given or "fp16" in given:
        label = " ".join(_label(n, given[n]) for n in ("bf16", "fp16") if n in given)
        out.append((label, precision(given, label)))
    for name, raw in given.items():
        label = _label(name, raw)
        if name in KEYS:
            out.append((label, Setting(KEYS[name][0], raw)))
        elif name in SWITCHES:
            out += [(label, s) for s in switch(name, to_bool(name, raw))]
        elif name in NOOPS:
            check_noop(name, raw)
        else:
            raw = str(raw) if name != "report_to" else raw
            out += [(label, s) for s in special(name, raw, given, flags or {})]
    return out


def uses_hf_names(args: argparse.Namespace) -> bool:
    """Whether the command line holds an HF Trainer name (the start-up line of
    lockstep.cli.hf_defaults is then said)."""
    return any(k.startswith(DEST) and v is not None for k, v in vars(args).items())


def _refusal(name: str, raw, given: dict[str, object]) -> str:
    received = " ".join([f"--{name}", *map(str, raw)])
    if name in REFUSED:
        return f"{received}: not supported: {REFUSED[name]}"
    return (
        f"{received}: an HF TrainingArguments name lockstep has no equivalent for; drop it. The HF names lockstep "
        f"maps are listed under '{GROUP}' in `lockstep train --help`; any config key: --set KEY=VALUE "
        "(--print-config lists them)"
    )


def _label(name: str, raw) -> str:
    if name == "per_device_batch_size":  # lockstep's own spelling (cli/train_flags.py)
        return f"--per-device-batch-size {raw}"
    if name in SWITCHES:
        return f"--{name}" if raw == "true" else f"--{name} {raw}"
    return f"--{name} {' '.join(raw) if isinstance(raw, list) else raw}"


def _value(key: str, raw: object) -> object:
    """What the config layer makes of `raw` for `key`: '5e-5' and '0.00005' are one learning rate."""
    cfg = Config()
    apply_overrides(cfg, {key: raw}, "command line")
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _file_keys(args: argparse.Namespace) -> set[str]:
    """The dotted keys the config file sets; none when it cannot be read (load_config then says why)."""
    path = getattr(args, "config_file", None) or getattr(args, "config", None)
    try:
        tree = yaml.safe_load(Path(path).read_text()) if path else {}
    except (OSError, yaml.YAMLError):
        return set()
    if not isinstance(tree, dict):
        return set()
    return {
        f"{section}.{key}" for section, sub in tree.items() if isinstance(sub, dict) for key in sub
    }
