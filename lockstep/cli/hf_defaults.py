"""HF Trainer's defaults against lockstep's: the one place that states TrainingArguments' defaults.

Two uses. A job written for HF Trainer often passes HF's default values explicitly
(`--dataloader_pin_memory true`); where lockstep already behaves that way the name is accepted as a
no-op (NOOPS; the other value is refused by lockstep.cli.hf_values.check_noop, saying what lockstep
does). And a job that leaves a setting at its default gets lockstep's default, not HF's:
`differing_defaults` writes the one start-up line that lists those, so nobody assumes HF's weight
decay or schedule.
"""

from __future__ import annotations

from lockstep.config import Config

# TrainingArguments' defaults, read from transformers 5.24 src/transformers/training_args.py (the
# field defaults of the TrainingArguments dataclass). beta1, epsilon and max_grad_norm equal
# lockstep's (a test keeps them so); the others differ and `differing_defaults` names them.
HF_DEFAULTS = {
    "learning_rate": 5e-5,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "lr_scheduler_type": "linear",  # linear decay to 0
    "warmup_steps": 0,
    "seed": 42,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "num_train_epochs": 3.0,
    "max_steps": -1,
    "eval_strategy": "no",
    "bf16": False,
    "logging_steps": 500,
    "save_steps": 500,
    "save_total_limit": None,  # keep every checkpoint
    "dataloader_num_workers": 0,
    "ddp_timeout": 1800,
}
# HF name -> the config key of the same meaning, compared value for value
SAME_MEANING = {
    "weight_decay": "optim.weight_decay",
    "adam_beta2": "optim.beta2",
    "learning_rate": "optim.learning_rate",
    "adam_beta1": "optim.beta1",
    "adam_epsilon": "optim.eps",
    "max_grad_norm": "optim.gradient_clip_norm",
    "seed": "train.seed",
    "logging_steps": "train.log_interval",
    "save_steps": "checkpoint.save_interval",
    "ddp_timeout": "distributed.timeout_seconds",
}
# HF names accepted as no-ops: name -> (the one value lockstep behaves as: a bool, or the accepted
# words; what lockstep does, said when the other value is refused)
NOOPS = {
    "dataloader_pin_memory": (
        True,
        "lockstep pins the host memory of its batches when it trains on CUDA (on CPU there is no "
        "copy to speed up)",
    ),
    "dataloader_drop_last": (
        True,
        "lockstep drops each epoch's last samples that do not fill a global batch, so every step "
        "trains on the same number of samples (lockstep.data.sampler)",
    ),
    "dataloader_persistent_workers": (
        True,
        "lockstep keeps its DataLoader workers (data.num_workers > 0) alive for the whole run",
    ),
    "remove_unused_columns": (
        True,
        "lockstep's readers (text, chatml, audio) build only the model's inputs, so no column is "
        "left over; to pass other fields use data.kind=custom with data.factory",
    ),
    "save_safetensors": (
        True,
        "lockstep saves weights as safetensors (sharded layouts as torch.distributed.checkpoint "
        "shards, which `lockstep export` turns into safetensors)",
    ),
    "logging_first_step": (
        False,
        "lockstep logs every --logging_steps steps and at the last step; --logging_steps 1 logs "
        "every step, the first included",
    ),
    "disable_tqdm": (
        False,
        "lockstep draws a tqdm progress bar when stderr is a terminal and none in batch jobs; the "
        "log lines carry the same numbers",
    ),
    "include_num_input_tokens_seen": (
        ("no", "false"),
        "lockstep logs tokens_per_s, not a running count of the tokens seen",
    ),
    "log_level": (
        ("passive", "info"),
        "lockstep logs at INFO: rank 0 to the console, every rank to OUTPUT_DIR/logs/rank<N>.log",
    ),
}


def differing_defaults(cfg: Config) -> str | None:
    """The start-up line for a command that uses HF names: lockstep's defaults that differ from HF
    Trainer's and that neither the command nor the config file set; None when there are none.

    Keys are grouped as one setting where HF has one: the schedule is optim.schedule with its floor
    optim.min_lr_ratio, the batch is train.batch_size, micro_batch_size and grad_accum.
    """
    o, t, d = cfg.optim, cfg.train, cfg.data
    schedule = f"schedule {o.schedule} to {o.min_lr_ratio:g} x peak (HF linear to 0)"
    batch = f"train.batch_size {t.batch_size} samples per step over all ranks (HF 8 per device)"
    evaluation = (
        (
            f"evaluation every {t.eval_interval} steps on a held-out {d.eval_fraction:g} of "
            "the data (HF none)"
        )
        if t.eval_interval
        else None
    )
    precision = f"train.mixed_precision {t.mixed_precision}: bf16 where supported (HF fp32)"
    warmup = f"warmup {o.warmup_steps} steps (HF 0)"
    length = f"train.max_steps {t.max_steps} (HF 3 epochs)"
    keep = f"checkpoint.keep_last {cfg.checkpoint.keep_last} (HF keeps all)"
    items = [
        _same(cfg, "weight_decay"),
        _same(cfg, "adam_beta2"),
        _said(cfg, schedule, "optim.schedule", "optim.min_lr_ratio"),
        _same(cfg, "learning_rate"),
        _said(cfg, warmup, "optim.warmup_steps", "optim.warmup_ratio"),
        _same(cfg, "seed"),
        _said(cfg, batch, "train.batch_size", "train.micro_batch_size", "train.grad_accum"),
        _said(cfg, length, "train.max_steps", "train.epochs"),
        _said(cfg, evaluation, "train.eval_interval", "data.eval_fraction"),
        _said(cfg, precision, "train.mixed_precision"),
        _same(cfg, "logging_steps"),
        _same(cfg, "save_steps"),
        _said(cfg, keep, "checkpoint.keep_last"),
        _said(cfg, f"data.num_workers {d.num_workers} (HF 0)", "data.num_workers"),
        _same(cfg, "ddp_timeout"),
        # equal to HF's today; said should a lockstep default change
        *(_same(cfg, name) for name in ("adam_beta1", "adam_epsilon", "max_grad_norm")),
    ]
    items = [i for i in items if i]
    if not items:
        return None
    return (
        "lockstep defaults that differ from HF Trainer's, not set by this command: "
        f"{', '.join(items)}; set one with its HF name or --set KEY=VALUE"
    )


def _same(cfg: Config, name: str) -> str | None:
    """`optim.beta2 0.95 (HF --adam_beta2 0.999)` when the key is unset and differs from HF's
    default."""
    key = SAME_MEANING[name]
    section, field = key.split(".")
    ours, theirs = getattr(getattr(cfg, section), field), HF_DEFAULTS[name]
    if key in cfg.set_keys or ours == theirs:
        return None
    return f"{key} {ours:g} (HF --{name} {theirs:g})"


def _said(cfg: Config, text: str | None, *keys: str) -> str | None:
    """`text` when none of `keys` was set (their values are then lockstep's defaults)."""
    return None if any(k in cfg.set_keys for k in keys) else text
