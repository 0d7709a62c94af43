"""Train a model (the built-in GPT, a Hugging Face model or your own) on this machine, under torchrun or srun.

Outside a launcher, `--world-size N` starts N local workers through torchrun's
elastic agent; under torchrun or srun the process joins the existing group.
Every setting is also reachable as `--set section.key=value` (see --print-config), and a job written for
HF Trainer keeps its TrainingArguments names (--per_device_train_batch_size, --bf16 ...): lockstep/cli/hf_args.py.
A job written for Lightning's Trainer keeps its names too (--devices, --precision bf16-mixed,
--max_epochs ...): lockstep/cli/lightning_args.py. `--help` lists lockstep's own flags under one
header per config section.
"""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.checkpoint.report import mark_latest, stop_note
from lockstep.cli.flag_help import flag_help, flag_metavar
from lockstep.cli.hf_args import DEST, add_hf_arguments, merge_hf_names, uses_hf_names
from lockstep.cli.hf_defaults import differing_defaults
from lockstep.cli.launch_options import add_launch_options, options_from
from lockstep.cli.lightning_args import add_lightning_arguments, merge_lightning_names
from lockstep.config import (
    Config,
    DistributedConfig,
    Overrides,
    dump_config,
    load_config,
    parse_sets,
)
from lockstep.config.overrides import QLORA_SUPPORT
from lockstep.errors import CheckpointError, ConfigError, DataError
from lockstep.launch.elastic import LaunchStopped, launch_local
from lockstep.models.quantize import check_4bit_training
from lockstep.parallel.buffers import check_sync_batchnorm
from lockstep.run_dir import check_run_dir_writable
from lockstep.runtime import (
    check_local_launch,
    check_port_free,
    default_local_processes,
    pick_device,
    read_launch_env,
    under_launcher,
)
from lockstep.train.mlflow_tracker import check_tracking_uri

