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
from pathlib import Path
from typing import NamedTuple

import yaml

from lockstep.cli.hf_refused import OTHER, REFUSED
from lockstep.config import Config, apply_overrides
from lockstep.errors import ConfigError

GROUP = "HF Trainer names"
DEST = "hf:"  # argparse dest prefix: no dot, so train's dotted-key overrides never pick these up


class Setting(NamedTuple):
    key: str  # dotted config key
    value: object  # the flag's value as given (a string), or what its HF meaning implies
    implied: str = ""  # "": the flag's own value; "flags": gives way to any flag setting key; "all": to the file too


# HF name -> (the one config key it sets to the value as given, metavar, what it means)
KEYS = {
    "output_dir": ("checkpoint.output_dir", "DIR", "run directory: checkpoints, logs, metrics.jsonl, tensorboard/"),
    "save_steps": ("checkpoint.save_interval", "N", "commit a checkpoint every N steps (0 = only at the end)"),
    "save_total_limit": ("checkpoint.keep_last", "N", "committed checkpoints kept; older ones are deleted"),
    "eval_steps": ("train.eval_interval", "N", "evaluate every N steps"),
    "gradient_accumulation_steps": ("train.grad_accum", "N", "micro-batches per optimizer step"),
    "learning_rate": ("optim.learning_rate", "LR", "peak learning rate of AdamW"),
    "warmup_steps": ("optim.warmup_steps", "N", "linear warmup steps"),
    "weight_decay": ("optim.weight_decay", "WD", "AdamW weight decay (weight matrices and embeddings)"),
    "adam_beta1": ("optim.beta1", "B1", "AdamW beta1"),
    "adam_beta2": ("optim.beta2", "B2", "AdamW beta2"),
    "adam_epsilon": ("optim.eps", "EPS", "AdamW epsilon"),
    "max_grad_norm": ("optim.gradient_clip_norm", "NORM", "clip the global gradient norm (0 = no clipping)"),
    "seed": ("train.seed", "N", "seeds init, data order and every rank's RNG"),
    "logging_steps": ("train.log_interval", "N", "log metrics every N steps"),
    "dataloader_num_workers": ("data.num_workers", "N", "DataLoader worker processes per rank"),
    "dataloader_prefetch_factor": ("data.prefetch_factor", "N", "micro-batches each DataLoader worker keeps ready"),
    "audio_tokenizer_path": ("model.audio_tokenizer_path", "PATH",
                             "audio codec (Higgs Audio v2 tokenizer): local directory or hub id in the local cache"),
    "torch_dtype": ("model.dtype", "DTYPE", "dtype the weights are loaded in: float32, bfloat16 or float16"),
    "lora_rank": ("model.lora_rank", "R", "LoRA rank r"),
    "lora_r": ("model.lora_rank", "R", "LoRA rank r (peft's name)"),
    "lora_alpha": ("model.lora_alpha", "A", "LoRA alpha (the update is scaled by alpha / r)"),
    "lora_dropout": ("model.lora_dropout", "P", "dropout on the LoRA input"),
    "lora_target_modules": ("model.lora_target_modules", "NAMES", "comma-separated module names, or all-linear"),
    "max_seq_length": ("model.max_seq_length", "N", "context length: tokens per training sequence"),
    "model_max_length": ("model.max_seq_length", "N", "context length, as --max_seq_length"),
    "ddp_timeout": ("distributed.timeout_seconds", "S", "collective timeout in seconds"),
    "ddp_backend": ("distributed.backend", "NAME", "process-group backend: nccl, gloo or mpi"),
    "ddp_bucket_cap_mb": ("parallel.bucket_cap_mb", "MB", "DDP gradient bucket size"),
}
# HF name -> (metavar, help) of the value flags with a rule of their own (_special)
SPECIAL = {
    "model_path": ("PATH", "Hugging Face model: a local directory or a hub id in the local cache "
                           "(sets model.kind=hf and model.path)"),
    "model_name_or_path": ("PATH", "as --model_path (the name HF's example scripts use)"),
    "train_data_file": ("PATH", "training data (sets data.path); a .json/.jsonl file, or a folder of them, is ChatML: "
                                "data.kind=chatml unless data.kind is set"),
    "train_file": ("PATH", "as --train_data_file (the name HF's example scripts use)"),
    "per_device_train_batch_size": ("N", "per-device micro-batch (HF Trainer meaning; sets train.micro_batch_size, "
                                         "global batch = world x this x accumulation: train.batch_size=none unless "
                                         "--global-batch-size is given)"),
    "per_device_eval_batch_size": ("N", "accepted when equal to --per_device_train_batch_size: lockstep evaluates "
                                        "with the training micro-batch"),
    "num_train_epochs": ("E", "passes over the data (sets train.epochs, and train.max_steps=none); with --max_steps "
                              "> 0 HF ignores it, and so does lockstep"),
    "max_steps": ("N", "optimizer steps (sets train.max_steps); -1, HF's default, means: train --num_train_epochs"),
    "resume_from_checkpoint": ("PATH", "checkpoint or run directory to resume from; true = the newest in --output_dir "
                                       "(sets checkpoint.resume)"),
    "lr_scheduler_type": ("cosine", "only cosine, lockstep's schedule: linear warmup, then cosine decay to 0 as in "
                                    "HF (sets optim.min_lr_ratio=0 unless set); other schedules are refused"),
    "optim": ("adamw_torch", "adamw_torch or adamw_torch_fused: lockstep trains with torch.optim.AdamW "
                             "(fused on GPU); other optimizers are refused"),
    "report_to": ("NAME", "tensorboard, mlflow, wandb, all or none (sets train.report_to); OUTPUT_DIR/metrics.jsonl "
                          "is always written; other trackers are refused"),
    "ddp_find_unused_parameters": ("BOOL", "a step may leave parameters without a gradient "
                                           "(sets parallel.find_unused_parameters)"),
    "ddp_static_graph": ("BOOL", "DDP static graph (sets parallel.static_graph)"),
    "ddp_broadcast_buffers": ("BOOL", "DDP sends rank 0's buffers to every rank before each forward "
                                      "(sets parallel.broadcast_buffers)"),
    "eval_strategy": ("{steps,no}", "steps: evaluate every --eval_steps; no: as --disable_evaluation"),
    "evaluation_strategy": ("{steps,no}", "older HF name of --eval_strategy"),
    "save_strategy": ("steps", "only steps: lockstep commits a checkpoint every --save_steps and at the end"),
    "logging_strategy": ("steps", "only steps: lockstep logs every --logging_steps"),
    "local_rank": ("N", "ignored: older launchers (torch.distributed.launch) pass it; lockstep reads LOCAL_RANK "
                        "from the environment"),
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
    g = p.add_argument_group(GROUP, (
        "Hugging Face TrainingArguments names, meaning what they mean in HF Trainer; each sets the config keys "
        "named (see --print-config). Both spellings work: --per_device_train_batch_size and "
        "--per-device-train-batch-size. Switches take an optional value: --bf16, --bf16 true, --bf16 false. "
        f"Refused before training, with the reason and the lockstep way: {refused}, --warmup_ratio, "
        "--report_to comet_ml and other TrainingArguments names lockstep has no equivalent for."))

    def add(name: str, help: str, **kw) -> None:
        spellings = [s for s in dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"]) if s not in taken]
        if spellings:
            g.add_argument(*spellings, dest=DEST + name, help=help, **kw)

    for name, (key, metavar, meaning) in KEYS.items():
        add(name, f"{meaning} (sets {key})", metavar=metavar)
    for name, (metavar, text) in SPECIAL.items():
        add(name, text, metavar=metavar, nargs="+" if name == "report_to" else None)
    for name, text in SWITCHES.items():
        add(name, text, metavar="BOOL", nargs="?", const="true")
    for name in [*REFUSED, *OTHER]:
        add(name, argparse.SUPPRESS, nargs="*")  # any values: the refusal, not argparse, answers


def merge_hf_names(args: argparse.Namespace, out: dict[str, object], sources: dict[str, str]) -> dict[str, object]:
    """`out` (dotted key -> value, from lockstep's flags and --set; `sources` names the flag of each) with the HF
    names in `args` added; raises ConfigError for a refused name, or a key given two different values."""
    given = {k.removeprefix(DEST): v for k, v in vars(args).items() if k.startswith(DEST) and v is not None}
    if not given:
        return out
    merged, labels, implied = dict(out), sources, []  # `sources` learns the flag behind each key it sets
    for label, s in hf_settings(given):
        if s.implied:
            implied.append((label, s))
        elif s.key in merged and _value(s.key, merged[s.key]) != _value(s.key, s.value):
            raise ConfigError(
                f"{labels[s.key]} and {label} give {s.key} different values ({merged[s.key]!r} and {s.value!r}); "
                "both name the same setting: pass one of them")
        else:
            merged[s.key], labels[s.key] = s.value, label
    in_file = _file_keys(args) if any(s.implied == "all" for _, s in implied) else set()
    for label, s in implied:
        if s.key not in merged and not (s.implied == "all" and s.key in in_file):
            merged[s.key], labels[s.key] = s.value, label
    return merged


def hf_settings(given: dict[str, object]) -> list[tuple[str, Setting]]:
    """(the flag as given, a key it sets) for each HF name in `given` (name -> raw value); refusals raise first."""
    for name, raw in given.items():
        if name in REFUSED or name in OTHER:
            raise ConfigError(_refusal(name, raw, given))
    out = []
    if "bf16" in given or "fp16" in given:
        out.append(_precision(given))
    for name, raw in given.items():
        label = _label(name, raw)
        if name in KEYS:
            out.append((label, Setting(KEYS[name][0], raw)))
        elif name in SWITCHES:
            out += [(label, s) for s in _switch(name, _bool(name, raw))]
        else:
            out += [(label, s) for s in _special(name, str(raw) if name != "report_to" else raw, given)]
    return out


def _special(name: str, raw, given: dict[str, object]) -> list[Setting]:
    flag = f"--{name} {raw}"
    match name:
        case "model_path" | "model_name_or_path":
            return [Setting("model.kind", "hf"), Setting("model.path", raw)]
        case "train_data_file" | "train_file":
            return [Setting("data.path", raw)] + [Setting("data.kind", "chatml", "all")] * _is_chatml(raw)
        case "per_device_train_batch_size" | "per_device_batch_size":  # the second: lockstep's --per-device-batch-size
            return [Setting("train.micro_batch_size", raw), Setting("train.batch_size", None, "flags")]
        case "per_device_eval_batch_size":
            train = given.get("per_device_train_batch_size", given.get("per_device_batch_size", ""))
            if raw.strip() != str(train).strip():
                raise ConfigError(f"{flag}: lockstep evaluates with the training micro-batch (train.micro_batch_size); "
                                  "drop it, or give it the value of --per_device_train_batch_size")
            return []
        case "num_train_epochs":
            if _max_steps(given) > 0:  # HF: a positive max_steps overrides num_train_epochs
                return [Setting("train.epochs", None, "flags")]
            return [Setting("train.epochs", raw), Setting("train.max_steps", None, "flags")]
        case "max_steps":
            steps = _max_steps(given)
            return [Setting("train.max_steps", raw)] if steps > 0 else [Setting("train.max_steps", None, "flags")]
        case "resume_from_checkpoint":
            word = raw.strip().lower()
            return [Setting("checkpoint.resume", "auto" if word == "true" else "none" if word == "false" else raw)]
        case "lr_scheduler_type":
            if raw != "cosine":
                raise ConfigError(
                    f"{flag}: lockstep's one schedule is linear warmup (optim.warmup_steps) then cosine decay to "
                    "optim.min_lr_ratio x the peak; pass --lr_scheduler_type cosine (decays to 0, as HF's cosine; "
                    "a floor: add --set optim.min_lr_ratio=R) or drop it (cosine to 0.1 x the peak)")
            return [Setting("optim.min_lr_ratio", "0", "all")]
        case "optim":
            if raw not in ("adamw_torch", "adamw_torch_fused"):
                raise ConfigError(f"{flag}: lockstep trains with torch.optim.AdamW (fused on GPU; settings "
                                  "optim.beta1, beta2, eps, weight_decay); pass --optim adamw_torch or drop it")
            return []
        case "report_to":
            names = ["tensorboard", "mlflow", "wandb"] if raw == ["all"] else list(raw)
            others = [v for v in names if v not in ("none", "tensorboard", "mlflow", "wandb")]
            if others:
                raise ConfigError(
                    f"--report_to {' '.join(raw)}: {', '.join(others)} is not supported; lockstep reports to tensorboard, "
                    "mlflow and wandb (and always to OUTPUT_DIR/metrics.jsonl): pick from those, or drop --report_to")
            return [Setting("train.report_to", ",".join(names))]
        case "ddp_find_unused_parameters" | "ddp_static_graph":
            key = "parallel.find_unused_parameters" if name == "ddp_find_unused_parameters" else "parallel.static_graph"
            return [Setting(key, str(_bool(name, raw)).lower())]
        case "ddp_broadcast_buffers":
            return [Setting("parallel.broadcast_buffers", _bool(name, raw))]
        case "eval_strategy" | "evaluation_strategy":
            if raw not in ("steps", "no"):
                raise ConfigError(f"{flag}: lockstep evaluates every train.eval_interval steps; "
                                  "pass --eval_strategy steps with --eval_steps N, or --eval_strategy no")
            return _switch("disable_evaluation", raw == "no")
        case "save_strategy" | "logging_strategy":
            if raw != "steps":
                what, steps = ("commits a checkpoint", "--save_steps N (0 = only at the end)") if name == "save_strategy" \
                    else ("logs", "--logging_steps N")
                raise ConfigError(f"{flag}: lockstep {what} every N steps and at the end; pass {steps} instead")
            return []
        case "local_rank":
            return []  # torchrun sets LOCAL_RANK; runtime reads it from the environment
    raise AssertionError(f"no rule for HF name {name!r}")


def _switch(name: str, on: bool) -> list[Setting]:
    match name:
        case "use_lora" | "gradient_checkpointing":
            return [Setting(f"model.{name}", on)]
        case "torch_compile":
            return [Setting("train.compile", on)]
        case "disable_evaluation" | "do_eval":
            if (name == "disable_evaluation") != on:  # --disable_evaluation false, --do_eval true: nothing changes
                return []
            return [Setting("train.eval_interval", "0"), Setting("data.eval_fraction", "0")]
        case "do_train":
            if not on:
                raise ConfigError("--do_train false: lockstep train always trains; drop it")
            return []
        case "overwrite_output_dir":
            return [Setting("checkpoint.resume", "none")] if on else []
        case "use_cpu" | "no_cuda":
            return [Setting("distributed.device", "cpu")] if on else []
        case "bf16" | "fp16":
            return []  # the two together: _precision
    raise AssertionError(f"no rule for HF switch {name!r}")


def _precision(given: dict[str, object]) -> tuple[str, Setting]:
    bf16, fp16 = (_bool(n, given[n]) if n in given else None for n in ("bf16", "fp16"))
    label = " ".join(_label(n, given[n]) for n in ("bf16", "fp16") if n in given)
    if bf16 and fp16:
        raise ConfigError(f"{label}: both are true, and a run autocasts to one of them; pass --bf16 or --fp16")
    return label, Setting("train.mixed_precision", "bf16" if bf16 else "fp16" if fp16 else "no")


def _max_steps(given: dict[str, object]) -> int:
    """--max_steps as a number; -1 (HF's default: train --num_train_epochs) when not given."""
    raw = str(given.get("max_steps", "-1"))
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if steps == 0 or steps < -1:
        raise ConfigError(f"--max_steps {raw}: must be a positive number of optimizer steps, or -1 (HF: train "
                          "--num_train_epochs instead); pass e.g. --max_steps 1000")
    return steps


def _refusal(name: str, raw, given: dict[str, object]) -> str:
    received = " ".join([f"--{name}", *map(str, raw)])
    if name == "warmup_ratio":
        ratio = " ".join(map(str, raw)) or "R"
        n = f"{ratio} x the run's optimizer steps"
        try:
            if _max_steps(given) > 0:
                n = f"{ratio} x --max_steps {given['max_steps']} = {round(float(ratio) * _max_steps(given))}"
        except ValueError:
            pass  # not a number: the formula stays
        return (f"{received}: not supported: lockstep warms up over a number of optimizer steps (optim.warmup_steps), "
                f"not a share of the run; pass --warmup_steps N instead, N = {n}")
    if name in REFUSED:
        return f"{received}: not supported: {REFUSED[name]}"
    return (f"{received}: an HF TrainingArguments name lockstep has no equivalent for; drop it. The HF names lockstep "
            f"maps are listed under '{GROUP}' in `lockstep train --help`; any config key: --set KEY=VALUE "
            "(--print-config lists them)")


def _label(name: str, raw) -> str:
    if name == "per_device_batch_size":  # lockstep's own spelling (cli/train.py)
        return f"--per-device-batch-size {raw}"
    if name in SWITCHES:
        return f"--{name}" if raw == "true" else f"--{name} {raw}"
    return f"--{name} {' '.join(raw) if isinstance(raw, list) else raw}"


def _bool(name: str, raw) -> bool:
    word = str(raw).strip().lower()
    if word in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return word in ("true", "1", "yes", "on")
    raise ConfigError(f"--{name} {raw!r} is not true or false; pass --{name} alone (true), or --{name} false "
                      "(a file right after a bare switch is read as its value: put the file first)")


def _value(key: str, raw: object) -> object:
    """What the config layer makes of `raw` for `key`: '5e-5' and '0.00005' are one learning rate."""
    cfg = Config()
    apply_overrides(cfg, {key: raw}, "command line")
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _is_chatml(path: str) -> bool:
    """A .json/.jsonl file (or glob), or a folder holding one: what data.kind = chatml reads."""
    p = Path(path)
    if p.suffix.lower() in (".json", ".jsonl"):
        return True
    return p.is_dir() and any(f.suffix.lower() in (".json", ".jsonl") for f in p.rglob("*"))


def _file_keys(args: argparse.Namespace) -> set[str]:
    """The dotted keys the config file sets; none when it cannot be read (load_config then says why)."""
    path = getattr(args, "config_file", None) or getattr(args, "config", None)
    try:
        tree = yaml.safe_load(Path(path).read_text()) if path else {}
    except (OSError, yaml.YAMLError):
        return set()
    if not isinstance(tree, dict):
        return set()
    return {f"{section}.{key}" for section, sub in tree.items() if isinstance(sub, dict) for key in sub}
