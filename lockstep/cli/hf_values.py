"""What the value of each HF Trainer name means in lockstep's config: the rules behind
lockstep.cli.hf_args.

One function per kind of name: `special` for the value flags with a rule of their own (paths, batch
sizes, the schedule, the warmup, the strategies), `switch` for the boolean switches, `precision` for
--bf16 and --fp16 together, `check_noop` for the HF defaults lockstep already behaves as
(lockstep.cli.hf_defaults). Each returns the Settings the name makes, or raises ConfigError with the
value, the rule and the fix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

from lockstep.cli.hf_defaults import NOOPS
from lockstep.errors import ConfigError

# --lr_scheduler_type values lockstep runs -> optim.schedule; the rest of HF's SchedulerType is
# refused
SCHEDULES = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
    "cosine_with_min_lr": "cosine",
}
WARMUP_NAMES = ("warmup_steps", "warmup_ratio")


class Setting(NamedTuple):
    key: str  # dotted config key
    value: object  # the flag's value as given (a string), or what its HF meaning implies
    # "": the flag's own value; "flags": gives way to any flag setting key; "all": to the file too
    implied: str = ""


def special(name: str, raw, given: dict[str, object], flags: dict[str, object]) -> list[Setting]:
    """The Settings of value flag `name` = `raw`; `given` holds every HF name of the command
    (name -> raw value) and `flags` the keys lockstep's own flags set (a rule may read another
    name's value)."""
    flag = f"--{name} {raw}"
    match name:
        case "model_path" | "model_name_or_path":
            return [Setting("model.kind", "hf"), Setting("model.path", raw)]
        case "train_data_file" | "train_file":
            chatml = [Setting("data.kind", "chatml", "all")] * _is_chatml(raw)
            return [Setting("data.path", raw)] + chatml
        # the second: lockstep's --per-device-batch-size
        case "per_device_train_batch_size" | "per_device_batch_size":
            return [
                Setting("train.micro_batch_size", raw),
                Setting("train.batch_size", None, "flags"),
            ]
        case "per_device_eval_batch_size":
            train = given.get("per_device_train_batch_size", given.get("per_device_batch_size", ""))
            if raw.strip() != str(train).strip():
                raise ConfigError(
                    f"{flag}: lockstep evaluates with the training micro-batch "
                    "(train.micro_batch_size); drop it, or give it the value of "
                    "--per_device_train_batch_size"
                )
            return []
        case "num_train_epochs":
            if max_steps(given) > 0:  # HF: a positive max_steps overrides num_train_epochs
                return [Setting("train.epochs", None, "flags")]
            return [Setting("train.epochs", raw), Setting("train.max_steps", None, "flags")]
        case "max_steps":
            if max_steps(given) > 0:
                return [Setting("train.max_steps", raw)]
            return [Setting("train.max_steps", None, "flags")]
        case "resume_from_checkpoint":
            word = raw.strip().lower()
            resume = "auto" if word == "true" else "none" if word == "false" else raw
            return [Setting("checkpoint.resume", resume)]
        case "lr_scheduler_type" | "lr_scheduler_kwargs":
            return schedule(name, raw, given, flags)
        case "warmup_steps":
            return warmup_steps(raw)
        case "optim":
            if raw not in ("adamw_torch", "adamw_torch_fused"):
                raise ConfigError(
                    f"{flag}: lockstep trains with torch.optim.AdamW (fused on GPU; settings "
                    "optim.beta1, beta2, eps, weight_decay); pass --optim adamw_torch or drop it"
                )
            return []
        case "report_to":
            return _report_to(raw)
        case "ddp_find_unused_parameters" | "ddp_static_graph":
            key = {
                "ddp_find_unused_parameters": "parallel.find_unused_parameters",
                "ddp_static_graph": "parallel.static_graph",
            }[name]
            return [Setting(key, str(to_bool(name, raw)).lower())]
        case "ddp_broadcast_buffers":
            return [Setting("parallel.broadcast_buffers", to_bool(name, raw))]
        case "eval_strategy" | "evaluation_strategy":
            if raw not in ("steps", "no"):
                raise ConfigError(
                    f"{flag}: lockstep evaluates every train.eval_interval steps; pass "
                    "--eval_strategy steps with --eval_steps N, or --eval_strategy no"
                )
            return switch("disable_evaluation", raw == "no")
        case "save_strategy" | "logging_strategy":
            if raw != "steps":
                what, steps = {
                    "save_strategy": (
                        "commits a checkpoint",
                        "--save_steps N (0 = only at the end)",
                    ),
                    "logging_strategy": ("logs", "--logging_steps N"),
                }[name]
                raise ConfigError(
                    f"{flag}: lockstep {what} every N steps and at the end; pass {steps} instead"
                )
            return []
        case "local_rank":
            return []  # torchrun sets LOCAL_RANK; runtime reads it from the environment
    raise AssertionError(f"no rule for HF name {name!r}")


