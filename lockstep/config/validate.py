"""Every rule of a configuration that can be checked before a process starts: each refusal names the value,
the rule and the fix. Rules that need the world size (batch arithmetic) live in lockstep.parallel.mesh."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lockstep.config.schema import Config, DataConfig, ModelConfig, TrainConfig
from lockstep.errors import ConfigError


def validate_config(cfg: Config) -> None:
    """Every rule that does not need the world size. Raises ConfigError naming value, rule and fix."""
    _check_ranges(cfg)
    _check_model_and_data(cfg.model, cfg.data, cfg.train)
    _check_schedule(cfg)
    _check_run(cfg)


def _check_ranges(cfg: Config) -> None:
    """Counts, sizes and rates that must be positive (or at least 0)."""
    d = cfg.data

    def positive(key: str, value: int | float | None, allow_zero: bool = False) -> None:
        if value is None:
            return
        if value < 0 or (value == 0 and not allow_zero):
            rule = "must be >= 0" if allow_zero else "must be > 0"
            raise ConfigError(
                f"{key} = {value} {rule}; set a {'non-negative' if allow_zero else 'positive'} value"
            )

    for key in (
        "model.vocab_size",
        "model.hidden_size",
        "model.attention_heads",
        "model.layers",
        "model.max_seq_length",
        "data.bpe_vocab_size",
        "data.max_bytes",
        "optim.learning_rate",
        "train.batch_size",
        "train.micro_batch_size",
        "train.grad_accum",
        "train.epochs",
        "train.max_steps",
        "train.eval_batches",
        "train.log_interval",
        "train.straggler_margin",
        "train.straggler_windows",
        "checkpoint.keep_last",
        "distributed.world_size",
        "distributed.timeout_seconds",
        "train.peak_flops",
        "model.lora_rank",
        "model.lora_alpha",
        "data.max_files",
        "data.sample_rate",
        "parallel.tensor_parallel",
        "parallel.pipeline_parallel",
        "parallel.powersgd_rank",
        "parallel.bucket_cap_mb",
    ):
        section, name = key.split(".")
        positive(key, getattr(getattr(cfg, section), name))
    for key in (
        "optim.weight_decay",
        "optim.warmup_steps",
        "optim.gradient_clip_norm",
        "train.eval_interval",
        "checkpoint.save_interval",
        "train.sample_tokens",
        "distributed.rank",
        "parallel.check_steps",
    ):
        section, name = key.split(".")
        positive(key, getattr(getattr(cfg, section), name), allow_zero=True)
    if d.num_workers != "auto":
        positive("data.num_workers", d.num_workers, allow_zero=True)
    if cfg.checkpoint.memory_interval != "auto":
        positive("checkpoint.memory_interval", cfg.checkpoint.memory_interval, allow_zero=True)


def _check_model_and_data(m: ModelConfig, d: DataConfig, t: TrainConfig) -> None:
    """The kinds that go together, the model's shape, the data's tokenizer, split and loader, the batch."""
    _validate_kinds(m, d)
    if not 0.0 <= m.lora_dropout < 1.0:
        raise ConfigError(f"model.lora_dropout = {m.lora_dropout} must be in [0, 1)")
    if t.batch_size is None and t.micro_batch_size is None:
        raise ConfigError(
            "train.batch_size is none and so is train.micro_batch_size; set one of them "
            "(batch_size = samples per step in all, micro_batch_size = samples per rank per forward)"
        )
    if m.hidden_size % m.attention_heads:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) is not divisible by model.attention_heads ({m.attention_heads}); "
            f"pick heads that divide it, e.g. {_divisor_near(m.hidden_size, m.attention_heads)}"
        )
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout = {m.dropout} must be in [0, 1)")
    if d.tokenizer == "byte" and m.vocab_size < 256:
        raise ConfigError(
            f"model.vocab_size = {m.vocab_size} is below 256, the byte tokenizer's size; set it to 256"
        )
    if not 0.0 <= d.eval_fraction < 0.5:
        raise ConfigError(
            f"data.eval_fraction = {d.eval_fraction} must be in [0, 0.5); 0.02 is typical, 0 = no eval"
        )
    if d.tokenizer_path is not None:
        if d.tokenizer != "bpe":
            raise ConfigError(
                f"data.tokenizer_path is for data.tokenizer = 'bpe' (got {d.tokenizer!r}); "
                "set data.tokenizer: bpe or drop data.tokenizer_path"
            )
        if not Path(d.tokenizer_path).is_file():
            raise ConfigError(
                f"data.tokenizer_path = {d.tokenizer_path!r} is not a file; pass a tokenizer.json, "
                "e.g. RUN/checkpoints/step_N/tokenizer.json of the run whose vocabulary to share"
            )
    if d.num_workers == 0 and d.prefetch_factor != DataConfig.prefetch_factor:
        raise ConfigError(
            "data.prefetch_factor needs data.num_workers > 0; set data.num_workers to 1 or more"
        )


def _check_schedule(cfg: Config) -> None:
    """The optimizer's schedule, when training stops, mixed precision, trackers, profiling."""
    o, t, dist = cfg.optim, cfg.train, cfg.distributed
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio = {o.min_lr_ratio} must be in [0, 1]")
    if o.warmup_ratio is not None:
        if not 0.0 <= o.warmup_ratio < 1.0:
            raise ConfigError(
                f"optim.warmup_ratio = {o.warmup_ratio} must be in [0, 1) (a share of the run's "
                "steps); for a number of steps set optim.warmup_steps instead"
            )
        if "optim.warmup_steps" in cfg.set_keys:
            raise ConfigError(
                f"optim.warmup_steps = {o.warmup_steps} and optim.warmup_ratio = {o.warmup_ratio} "
                "both set the warmup; set one of them"
            )
    if t.epochs is None and t.max_steps is None:
        raise ConfigError(
            "neither train.epochs nor train.max_steps is set; set one to say when training stops"
        )
    if t.mixed_precision == "fp16" and dist.device == "cpu":
        raise ConfigError(
            "train.mixed_precision = 'fp16' needs CUDA (GradScaler); on CPU use 'bf16' or 'no'"
        )
    check_trackers(t.report_to)
    if t.profile_steps is not None:
        parse_profile_steps(t.profile_steps)


