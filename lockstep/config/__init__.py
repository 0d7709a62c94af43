"""Run configuration: nested dataclasses, loaded from YAML, overridden by dotted keys.

Every field carries a one-line comment. `load_config` is the single entry point;
`validate_config` holds every rule that can be checked before a process starts.
Rules that need the world size (batch arithmetic) live in `resolve_batch`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from lockstep.errors import ConfigError
from lockstep.config.overrides import Overrides, all_keys, apply_overrides, flatten, parse_sets

__all__ = ["Overrides", "all_keys", "apply_overrides", "parse_sets"]  # re-exported: callers set keys on a Config through here


@dataclass
class ModelConfig:
    kind: Literal["gpt", "hf", "custom"] = "gpt"  # built-in GPT, a Hugging Face model, or your factory
    path: str | None = None  # hf: local model directory (or a hub id already in the local HF cache)
    # hf: which Auto class loads model.path
    task: Literal["causal-lm", "seq2seq-lm", "speech-seq2seq", "ctc", "sequence-classification"] = "causal-lm"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # hf: dtype the weights are loaded in
    audio_tokenizer_path: str | None = None  # hf text-to-speech (Higgs Audio v2): the codec's local directory
    factory: str | None = None  # custom: "package.module:function" returning an nn.Module
    loss: str | None = None  # custom: "package.module:function(output, batch) -> loss"; None = output.loss
    use_lora: bool = False  # hf: train LoRA adapters (peft) instead of all weights
    lora_rank: int = 8  # LoRA rank r
    lora_alpha: float = 16.0  # LoRA scaling alpha (update scaled by alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA input
    lora_target_modules: str = "all-linear"  # comma-separated module names, or all-linear
    load_in_4bit: bool = False  # hf + use_lora: the frozen base in 4-bit NF4 (bitsandbytes, CUDA only): QLoRA
    vocab_size: int = 256  # byte tokenizer: 256; a BPE tokenizer sets its own size
    hidden_size: int = 256  # width of the residual stream
    attention_heads: int = 4  # must divide hidden_size
    layers: int = 4  # transformer blocks
    max_seq_length: int = 128  # context length, also the training window
    dropout: float = 0.0  # dropout on attention and residual paths
    gradient_checkpointing: bool = False  # recompute block activations in backward


@dataclass
class DataConfig:
    kind: Literal["text", "chatml", "audio", "custom"] = "text"  # what data.path holds
    path: str | None = None  # text: file, folder or glob (None = embedded corpus); chatml: JSON/JSONL; audio: manifest
    factory: str | None = None  # custom: "package.module:function" returning a Dataset or (train, eval) Datasets
    collate: str | None = None  # custom: "package.module:function(list of samples) -> batch"; None = torch default
    pack: bool = True  # chatml: pack conversations into max_seq_length windows (false = one per sample, padded)
    max_files: int | None = None  # use only the first N files (sorted) of a folder or glob
    audio_column: str = "audio"  # audio manifest: column with the audio file path (relative to the manifest)
    text_column: str = "text"  # audio manifest: column with the transcript
    speaker_column: str = "speaker"  # audio manifest: optional speaker column
    duration_column: str = "duration"  # audio manifest: optional duration in seconds (else read from the header)
    sample_rate: int | None = None  # resample audio to this rate; None = the feature extractor's rate
    bad_audio: Literal["stop", "skip"] = "stop"  # a missing or unreadable audio file: stop naming it, or skip and count
    bucket_by_duration: bool = True  # audio: batch samples of similar duration (less padding)
    log_reads: bool = False  # audio: append every decoded file to RUN/reads/rank*.txt (to audit decoding)
    tokenizer: Literal["byte", "bpe"] = "byte"  # byte-level, or a BPE trained with `tokenizers`
    bpe_vocab_size: int = 4096  # vocabulary size when tokenizer is bpe
    tokenizer_path: str | None = None  # bpe: use this tokenizer.json (e.g. another run's) instead of training one
    max_bytes: int | None = 24_000_000  # cap on corpus bytes read (None = all)
    eval_fraction: float = 0.02  # share of windows held out for evaluation
    cache_dir: str | None = None  # token cache (text) and audio-codes cache (audio ChatML); None = ~/.cache/lockstep
    # DataLoader worker processes per rank; auto = from the cores each rank has (lockstep.data.sampler)
    num_workers: int | Literal["auto"] = "auto"
    prefetch_factor: int = 4  # micro-batches each worker keeps ready


@dataclass
class OptimConfig:
    learning_rate: float = 2e-3  # peak learning rate at the reference batch size
    weight_decay: float = 0.1  # applied to weight matrices and embeddings (dim >= 2), not biases or norms
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 50  # linear warmup steps
    warmup_ratio: float | None = None  # warmup as a share of the run's steps, in [0, 1); replaces warmup_steps
    # after warmup: cosine or linear decay to min_lr_ratio x the peak, or constant (lockstep.optim.lr_at)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1  # floor of the decay as a fraction of the peak
    gradient_clip_norm: float = 1.0  # max global grad norm; 0 disables clipping
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"  # scale lr with batch_size / reference_batch_size
    reference_batch_size: int = 32  # global batch at which learning_rate was tuned


@dataclass
class TrainConfig:
    batch_size: int | None = 32  # global batch in samples per optimizer step; None = world x micro x accum
    micro_batch_size: int | None = None  # sequences per rank per forward; None = derived
    grad_accum: int | None = None  # micro-steps per optimizer step; None = derived
    epochs: float | None = None  # stop after this many passes over the data (None = use max_steps)
    max_steps: int | None = 600  # stop after this many optimizer steps
    eval_interval: int = 100  # evaluate every N steps (0 = only at the end)
    eval_batches: int = 8  # micro-batches per rank in one evaluation
    log_interval: int = 10  # log metrics every N steps
    seed: int = 1337  # seeds init, data order and every rank's RNG
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"  # autocast; auto = bf16 where native; fp16 needs CUDA
    compile: bool = False  # compile the model with torch.compile, in place before DDP: a slow first step, then faster
    peak_flops: float | None = None  # per-device peak FLOP/s for MFU; None = measured at start
    profile_steps: str | None = None  # "A:B" writes a torch.profiler trace of steps A..B-1
    record_samples: bool = False  # write the sample indices of every step to samples.rank*.jsonl
    sample_tokens: int = 200  # tokens generated at the end of training (0 = none)
    report_to: str = "tensorboard"  # trackers beside metrics.jsonl and loss.png: tensorboard, mlflow, wandb (comma list), none
    tracking_uri: str | None = None  # MLflow tracking URI (http://host:5000, sqlite:///x.db, a folder); None = RUN/mlflow.db
    wandb_mode: Literal["offline", "online"] = "offline"  # online needs `wandb login`; offline runs sync with `wandb sync`
    project: str = "lockstep"  # the MLflow experiment and W&B project runs are logged under


@dataclass
class CheckpointConfig:
    output_dir: str = "runs/gpt"  # run directory: checkpoints, logs, metrics, plot
    save_interval: int = 200  # commit a checkpoint every N steps (0 = only at the end)
    keep_last: int = 3  # committed checkpoints kept; older ones are deleted
    resume: str = "auto"  # auto | none | PATH to a checkpoint directory
    async_save: bool = False  # write, fsync and commit in the background: a save stalls the step only for the copy to host


@dataclass
class DistributedConfig:
    world_size: int | None = None  # processes in all; None = one per GPU, or the launcher's
    rank: int | None = None  # this process's rank when processes are started by hand
    master_addr: str = "127.0.0.1"  # rendezvous host for hand-started processes
    master_port: int | None = None  # rendezvous port; None = a free port
    backend: Literal["auto", "nccl", "gloo", "mpi"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    no_nccl: bool = False  # never use nccl (e.g. broken NCCL install)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    timeout_seconds: float = 600.0  # collective timeout; a stuck collective raises after this
    hang_seconds: float = 300.0  # watchdog: stop with a report when a rank makes no progress this long (0 = off)


@dataclass
class ParallelConfig:
    data_parallel: Literal["ddp", "fsdp"] = "ddp"  # replicate (DDP) or shard params/grads/optimizer (FSDP2)
    tensor_parallel: int = 1  # TP degree: attention heads and MLP split across this many ranks (built-in GPT)
    pipeline_parallel: int = 1  # PP degree: the layers split into this many stages (built-in GPT)
    pipeline_schedule: Literal["gpipe", "1f1b"] = "1f1b"  # PP schedule over the grad_accum micro-batches
    fsdp_reshard_after_forward: bool = True  # free gathered params after forward (less memory, one more all-gather)
    # a step may leave parameters without a gradient (DDP find_unused_parameters, FSDP reduce_scatter_unused_params);
    # auto = false for the built-in GPT, true for other models (their forward may branch on the data)
    find_unused_parameters: Literal["auto", "true", "false"] = "auto"
    static_graph: Literal["auto", "true", "false"] = "auto"  # DDP; auto = false (true is refused with grad_accum > 1)
    check_steps: int = 2  # steps the DDP check runs before training, for models other than the GPT (0 = skip)
    check_grads: bool = False  # debug: compare gradient hashes across ranks every step, stop at the first difference
    # DDP: rank 0's buffers (BatchNorm statistics) sent to every rank before each forward (torch's default)
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False  # BatchNorm statistics over the global batch (torch's SyncBatchNorm; CUDA only)
    # DDP's gradient all-reduce through torch's communication hooks: none, bf16 / fp16 (half the bytes), or powersgd
    # (low-rank, with error feedback); for slow links between nodes (`lockstep doctor --config` says when it pays)
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    # powersgd: rank of each gradient matrix's approximation (higher = closer, more bytes); 32 kept the loss within
    # 2% of uncompressed where 4 lost 30% (BENCHMARKS.md: AdamW, 300 steps)
    powersgd_rank: int = 32
    powersgd_start_step: int = 10  # powersgd: steps of plain all-reduce before compression starts (>= 2)
    bucket_cap_mb: float = 25.0  # DDP: size of the gradient buckets that are all-reduced as backward goes
    gradient_as_bucket_view: bool = True  # DDP: gradients live in the communication buckets (one less copy per step)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        # dotted keys a YAML file or a flag set (not a field: never saved, compared or printed as a setting)
        self.set_keys: set[str] = set()
        # dotted key -> where its value came from: a flag as typed (`--global-batch-size 64`), `--set KEY=V`, the
        # YAML file's path; keys left at their default are absent (lockstep.train.startup_notes says "default")
        self.sources: dict[str, str] = {}


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(tree: dict[str, Any], source: str = "config") -> Config:
    cfg = Config()
    apply_overrides(cfg, flatten(tree, source), source)
    return cfg


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """YAML file (optional) then dotted-key overrides, then validation."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(tree).__name__}")
        apply_overrides(cfg, flatten(tree, str(path)), str(path))
    apply_overrides(cfg, overrides or {}, "command line")
    validate_config(cfg)
    return cfg


