"""Train a model (the built-in GPT, a Hugging Face model or your own) on this machine, under torchrun or srun.

Outside a launcher, `--world-size N` starts N local workers through torchrun's
elastic agent; under torchrun or srun the process joins the existing group.
Every setting is also reachable as `--set section.key=value` (see --print-config).
"""

from __future__ import annotations

import argparse

from lockstep.config import ConfigError, dump_config, load_config
from lockstep.launch.elastic import launch_local
from lockstep.runtime import check_local_launch, check_port_free, default_local_processes, under_launcher

# flag -> dotted config key; the GPT team's flag names, then what a trainer needs
FLAGS = {
    "--world-size": "distributed.world_size", "--rank": "distributed.rank",
    "--master-addr": "distributed.master_addr", "--master-port": "distributed.master_port",
    "--backend": "distributed.backend", "--device": "distributed.device",
    "--vocab-size": "model.vocab_size", "--hidden-size": "model.hidden_size",
    "--attention-heads": "model.attention_heads", "--layers": "model.layers",
    "--max-seq-length": "model.max_seq_length", "--dropout": "model.dropout",
    "--learning-rate": "optim.learning_rate", "--warmup-steps": "optim.warmup_steps",
    "--gradient-clip-norm": "optim.gradient_clip_norm", "--weight-decay": "optim.weight_decay",
    "--lr-scaling": "optim.lr_scaling",
    "--batch-size": "train.batch_size", "--micro-batch-size": "train.micro_batch_size",
    "--grad-accum": "train.grad_accum", "--epochs": "train.epochs", "--max-steps": "train.max_steps",
    "--eval-interval": "train.eval_interval", "--log-interval": "train.log_interval", "--seed": "train.seed",
    "--profile-steps": "train.profile_steps", "--peak-flops": "train.peak_flops",
    "--save-interval": "checkpoint.save_interval", "--keep-last": "checkpoint.keep_last",
    "--output-dir": "checkpoint.output_dir", "--resume": "checkpoint.resume",
    "--data": "data.path", "--tokenizer": "data.tokenizer", "--num-workers": "data.num_workers",
    "--data-kind": "data.kind", "--max-files": "data.max_files", "--eval-fraction": "data.eval_fraction",
    "--model-kind": "model.kind", "--model": "model.path", "--task": "model.task", "--lora-rank": "model.lora_rank",
}
SWITCHES = {"--no-nccl": "distributed.no_nccl", "--use-gradient-checkpointing": "model.gradient_checkpointing",
            "--use-lora": "model.use_lora", "--check-grads": "parallel.check_grads"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML", help="config file; flags below override it")
    for flag, key in FLAGS.items():
        # values stay strings here: the config layer coerces and names the rule when one is wrong
        p.add_argument(flag, dest=key, metavar="V", help=key)
    p.add_argument("--mixed-precision", dest="train.mixed_precision", nargs="?", const="bf16", metavar="{no,bf16,fp16}",
                   help="train.mixed_precision (bare flag = bf16)")
    for flag, key in SWITCHES.items():
        p.add_argument(flag, dest=key, action="store_const", const=True, help=key)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, e.g. --set data.max_bytes=1000000")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def overrides_from_args(args: argparse.Namespace) -> dict[str, object]:
    out = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} is not KEY=VALUE; e.g. --set train.batch_size=64")
        out[key.strip()] = value
    if "train.epochs" in out and "train.max_steps" not in out:
        out["train.max_steps"] = None  # --epochs alone means "train for that many epochs"
    return out


def run(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_config(args.config, overrides_from_args(args))
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    from lockstep.train import run_training  # heavy imports only once the config is known to be good

    if under_launcher() or cfg.distributed.rank is not None:
        run_training(cfg)  # a signal-stopped worker exits 0: its launcher reports the signal itself
        return 0
    nproc = cfg.distributed.world_size or default_local_processes(cfg.distributed)
    check_local_launch(cfg.distributed, nproc, nproc)
    from lockstep.parallel.mesh import check_layout

    check_layout(cfg, nproc)  # layout and batch arithmetic fail here, before any worker starts
    if cfg.distributed.master_port is not None:
        check_port_free("127.0.0.1", cfg.distributed.master_port)
    if cfg.data.kind == "text":
        from lockstep.data.text import prepare_tokens

        prepare_tokens(cfg.data, seq_len=cfg.model.max_seq_length)  # tokenize once here; workers find the cache
    if nproc == 1:
        stop_signal = run_training(cfg).stop_signal
        return 128 + stop_signal if stop_signal else 0
    print(f"lockstep: starting {nproc} workers with torchrun's elastic agent; logs in "
          f"{cfg.checkpoint.output_dir}/logs/", flush=True)
    launch_local(["lockstep", *argv], nproc, cfg.distributed.master_port)
    return 0