if TYPE_CHECKING:
    from lockstep.train.run import Preflight

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
PER_DEVICE = "--per-device-batch-size"  # HF Trainer's per-device batch under a lockstep name (cli/hf_args.py)
# TRL's quantization flags other than --load_in_4bit: answered with what lockstep supports (refusal)
TRL_QUANTIZATION = (
    "load_in_8bit",
    "bnb_4bit_quant_type",
    "use_bnb_nested_quant",
    "quantization_config",
)
AMBIGUOUS = "--batch-size"  # global in lockstep before, per device in HF Trainer and the GPT team's CLI: refused


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
                help="samples per device per forward, the HF Trainer way (its --per_device_train_batch_size):"
                " the global batch follows the world, ranks x N x accumulation, unless "
                "--global-batch-size is given (train.micro_batch_size, and train.batch_size=none)",
            )
            g.add_argument(
                AMBIGUOUS,
                "--batch_size",
                dest="refused:batch_size",
                metavar="N",
                help="refused as ambiguous (global in lockstep's config, per device in HF Trainer and many "
                "CLIs): pass --global-batch-size N or --per-device-batch-size N",
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
    """Dotted key -> value from the flags, --set and the HF names; `.labels` says which flag set each."""
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
        f"{AMBIGUOUS} {value} is ambiguous, so lockstep refuses it: lockstep's config means the global batch "
        "(samples per optimizer step over all ranks, train.batch_size), HF Trainer and the GPT team's old CLI a "
        "batch per device, and reading one as the other trains with a batch world-size times too small or too "
        f"large. Pass --global-batch-size {value} ({value} samples per step in all; each device's micro-batch and "
        f"the accumulation are derived) or {PER_DEVICE} {value} ({value} per device per forward; global batch = "
        f"ranks x {value} x accumulation). The YAML key train.batch_size keeps its meaning: the global batch"
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_config(args.config, overrides_from_args(args))
    options = options_from(args)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    # HF names in use: say once which lockstep defaults differ from HF Trainer's (the process that parsed
    # the flags; the workers `lockstep train` itself starts stay quiet)
    note = (
        differing_defaults(cfg) if uses_hf_names(args) and not args.launched_by_lockstep else None
    )
    if note and read_launch_env(cfg.distributed).rank == 0:
        print(f"lockstep: {note}", flush=True)
    if under_launcher() or cfg.distributed.rank is not None:
        if args.max_restarts and not args.launched_by_lockstep:
            raise ConfigError(
                f"--max-restarts {args.max_restarts}: this process was started by a launcher, which "
                "decides the restarts (torchrun --max-restarts, `lockstep launch --max-restarts`); "
                "drop it here"
            )
        env = read_launch_env(cfg.distributed)
        preflight = None  # lockstep's own launcher checked before it started this worker
        if not args.launched_by_lockstep:
            from lockstep.plan.check import check_on_rank0

            preflight = check_on_rank0(cfg, env)
        # every rank runs this command: global rank 0 alone says what a stop left, unless our launcher does
        train_here(cfg, speaks=not args.launched_by_lockstep and env.rank == 0, preflight=preflight)
        return 0  # a signal-stopped worker exits 0: its launcher reports the signal itself
    nproc = cfg.distributed.world_size or default_local_processes(cfg.distributed)
    check_local_launch(cfg.distributed, nproc, nproc, cfg.train.mixed_precision)
    # a 4-bit base off CUDA, under FSDP or without bitsandbytes: one line, before a worker loads it
    device = pick_device(cfg.distributed, 0, nproc)
    check_4bit_training(cfg.model, cfg.parallel.data_parallel, device)
    # SyncBatchNorm off CUDA: one line here, not one per worker after they start
    check_sync_batchnorm(cfg.parallel.sync_batchnorm, cfg.parallel.data_parallel, device, nproc)
    from lockstep.parallel.mesh import check_layout
    from lockstep.plan.check import check_before_launch

    check_layout(cfg, nproc)  # layout and batch arithmetic fail here, before any worker starts
    # a step that would not fit its device: refused (or a warning) here, not OOM in every worker
    warning = check_before_launch(cfg, nproc, nproc, device)
    if warning:
        print(f"lockstep: WARNING: {warning}", file=sys.stderr, flush=True)
    if cfg.distributed.master_port is not None:
        check_port_free("127.0.0.1", cfg.distributed.master_port)
    check_run_dir_writable(cfg.checkpoint.output_dir)
    # an MLflow server that does not answer fails here, before any worker starts
    check_tracking_uri(cfg.train)
    if cfg.data.kind == "text":
        from lockstep.data.text import prepare_tokens

        # tokenize once here; workers find the cache
        prepare_tokens(cfg.data, seq_len=cfg.model.max_seq_length)
    if nproc == 1 and not options.max_restarts:  # restarts need torch's agent, even for one worker
        stop_signal = train_here(cfg, speaks=True)
        return 128 + stop_signal if stop_signal else 0
    restarts = f", restarts on a failure: {options.max_restarts}" if options.max_restarts else ""
    workers = f"{nproc} worker{'s' if nproc != 1 else ''}"
    print(
        f"lockstep: starting {workers} with torchrun's elastic agent{restarts}; logs in "
        f"{cfg.checkpoint.output_dir}/logs/",
        flush=True,
    )
    with reporting_stops(cfg):
        launch_local(
            ["lockstep", *argv, "--launched-by-lockstep"],
            nproc,
            cfg.distributed.master_port,
            max_restarts=options.max_restarts,
        )
    return 0


def train_here(cfg: Config, speaks: bool, preflight: Preflight | None = None) -> int | None:
    """run_training in this process (`preflight`: rank 0's check, plan.check.check_on_rank0); the
    signal that stopped it early (after its commit), or None when it finished.

    When `speaks`, a stop (signal, Ctrl-C, crash) also says what the run left on disk: the checkpoint it
    committed or that it committed none, and what the same command would resume from.
    """
    # heavy imports only once the config is known to be good
    from lockstep.tools.final import write_final_outputs
    from lockstep.train.run import run_training

    run_dir = Path(cfg.checkpoint.output_dir)
    before = mark_latest(run_dir)

    def note() -> str:  # read when it stops: what is on disk and in this node's memory then
        return stop_note(run_dir, before, cfg.checkpoint.resume, cfg.checkpoint.memory_dir)

    try:
        result = run_training(cfg, preflight)
        write_final_outputs(cfg, result)  # rank 0 of a run that finished; the group is gone
        stop_signal = result.stop_signal
    # a second Ctrl-C, or one before the loop: no stop-time commit was waited for
    except KeyboardInterrupt:
        if speaks:
            print(
                f"lockstep train: interrupted by Ctrl-C; {note()}",
                file=sys.stderr,
                flush=True,
            )
        return signal.SIGINT
    except (ConfigError, DataError, CheckpointError):
        raise  # the user's to fix, and the message says how
    except Exception as e:
        if speaks:
            e.stop_note = note()  # type: ignore[attr-defined]
        raise
    if stop_signal and speaks:
        print(
            f"lockstep train: stopped by signal {stop_signal} ({signal.Signals(stop_signal).name}); "
            f"{note()}",
            file=sys.stderr,
            flush=True,
        )
    return stop_signal


@contextmanager
def reporting_stops(cfg: Config, speaks: bool = True):
    """Workers started here that end early (a signal, a crash, a hang) end the launcher's message with what
    the run left on disk; `speaks` False (a node that does not hold global rank 0) leaves that to rank 0's node."""
    run_dir = Path(cfg.checkpoint.output_dir)
    before = mark_latest(run_dir)
    try:
        yield
    except LaunchStopped as e:
        if speaks:
            e.note = stop_note(run_dir, before, cfg.checkpoint.resume, cfg.checkpoint.memory_dir)
        raise
