"""The baseline for bench_train.py: a minimal raw PyTorch training loop, nanoGPT-style.

Same model (lockstep's GPT with the same ModelConfig), same data (the token cache lockstep
prepares, windows read straight from the memmap at random indices), same optimizer
settings (fused AdamW, two weight-decay groups), autocast for bf16, DDP over gloo when
started by torchrun, clip_grad_norm_, and `loss.item()` only at the log interval. Nothing
else: no checkpoints, no eval, no metrics files.

    python bench/raw_loop.py --steps 90 --warmup 10 --precision bf16            # 1 process
    torchrun --standalone --nproc_per_node 2 bench/raw_loop.py --steps 90 ...    # 2-process DDP

Throughput is measured the way bench_train.py reads lockstep's metrics.jsonl: the wall
time from the log point at step `warmup` to the log point at the last step, so both
sides count the same steps and both include their log-interval work.

`--with FEATURE` adds one piece of what lockstep's trainer does per step, to measure
what it costs (see bench_train.py --ablations):
    stop_allreduce  a float64 all-reduce(MAX) every step (lockstep's StopRequest.agreed)
    loader          lockstep's DataLoader (TokenWindows + GlobalCursorSampler, 1 worker process)
    metrics_cpu     per-step loss / grad-norm .detach().float().cpu() accumulation
    scheduler       lockstep's LambdaLR warmup+cosine scheduler instead of setting lr by hand
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lockstep.config import DataConfig, ModelConfig, OptimConfig
from lockstep.data.text import TokenWindows, prepare_tokens
from lockstep.models.gpt import build_gpt

FEATURES = ("stop_allreduce", "loader", "metrics_cpu", "scheduler")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=90, help="optimizer steps in all")
    p.add_argument("--warmup", type=int, default=10, help="steps before the timed region (must be a log point)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="global batch in sequences")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--with", dest="features", action="append", default=[], choices=FEATURES,
                   help="add one lockstep per-step feature (repeatable)")
    p.add_argument("--out", help="write the result as JSON here (rank 0)")
    p.add_argument("--profile", metavar="A:B", help="write a torch.profiler chrome trace of steps A..B-1 to "
                   "--profile-out (as lockstep's train.profile_steps; bench/profile_ops.py compares the two)")
    p.add_argument("--profile-out", default="raw.trace.json")
    args = p.parse_args(argv)
    if args.warmup % args.log_interval or args.steps % args.log_interval or args.steps <= args.warmup:
        p.error(f"--warmup ({args.warmup}) and --steps ({args.steps}) must be multiples of --log-interval "
                f"({args.log_interval}), with steps > warmup")
    return args


def build_adamw(model: torch.nn.Module, ocfg: OptimConfig) -> torch.optim.AdamW:
    """Fused AdamW with two weight-decay groups (matrices decay, vectors do not), as lockstep builds it."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": ocfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=ocfg.learning_rate, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, fused=True)


def lr_factor(step: int, steps: int, ocfg: OptimConfig) -> float:
    """Warmup + cosine to min_lr_ratio over `steps`, as lockstep's schedule (a multiple of the peak)."""
    if step < ocfg.warmup_steps:
        return (step + 1) / ocfg.warmup_steps
    progress = (step - ocfg.warmup_steps) / max(1, steps - ocfg.warmup_steps)
    return ocfg.min_lr_ratio + (1 - ocfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by WORLD_SIZE {world}")
    micro = args.batch_size // world

    mcfg, dcfg, ocfg = ModelConfig(), DataConfig(), OptimConfig()
    T = mcfg.max_seq_length
    cache = prepare_tokens(dcfg, seq_len=T)  # a cache hit: the bench prepares it before any run
    train_windows = TokenWindows(cache, T, "train", dcfg.eval_fraction)  # for its split size (and --with loader)
    num_train = len(train_windows)
    tokens = np.memmap(cache.tokens_path, dtype=cache.dtype, mode="r", shape=(cache.num_tokens,))
    rng = np.random.default_rng(args.seed + rank)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = rng.integers(0, num_train, micro)
        buf = torch.from_numpy(np.stack([tokens[i * T:i * T + T + 1] for i in ix]).astype(np.int64))  # (B, T+1)
        return buf[:, :-1], buf[:, 1:]

    if "loader" in args.features:
        from lockstep.parallel.mesh import BatchPlan
        from lockstep.data.sampler import Cursor, GlobalCursorSampler, build_loader

        plan = BatchPlan(global_batch=args.batch_size, world_size=world, micro_batch=micro, grad_accum=1)
        sampler = GlobalCursorSampler(num_train, plan, rank, args.seed, Cursor(), args.steps)
        batches = iter(build_loader(train_windows, sampler, dcfg.num_workers, dcfg.prefetch_factor, False))
        get_batch = lambda: next(batches)  # noqa: E731

    torch.manual_seed(args.seed)
    model = build_gpt(mcfg)
    optimizer = build_adamw(model, ocfg)
    ddp_model = DDP(model, gradient_as_bucket_view=True) if world > 1 else model
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def lr_at(step: int) -> float:
        return lr_factor(step, args.steps, ocfg)

    scheduler = None
    if "scheduler" in args.features:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    window_loss = torch.zeros(())

    marks: dict[int, float] = {}
    losses: list[float] = []
    first_step_time = None
    prof_from, prof_to = (int(x) for x in args.profile.split(":")) if args.profile else (-1, -1)
    profiler = None
    for step in range(args.steps):
        if step == prof_from:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            profiler.start()
        if step == prof_to and profiler is not None:
            profiler.stop()
            profiler.export_chrome_trace(args.profile_out)
            profiler = None
        if scheduler is None:
            for group in optimizer.param_groups:
                group["lr"] = ocfg.learning_rate * lr_at(step)
        x, y = get_batch()
        with autocast:
            _, loss = ddp_model(x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ocfg.gradient_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if "metrics_cpu" in args.features:
            window_loss += loss.detach().float().cpu() + 0 * grad_norm.detach().float().cpu()
        if "stop_allreduce" in args.features and world > 1:
            flag = torch.tensor([0.0], dtype=torch.float64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            flag.item()
        done = step + 1
        if done == 1:
            loss.item()  # the first step has finished on the host (time to first step, bench_peers.py)
            first_step_time = time.time()
        if done % args.log_interval == 0:
            losses.append(loss.item())  # the only host read of the loss
            marks[done] = time.perf_counter()

    if rank == 0:
        timed = args.steps - args.warmup
        elapsed = marks[args.steps] - marks[args.warmup] if args.warmup in marks else float("nan")  # nan: --warmup 0
        result = {"impl": "raw", "world_size": world, "precision": args.precision, "threads": torch.get_num_threads(),
                  "steps_timed": timed, "elapsed_s": elapsed,
                  "tokens_per_s": timed * args.batch_size * T / elapsed,
                  "window_tokens_per_s": [args.log_interval * args.batch_size * T / (marks[s] - marks[s - args.log_interval])
                                          for s in range(args.warmup + args.log_interval, args.steps + 1, args.log_interval)
                                          if s - args.log_interval in marks],
                  "flops_per_token": model.flops_per_token(), "last_loss": losses[-1], "features": args.features,
                  "first_step_time": first_step_time}
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    del ddp_model, optimizer
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