def _check_run(cfg: Config) -> None:
    """Resume, ranks and ports, the hang and collective timeouts, gradient compression, the backend."""
    c, dist = cfg.checkpoint, cfg.distributed
    if c.resume not in ("auto", "none") and not Path(c.resume).exists():
        raise ConfigError(
            f"checkpoint.resume = {c.resume!r} is neither 'auto', 'none' nor an existing checkpoint path; "
            "pass a checkpoint directory (see `lockstep verify RUN_DIR`)"
        )
    if dist.rank is not None:
        if dist.world_size is None:
            raise ConfigError(
                f"distributed.rank = {dist.rank} needs distributed.world_size; pass --world-size N"
            )
        if dist.rank >= dist.world_size:
            raise ConfigError(
                f"distributed.rank = {dist.rank} is not below distributed.world_size = {dist.world_size}; "
                f"ranks run 0..{dist.world_size - 1}"
            )
    if dist.master_port is not None and not 0 < dist.master_port < 65536:
        raise ConfigError(f"distributed.master_port = {dist.master_port} must be in 1..65535")
    if dist.hang_seconds < 0 or 0 < dist.timeout_seconds <= dist.hang_seconds:
        raise ConfigError(
            f"distributed.hang_seconds = {dist.hang_seconds} must be >= 0 and below distributed.timeout_seconds "
            f"({dist.timeout_seconds}), or the collective timeout fires first and no hang report is written"
        )
    if cfg.parallel.powersgd_start_step < 2:
        # torch's PowerSGDState: DDP rebuilds its buckets after step 1, which would mismatch error feedback kept before
        raise ConfigError(
            f"parallel.powersgd_start_step = {cfg.parallel.powersgd_start_step} must be >= 2: PowerSGD "
            "keeps per-bucket state, and DDP rebuilds its buckets after the first step; set 2 or more "
            "(torch suggests about 10% of the run's steps)"
        )
    if dist.no_nccl and dist.backend == "nccl":
        raise ConfigError(
            "distributed.backend = 'nccl' contradicts distributed.no_nccl; drop one of them"
        )