def schedule(
    name: str, raw: str, given: dict[str, object], flags: dict[str, object]
) -> list[Setting]:
    """--lr_scheduler_type, meaning what it means in HF Trainer; --lr_scheduler_kwargs with it.

    linear and cosine decay to 0 in HF, so they imply optim.min_lr_ratio = 0 (which gives way to any
    explicit floor); constant has no warmup in HF (constant_with_warmup has), so it sets the warmup
    to 0 and is refused beside a warmup flag; cosine_with_min_lr takes its floor from
    --lr_scheduler_kwargs.
    """
    kind = str(given.get("lr_scheduler_type", ""))
    if name == "lr_scheduler_kwargs":
        if kind != "cosine_with_min_lr":
            raise ConfigError(
                f"--lr_scheduler_kwargs {raw}: lockstep reads it only with --lr_scheduler_type "
                'cosine_with_min_lr ({"min_lr_rate": R} or {"min_lr": LR}); drop it, or set '
                "the floor "
                "of a cosine or linear decay with --min-lr-ratio R"
            )
        return []  # read with --lr_scheduler_type below
    if kind not in SCHEDULES:
        raise ConfigError(
            f"--lr_scheduler_type {raw}: lockstep runs HF's {', '.join(SCHEDULES)} (linear warmup, "
            "then "
            "optim.schedule cosine, linear or constant down to optim.min_lr_ratio x the peak); "
            "pass one of "
            "those, or drop it (cosine to 0.1 x the peak)"
        )
    out = [Setting("optim.schedule", SCHEDULES[kind])]
    if kind in ("linear", "cosine"):
        return out + [Setting("optim.min_lr_ratio", "0", "all")]
    if kind == "constant":
        warmups = [f"--{n} {given[n]}" for n in WARMUP_NAMES if n in given and _nonzero(given[n])]
        warmups += [
            f"optim.{n} = {flags[f'optim.{n}']}"
            for n in WARMUP_NAMES
            if flags.get(f"optim.{n}") is not None and _nonzero(flags[f"optim.{n}"])
        ]
        if warmups:
            raise ConfigError(
                f"--lr_scheduler_type constant with {', '.join(warmups)}: HF's constant schedule "
                "has no "
                "warmup; for a warmup then a constant learning rate pass --lr_scheduler_type "
                "constant_with_warmup"
            )
        return out + [Setting("optim.warmup_steps", "0")]
    if kind == "cosine_with_min_lr":
        return out + [Setting("optim.min_lr_ratio", _min_lr_rate(given, flags))]
    return out  # constant_with_warmup


def _min_lr_rate(given: dict[str, object], flags: dict[str, object]) -> str:
    """optim.min_lr_ratio from --lr_scheduler_kwargs, as HF's
    get_cosine_with_min_lr_schedule_with_warmup reads it: min_lr_rate as given, or min_lr / the
    learning rate; one of them, never both."""
    text = str(given.get("lr_scheduler_kwargs", "")).strip()
    how = (
        "pass --lr_scheduler_kwargs '{\"min_lr_rate\": 0.1}' (the floor as a share of the peak) "
        "or '{\"min_lr\": 1e-5}' with --learning_rate"
    )
    try:
        kwargs = json.loads(text) if text else {}
    except json.JSONDecodeError:
        kwargs = None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--lr_scheduler_kwargs {text}: not a JSON object; {how}")
    unknown = sorted(set(kwargs) - {"min_lr", "min_lr_rate"})
    if unknown or len(kwargs) != 1:
        got = (
            f"{', '.join(unknown)} is not read"
            if unknown
            else (
                "both min_lr and min_lr_rate given"
                if kwargs
                else "neither min_lr nor min_lr_rate given"
            )
        )
        raise ConfigError(
            "--lr_scheduler_type cosine_with_min_lr --lr_scheduler_kwargs "
            f"{text or '(none)'}: "
            f"{got}; lockstep reads exactly one of min_lr_rate and min_lr, as HF; "
            f"{how}"
        )
    if "min_lr_rate" in kwargs:
        return str(kwargs["min_lr_rate"])
    lr = given.get("learning_rate", flags.get("optim.learning_rate"))
    if lr is None:
        raise ConfigError(
            f"--lr_scheduler_kwargs {text}: min_lr is converted to optim.min_lr_ratio with the "
            "learning "
            "rate, and this command sets none; pass --learning_rate LR too, or give min_lr_rate"
        )
    return str(float(kwargs["min_lr"]) / float(lr))