def validate_config(cfg: Config) -> None:
    """Every rule that does not need the world size. Raises ConfigError naming value, rule and fix."""
    m, d, o, t, c, dist = cfg.model, cfg.data, cfg.optim, cfg.train, cfg.checkpoint, cfg.distributed

    def positive(key: str, value: int | float | None, allow_zero: bool = False) -> None:
        if value is None:
            return
        if value < 0 or (value == 0 and not allow_zero):
            rule = "must be >= 0" if allow_zero else "must be > 0"
            raise ConfigError(f"{key} = {value} {rule}; set a {'non-negative' if allow_zero else 'positive'} value")

    for key in ("model.vocab_size", "model.hidden_size", "model.attention_heads", "model.layers",
                "model.max_seq_length", "data.bpe_vocab_size", "data.max_bytes", "optim.learning_rate",
                "train.batch_size", "train.micro_batch_size", "train.grad_accum", "train.epochs",
                "train.max_steps", "train.eval_batches", "train.log_interval", "checkpoint.keep_last",
                "distributed.world_size", "distributed.timeout_seconds", "train.peak_flops", "model.lora_rank",
                "model.lora_alpha", "data.max_files", "data.sample_rate", "parallel.tensor_parallel",
                "parallel.pipeline_parallel", "parallel.powersgd_rank", "parallel.bucket_cap_mb"):
        section, name = key.split(".")
        positive(key, getattr(getattr(cfg, section), name))
    for key in ("optim.weight_decay", "optim.warmup_steps", "optim.gradient_clip_norm", "train.eval_interval",
                "checkpoint.save_interval", "train.sample_tokens", "distributed.rank",
                "parallel.check_steps"):
        section, name = key.split(".")
        positive(key, getattr(getattr(cfg, section), name), allow_zero=True)
    if d.num_workers != "auto":
        positive("data.num_workers", d.num_workers, allow_zero=True)

    _validate_kinds(m, d)
    if not 0.0 <= m.lora_dropout < 1.0:
        raise ConfigError(f"model.lora_dropout = {m.lora_dropout} must be in [0, 1)")
    if t.batch_size is None and t.micro_batch_size is None:
        raise ConfigError("train.batch_size is none and so is train.micro_batch_size; set one of them "
                          "(batch_size = samples per step in all, micro_batch_size = samples per rank per forward)")
    if m.hidden_size % m.attention_heads:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) is not divisible by model.attention_heads ({m.attention_heads}); "
            f"pick heads that divide it, e.g. {_divisor_near(m.hidden_size, m.attention_heads)}"
        )
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout = {m.dropout} must be in [0, 1)")
    if d.tokenizer == "byte" and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} is below 256, the byte tokenizer's size; set it to 256")
    if not 0.0 <= d.eval_fraction < 0.5:
        raise ConfigError(f"data.eval_fraction = {d.eval_fraction} must be in [0, 0.5); 0.02 is typical, 0 = no eval")
    if d.tokenizer_path is not None:
        if d.tokenizer != "bpe":
            raise ConfigError(f"data.tokenizer_path is for data.tokenizer = 'bpe' (got {d.tokenizer!r}); "
                              "set data.tokenizer: bpe or drop data.tokenizer_path")
        if not Path(d.tokenizer_path).is_file():
            raise ConfigError(f"data.tokenizer_path = {d.tokenizer_path!r} is not a file; pass a tokenizer.json, "
                              "e.g. RUN/checkpoints/step_N/tokenizer.json of the run whose vocabulary to share")
    if d.num_workers == 0 and d.prefetch_factor != DataConfig.prefetch_factor:
        raise ConfigError("data.prefetch_factor needs data.num_workers > 0; set data.num_workers to 1 or more")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio = {o.min_lr_ratio} must be in [0, 1]")
    if o.warmup_ratio is not None:
        if not 0.0 <= o.warmup_ratio < 1.0:
            raise ConfigError(f"optim.warmup_ratio = {o.warmup_ratio} must be in [0, 1) (a share of the run's "
                              "steps); for a number of steps set optim.warmup_steps instead")
        if "optim.warmup_steps" in cfg.set_keys:
            raise ConfigError(f"optim.warmup_steps = {o.warmup_steps} and optim.warmup_ratio = {o.warmup_ratio} "
                              "both set the warmup; set one of them")
    if t.epochs is None and t.max_steps is None:
        raise ConfigError("neither train.epochs nor train.max_steps is set; set one to say when training stops")
    if t.mixed_precision == "fp16" and dist.device == "cpu":
        raise ConfigError("train.mixed_precision = 'fp16' needs CUDA (GradScaler); on CPU use 'bf16' or 'no'")
    check_trackers(t.report_to)
    if t.profile_steps is not None:
        parse_profile_steps(t.profile_steps)
    if c.resume not in ("auto", "none") and not Path(c.resume).exists():
        raise ConfigError(f"checkpoint.resume = {c.resume!r} is neither 'auto', 'none' nor an existing checkpoint path; "
                          "pass a checkpoint directory (see `lockstep verify RUN_DIR`)")
    if dist.rank is not None:
        if dist.world_size is None:
            raise ConfigError(f"distributed.rank = {dist.rank} needs distributed.world_size; pass --world-size N")
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
        raise ConfigError(f"parallel.powersgd_start_step = {cfg.parallel.powersgd_start_step} must be >= 2: PowerSGD "
                          "keeps per-bucket state, and DDP rebuilds its buckets after the first step; set 2 or more "
                          "(torch suggests about 10% of the run's steps)")
    if dist.no_nccl and dist.backend == "nccl":
        raise ConfigError("distributed.backend = 'nccl' contradicts distributed.no_nccl; drop one of them")


