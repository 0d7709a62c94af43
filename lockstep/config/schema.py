"""The run configuration's sections: nested dataclasses, every field with its one-line comment (what
`--help` shows: lockstep.config.field_help reads them from this file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelConfig:
    # built-in GPT, a Hugging Face model, or your factory
    kind: Literal["gpt", "hf", "custom"] = "gpt"
    path: str | None = None  # hf: local model directory (or a hub id already in the local HF cache)
    # hf: which Auto class loads model.path
    task: Literal["causal-lm", "seq2seq-lm", "speech-seq2seq", "ctc", "sequence-classification"] = (
        "causal-lm"
    )
    # hf: dtype the weights are loaded in
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # hf text-to-speech (Higgs Audio v2): the codec's local directory
    audio_tokenizer_path: str | None = None
    factory: str | None = None  # custom: "package.module:function" returning an nn.Module
    # custom: "package.module:function(output, batch) -> loss"; None = output.loss
    loss: str | None = None
    use_lora: bool = False  # hf: train LoRA adapters (peft) instead of all weights
    lora_rank: int = 8  # LoRA rank r
    lora_alpha: float = 16.0  # LoRA scaling alpha (update scaled by alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA input
    lora_target_modules: str = "all-linear"  # comma-separated module names, or all-linear
    # hf + use_lora: the frozen base in 4-bit NF4 (bitsandbytes, CUDA only): QLoRA
    load_in_4bit: bool = False
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
    # text: file, folder or glob (None = embedded corpus); chatml: JSON/JSONL; audio: manifest
    path: str | None = None
    # custom: "package.module:function" returning a Dataset or (train, eval) Datasets
    factory: str | None = None
    # custom: "package.module:function(list of samples) -> batch"; None = torch default
    collate: str | None = None
    pack: bool = True  # chatml: pack conversations into max_seq_length windows (false = one per sample, padded)
    max_files: int | None = None  # use only the first N files (sorted) of a folder or glob
    # audio manifest: column with the audio file path (relative to the manifest)
    audio_column: str = "audio"
    text_column: str = "text"  # audio manifest: column with the transcript
    speaker_column: str = "speaker"  # audio manifest: optional speaker column
    # audio manifest: optional duration in seconds (else read from the header)
    duration_column: str = "duration"
    # resample audio to this rate; None = the feature extractor's rate
    sample_rate: int | None = None
    # a missing or unreadable audio file: stop naming it, or skip and count
    bad_audio: Literal["stop", "skip"] = "stop"
    bucket_by_duration: bool = True  # audio: batch samples of similar duration (less padding)
    # audio: append every decoded file to RUN/reads/rank*.txt (to audit decoding)
    log_reads: bool = False
    tokenizer: Literal["byte", "bpe"] = "byte"  # byte-level, or a BPE trained with `tokenizers`
    bpe_vocab_size: int = 4096  # vocabulary size when tokenizer is bpe
    # bpe: use this tokenizer.json (e.g. another run's) instead of training one
    tokenizer_path: str | None = None
    max_bytes: int | None = 24_000_000  # cap on corpus bytes read (None = all)
    eval_fraction: float = 0.02  # share of windows held out for evaluation
    # token cache (text) and audio-codes cache (audio ChatML); None = ~/.cache/lockstep
    cache_dir: str | None = None
    # DataLoader worker processes per rank; auto = from the cores each rank has (lockstep.data.sampler)
    num_workers: int | Literal["auto"] = "auto"
    prefetch_factor: int = 4  # micro-batches each worker keeps ready


@dataclass
class OptimConfig:
    learning_rate: float = 2e-3  # peak learning rate at the reference batch size
    # applied to weight matrices and embeddings (dim >= 2), not biases or norms
    weight_decay: float = 0.1
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 50  # linear warmup steps
    # warmup as a share of the run's steps, in [0, 1); replaces warmup_steps
    warmup_ratio: float | None = None
    # after warmup: cosine or linear decay to min_lr_ratio x the peak, or constant (lockstep.optim.lr_at)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.1  # floor of the decay as a fraction of the peak
    gradient_clip_norm: float = 1.0  # max global grad norm; 0 disables clipping
    # scale lr with batch_size / reference_batch_size
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    reference_batch_size: int = 32  # global batch at which learning_rate was tuned


@dataclass
class TrainConfig:
    # global batch in samples per optimizer step; None = world x micro x accum
    batch_size: int | None = 32
    micro_batch_size: int | None = None  # sequences per rank per forward; None = derived
    grad_accum: int | None = None  # micro-steps per optimizer step; None = derived
    epochs: float | None = None  # stop after this many passes over the data (None = use max_steps)
    max_steps: int | None = 600  # stop after this many optimizer steps
    eval_interval: int = 100  # evaluate every N steps (0 = only at the end)
    eval_batches: int = 8  # micro-batches per rank in one evaluation
    log_interval: int = 10  # log metrics every N steps
    seed: int = 1337  # seeds init, data order and every rank's RNG
    # autocast; auto = bf16 where native; fp16 needs CUDA
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    # before workers start, lockstep plan's memory check (docs/plan.md): auto = refuse on CUDA
    # when a step's peak would not fit the device, skip on CPU; warn; refuse (on CPU too); off
    plan_check: Literal["auto", "warn", "refuse", "off"] = "auto"
    compile: bool = False  # compile the model with torch.compile, in place before DDP: a slow first step, then faster
    peak_flops: float | None = None  # per-device peak FLOP/s for MFU; None = measured at start
    profile_steps: str | None = None  # "A:B" writes a torch.profiler trace of steps A..B-1
    record_samples: bool = False  # write the sample indices of every step to samples.rank*.jsonl
    sample_tokens: int = 200  # tokens generated at the end of training (0 = none)
    # a rank whose own time per step is this share above the other ranks' median is behind
    # (lockstep.train.stragglers; 0.5 measured on this project's machines: BENCHMARKS.md)
    straggler_margin: float = 0.5
    # comparisons (each of 10 steps or more) a rank stays behind, for one cause, before its WARNING
    straggler_windows: int = 3
    # time the ring's links when communication is most of the step (5 x 512 KiB each way per link,
    # at most once every 10 comparisons); false where a link's bytes are being counted
    probe_links: bool = True
    # loss.png (and step_times.png, several ranks) drawn when the run ends; false for runs nobody
    # looks at (a sweep's trials, a test): `lockstep report RUN` draws both from metrics.jsonl later
    plots: bool = True
    report_to: str = "tensorboard"  # trackers beside metrics.jsonl and loss.png: tensorboard, mlflow, wandb (comma list), none
    # MLflow tracking URI (http://host:5000, sqlite:///x.db, a folder); None = RUN/mlflow.db
    tracking_uri: str | None = None
    # online needs `wandb login`; offline runs sync with `wandb sync`
    wandb_mode: Literal["offline", "online"] = "offline"
    project: str = "lockstep"  # the MLflow experiment and W&B project runs are logged under


@dataclass
class CheckpointConfig:
    output_dir: str = "runs/gpt"  # run directory: checkpoints, logs, metrics, plot
    save_interval: int = 200  # commit a checkpoint every N steps (0 = only at the end)
    keep_last: int = 3  # committed checkpoints kept; older ones are deleted
    resume: str = "auto"  # auto | none | PATH to a checkpoint directory
    # in-memory snapshots (docs/architecture.md, "In-memory snapshots"): every N steps to host memory that
    # outlives the workers, read first when they restart (0 = off). auto: where the launcher can restart
    # them, every step if a snapshot costs <= 2% of one, else every few steps so that it does
    memory_interval: int | Literal["auto"] = "auto"
    memory_dir: str = "/dev/shm/lockstep"  # a tmpfs; one directory per run and node under it
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
    # watchdog: stop with a report when a rank makes no progress this long (0 = off)
    hang_seconds: float = 300.0


@dataclass
class ParallelConfig:
    # replicate (DDP) or shard params/grads/optimizer (FSDP2)
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    # TP degree: attention heads and MLP split across this many ranks (built-in GPT)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1  # PP degree: the layers split into this many stages (built-in GPT)
    # PP schedule over the grad_accum micro-batches
    pipeline_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    # free gathered params after forward (less memory, one more all-gather)
    fsdp_reshard_after_forward: bool = True
    # FSDP with accumulation: reduce-scatter every micro-batch's gradients (a shard's memory
    # instead of the whole model's until the last micro-batch, at grad_accum times the bytes)
    fsdp_reduce_every_micro_batch: bool = False
    # a step may leave parameters without a gradient (DDP find_unused_parameters, FSDP reduce_scatter_unused_params);
    # auto = false for the built-in GPT, true for other models (their forward may branch on the data)
    find_unused_parameters: Literal["auto", "true", "false"] = "auto"
    # DDP; auto = false (true is refused with grad_accum > 1)
    static_graph: Literal["auto", "true", "false"] = "auto"
    # steps the DDP check runs before training, for models other than the GPT (0 = skip)
    check_steps: int = 2
    check_grads: bool = False  # debug: compare gradient hashes across ranks every step, stop at the first difference
    # DDP: rank 0's buffers (BatchNorm statistics) sent to every rank before each forward (torch's default)
    broadcast_buffers: bool = True
    # BatchNorm statistics over the global batch (torch's SyncBatchNorm; CUDA only)
    sync_batchnorm: bool = False
    # DDP's gradient all-reduce through torch's communication hooks: none, bf16 / fp16 (half the bytes), or powersgd
    # (low-rank, with error feedback); for slow links between nodes (`lockstep doctor --config` says when it pays)
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    # powersgd: rank of each gradient matrix's approximation (higher = closer, more bytes); 32 kept the loss within
    # 2% of uncompressed where 4 lost 30% (BENCHMARKS.md: AdamW, 300 steps)
    powersgd_rank: int = 32
    # powersgd: steps of plain all-reduce before compression starts (>= 2)
    powersgd_start_step: int = 10
    # DDP: size of the gradient buckets that are all-reduced as backward goes
    bucket_cap_mb: float = 25.0
    # DDP: gradients live in the communication buckets (one less copy per step)
    gradient_as_bucket_view: bool = True


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