def warmup_steps(raw: str) -> list[Setting]:
    """--warmup_steps as transformers 5 reads it: a whole number is steps, one below 1 a share of
    the run's steps."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value >= 0 and value.is_integer():  # 0, 500, 500.0: steps
        return [Setting("optim.warmup_steps", str(int(value)))]
    if 0 < value < 1:  # transformers 5: a share of the run's steps (rounded up: lockstep.optim)
        return [Setting("optim.warmup_ratio", raw)]
    raise ConfigError(
        f"--warmup_steps {raw}: must be a whole number of optimizer steps (>= 0) or, as in "
        "transformers 5, "
        "a share of the run's steps below 1; pass e.g. --warmup_steps 500 or --warmup_steps 0.1"
    )


def _nonzero(raw: object) -> bool:
    try:
        return float(str(raw)) != 0
    except ValueError:
        return True


def _report_to(raw: list[str]) -> list[Setting]:
    names = ["tensorboard", "mlflow", "wandb"] if raw == ["all"] else list(raw)
    others = [v for v in names if v not in ("none", "tensorboard", "mlflow", "wandb")]
    if others:
        raise ConfigError(
            f"--report_to {' '.join(raw)}: {', '.join(others)} is not supported; lockstep reports "
            "to "
            "tensorboard, mlflow and wandb (and always to OUTPUT_DIR/metrics.jsonl): pick from "
            "those, or "
            "drop --report_to"
        )
    return [Setting("train.report_to", ",".join(names))]


def switch(name: str, on: bool) -> list[Setting]:
    match name:
        case "use_lora" | "gradient_checkpointing":
            return [Setting(f"model.{name}", on)]
        case "torch_compile":
            return [Setting("train.compile", on)]
        case "disable_evaluation" | "do_eval":
            if (
                name == "disable_evaluation"
            ) != on:  # --disable_evaluation false, --do_eval true: no change
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
            return []  # the two together: precision
    raise AssertionError(f"no rule for HF switch {name!r}")


def check_noop(name: str, raw) -> None:
    """An HF default lockstep already behaves as (lockstep.cli.hf_defaults.NOOPS): its value passes,
    the other is refused saying what lockstep does."""
    value, what = NOOPS[name]
    word = str(raw).strip().lower()
    if isinstance(value, bool):
        ok = to_bool(name, raw) == value
    else:
        ok = word in value
    if not ok:
        shown = str(value).lower() if isinstance(value, bool) else " or ".join(value)
        raise ConfigError(
            f"--{name} {raw}: not supported: {what}. Drop it (lockstep accepts only "
            f"--{name} {shown}, what it does anyway)"
        )


def precision(given: dict[str, object], label: str) -> Setting:
    bf16, fp16 = (to_bool(n, given[n]) if n in given else None for n in ("bf16", "fp16"))
    if bf16 and fp16:
        raise ConfigError(
            f"{label}: both are true, and a run autocasts to one of them; pass --bf16 or --fp16"
        )
    return Setting("train.mixed_precision", "bf16" if bf16 else "fp16" if fp16 else "no")


def max_steps(given: dict[str, object]) -> int:
    """--max_steps as a number; -1 (HF's default: train --num_train_epochs) when not given."""
    raw = str(given.get("max_steps", "-1"))
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if steps == 0 or steps < -1:
        raise ConfigError(
            f"--max_steps {raw}: must be a positive number of optimizer steps, or -1 "
            "(HF: "
            "train --num_train_epochs instead); pass e.g. --max_steps 1000"
        )
    return steps


def to_bool(name: str, raw) -> bool:
    word = str(raw).strip().lower()
    if word in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return word in ("true", "1", "yes", "on")
    raise ConfigError(
        f"--{name} {raw!r} is not true or false; pass --{name} alone (true), or "
        f"--{name} false "
        "(a file right after a bare switch is read as its value: put the file first)"
    )


def _is_chatml(path: str) -> bool:
    """A .json/.jsonl file (or glob), or a folder holding one: what data.kind = chatml reads."""
    p = Path(path)
    if p.suffix.lower() in (".json", ".jsonl"):
        return True
    return p.is_dir() and any(f.suffix.lower() in (".json", ".jsonl") for f in p.rglob("*"))