def _validate_kinds(m: ModelConfig, d: DataConfig) -> None:
    """Which model kinds go with which data kinds, and the fields each kind needs."""
    if m.kind == "hf" and not m.path:
        raise ConfigError("model.kind = 'hf' needs model.path: a local directory saved with save_pretrained "
                          "(or a hub id already in the local Hugging Face cache)")
    if m.kind == "custom" and not m.factory:
        raise ConfigError("model.kind = 'custom' needs model.factory = 'package.module:function' "
                          "(a function that returns your nn.Module)")
    if m.kind != "custom" and (m.factory or m.loss):
        raise ConfigError(f"model.factory / model.loss are for model.kind = 'custom', not {m.kind!r}; "
                          "set model.kind: custom or drop them")
    if m.use_lora and m.kind != "hf":
        raise ConfigError(f"model.use_lora needs model.kind = 'hf' (peft wraps Hugging Face models); got {m.kind!r}")
    if m.load_in_4bit and not (m.kind == "hf" and m.use_lora):
        raise ConfigError(f"model.load_in_4bit trains LoRA adapters on a frozen 4-bit base (QLoRA): it needs "
                          f"model.kind = 'hf' and model.use_lora = true (got kind {m.kind!r}, use_lora "
                          f"{str(m.use_lora).lower()}); add --use-lora, or drop model.load_in_4bit")
    if d.kind in ("chatml", "audio") and m.kind != "hf":
        raise ConfigError(f"data.kind = {d.kind!r} is tokenized with a Hugging Face model's tokenizer/processor; "
                          f"set model.kind: hf and model.path (got model.kind = {m.kind!r})")
    if d.kind in ("chatml", "audio") and not d.path:
        raise ConfigError(f"data.kind = {d.kind!r} needs data.path: "
                          + ("a ChatML .json/.jsonl file or folder" if d.kind == "chatml"
                             else "an audio manifest (.csv, .jsonl or .parquet, or a folder of them)"))
    if d.kind == "custom" and not d.factory:
        raise ConfigError("data.kind = 'custom' needs data.factory = 'package.module:function' "
                          "(a function that returns a Dataset, or a (train, eval) pair)")
    if d.kind != "custom" and (d.factory or d.collate):
        raise ConfigError(f"data.factory / data.collate are for data.kind = 'custom', not {d.kind!r}; "
                          "set data.kind: custom or drop them")
    if m.kind == "gpt" and d.kind != "text":
        raise ConfigError(f"the built-in GPT trains on data.kind = 'text', not {d.kind!r}; "
                          "for chat or audio data use model.kind: hf")
    if m.kind == "custom" and d.kind != "custom":
        raise ConfigError(f"model.kind = 'custom' takes its batches from data.kind = 'custom' (data.factory); "
                          f"got data.kind = {d.kind!r}")


TRACKERS = ("tensorboard", "mlflow", "wandb")  # what train.report_to may name, with the package each needs


def check_trackers(report_to: str) -> list[str]:
    """The trackers train.report_to names, each valid and its library importable (found, not imported)."""
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    if names == ["none"]:
        return []
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"train.report_to names {name!r}, which is not a tracker; valid: {', '.join(TRACKERS)} "
                              "(several comma-separated, e.g. 'tensorboard,mlflow'), or 'none'")
        if importlib.util.find_spec(name) is None:
            extra = "tensorboard" if name == "tensorboard" else f"'lockstep[{name}]'"  # tensorboard: a core dependency
            raise ConfigError(f"train.report_to names {name!r} but the {name} package is not installed; "
                              f"pip install {extra} (or drop {name} from train.report_to)")
    return names


def parse_profile_steps(spec: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"train.profile_steps = {spec!r} must look like 'A:B' (e.g. '10:15')") from None
    if not 0 <= a < b:
        raise ConfigError(f"train.profile_steps = {spec!r} needs 0 <= A < B")
    return a, b


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))