def _validate_kinds(m: ModelConfig, d: DataConfig) -> None:
    """Which model kinds go with which data kinds, and the fields each kind needs."""
    if m.kind == "hf" and not m.path:
        raise ConfigError(
            "model.kind = 'hf' needs model.path: a local directory saved with save_pretrained "
            "(or a hub id already in the local Hugging Face cache)"
        )
    if m.kind == "custom" and not m.factory:
        raise ConfigError(
            "model.kind = 'custom' needs model.factory = 'package.module:function' "
            "(a function that returns your nn.Module)"
        )
    if m.kind != "custom" and (m.factory or m.loss):
        raise ConfigError(
            f"model.factory / model.loss are for model.kind = 'custom', not {m.kind!r}; "
            "set model.kind: custom or drop them"
        )
    if m.use_lora and m.kind != "hf":
        raise ConfigError(
            f"model.use_lora needs model.kind = 'hf' (peft wraps Hugging Face models); got {m.kind!r}"
        )
    if m.load_in_4bit and not (m.kind == "hf" and m.use_lora):
        raise ConfigError(
            f"model.load_in_4bit trains LoRA adapters on a frozen 4-bit base (QLoRA): it needs "
            f"model.kind = 'hf' and model.use_lora = true (got kind {m.kind!r}, use_lora "
            f"{str(m.use_lora).lower()}); add --use-lora, or drop model.load_in_4bit"
        )
    if d.kind in ("chatml", "audio") and m.kind != "hf":
        raise ConfigError(
            f"data.kind = {d.kind!r} is tokenized with a Hugging Face model's tokenizer/processor; "
            f"set model.kind: hf and model.path (got model.kind = {m.kind!r})"
        )
    if d.kind in ("chatml", "audio") and not d.path:
        raise ConfigError(
            f"data.kind = {d.kind!r} needs data.path: "
            + (
                "a ChatML .json/.jsonl file or folder"
                if d.kind == "chatml"
                else "an audio manifest (.csv, .jsonl or .parquet, or a folder of them)"
            )
        )
    if d.kind == "custom" and not d.factory:
        raise ConfigError(
            "data.kind = 'custom' needs data.factory = 'package.module:function' "
            "(a function that returns a Dataset, or a (train, eval) pair)"
        )
    if d.kind != "custom" and (d.factory or d.collate):
        raise ConfigError(
            f"data.factory / data.collate are for data.kind = 'custom', not {d.kind!r}; "
            "set data.kind: custom or drop them"
        )
    if m.kind == "gpt" and d.kind != "text":
        raise ConfigError(
            f"the built-in GPT trains on data.kind = 'text', not {d.kind!r}; "
            "for chat or audio data use model.kind: hf"
        )
    if m.kind == "custom" and d.kind != "custom":
        raise ConfigError(
            f"model.kind = 'custom' takes its batches from data.kind = 'custom' (data.factory); "
            f"got data.kind = {d.kind!r}"
        )


# what train.report_to may name, with the package each needs
TRACKERS = ("tensorboard", "mlflow", "wandb")


def check_trackers(report_to: str) -> list[str]:
    """The trackers train.report_to names, each valid and its library importable (found, not imported)."""
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    if names == ["none"]:
        return []
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(
                f"train.report_to names {name!r}, which is not a tracker; valid: {', '.join(TRACKERS)} "
                "(several comma-separated, e.g. 'tensorboard,mlflow'), or 'none'"
            )
        if importlib.util.find_spec(name) is None:
            # tensorboard: a core dependency
            extra = "tensorboard" if name == "tensorboard" else f"'lockstep[{name}]'"
            raise ConfigError(
                f"train.report_to names {name!r} but the {name} package is not installed; "
                f"pip install {extra} (or drop {name} from train.report_to)"
            )
    return names


def parse_profile_steps(spec: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(
            f"train.profile_steps = {spec!r} must look like 'A:B' (e.g. '10:15')"
        ) from None
    if not 0 <= a < b:
        raise ConfigError(f"train.profile_steps = {spec!r} needs 0 <= A < B")
    return a, b


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))
