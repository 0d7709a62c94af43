"""The baseline for bench_train.py: a minimal raw PyTorch training loop, nanoGPT-style.

Same model (lockstep's GPT with the same ModelConfig), same data (the token cache lockstep
prepares, windows read straight from the memmap at random indices), same optimizer
settings (fused AdamW, two weight-decay groups), autocast for bf16, DDP over gloo when
started by torchrun, clip_grad_norm_, and `loss.item()` only at the log interval. Nothing
else: no checkpoints, no eval, no metrics files.

    python bench/raw_loop.py --steps 90 --warmup 10 --precision bf16            # 1 process
    torchrun --standalone --nproc_per_node 2 bench/raw_loop.py --steps 90 ...    # 2-process DDP
    python bench/raw_loop.py --device cuda --compile --precision bf16 --vocab-size 50304 \
        --hidden-size 768 --layers 12 --attention-heads 12 --max-seq-length 1024 \
        --batch-size 32 --micro-batch 16               # GPT-2 124M, as bench/gpu/gpt2.py runs it

On CUDA (`--device cuda`; NCCL and cuda:LOCAL_RANK under torchrun) the batch is copied from pinned
memory without blocking, as nanoGPT does, and the result also holds the peak of
torch.cuda.max_memory_allocated. `--micro-batch` below the per-rank batch accumulates gradients
(DDP syncs only on the last micro-step); `--compile` wraps the model in torch.compile.

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
SHAPE_FLAGS = ("vocab_size", "hidden_size", "layers", "attention_heads", "max_seq_length")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=90, help="optimizer steps in all")
    p.add_argument(
        "--warmup", type=int, default=10, help="steps before the timed region (must be a log point)"
    )
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="global batch in sequences")
    p.add_argument(
        "--micro-batch",
        type=int,
        help="sequences per forward per rank (default: the whole per-rank "
        "batch); a smaller one accumulates gradients over batch / (ranks x micro) micro-steps",
    )
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (nanoGPT's `compile = True`)",
    )
    for flag in SHAPE_FLAGS:
        p.add_argument(
            f"--{flag.replace('_', '-')}",
            dest=flag,
            type=int,
            help=f"model.{flag} (default: lockstep's ModelConfig)",
        )
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--with",
        dest="features",
        action="append",
        default=[],
        choices=FEATURES,
        help="add one lockstep per-step feature (repeatable)",
    )
    p.add_argument("--out", help="write the result as JSON here (rank 0)")
    p.add_argument(
        "--profile",
        metavar="A:B",
        help="write a torch.profiler chrome trace of steps A..B-1 to "
        "--profile-out (as lockstep's train.profile_steps; bench/profile_ops.py compares the two)",
    )
    p.add_argument("--profile-out", default="raw.trace.json")
    args = p.parse_args(argv)
    check_timed_steps(p, args)
    return args


def check_timed_steps(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Both sides are timed between log points: warmup and steps must be some (also gpt2.py)."""
    if (
        args.warmup % args.log_interval
        or args.steps % args.log_interval
        or args.steps <= args.warmup
    ):
        p.error(
            f"--warmup ({args.warmup}) and --steps ({args.steps}) must be multiples of "
            f"--log-interval ({args.log_interval}), with steps > warmup"
        )


def build_adamw(model: torch.nn.Module, ocfg: OptimConfig) -> torch.optim.AdamW:
    """Fused AdamW, two weight-decay groups (matrices decay, vectors do not), as lockstep's."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": ocfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=ocfg.learning_rate,
        betas=(ocfg.beta1, ocfg.beta2),
        eps=ocfg.eps,
        fused=True,
    )


def lr_factor(step: int, steps: int, ocfg: OptimConfig) -> float:
    """Warmup + cosine to min_lr_ratio over `steps`, as lockstep's schedule (x the peak lr)."""
    if step < ocfg.warmup_steps:
        return (step + 1) / ocfg.warmup_steps
    progress = (step - ocfg.warmup_steps) / max(1, steps - ocfg.warmup_steps)
    return ocfg.min_lr_ratio + (1 - ocfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def init_device(device_type: str, world: int) -> torch.device:
    """This process's device; with WORLD_SIZE > 1 also the process group (NCCL on CUDA, or gloo)."""
    if device_type == "cpu":
        if world > 1:
            dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl", device_id=device)
    return device


def split_batch(batch_size: int, micro_batch: int | None, world: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for a global batch over `world` ranks."""
    if batch_size % world:
        raise SystemExit(f"--batch-size {batch_size} is not divisible by WORLD_SIZE {world}")
    per_rank = batch_size // world
    micro = micro_batch or per_rank
    if per_rank % micro:
        raise SystemExit(
            f"--batch-size {batch_size} / WORLD_SIZE {world} = {per_rank} sequences per rank is "
            f"not divisible by --micro-batch {micro}; pick a micro-batch that divides {per_rank}"
        )
    return micro, per_rank // micro


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = init_device(args.device, world)
    micro, accum = split_batch(args.batch_size, args.micro_batch, world)

    shape = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    mcfg, dcfg, ocfg = ModelConfig(**shape), DataConfig(), OptimConfig()
    T = mcfg.max_seq_length
    cache = prepare_tokens(dcfg, seq_len=T)  # a cache hit: the bench prepares it before any run
    # for its split size (and --with loader)
    train_windows = TokenWindows(cache, T, "train", dcfg.eval_fraction)
    num_train = len(train_windows)
    tokens = np.memmap(cache.tokens_path, dtype=cache.dtype, mode="r", shape=(cache.num_tokens,))
    rng = np.random.default_rng(args.seed + rank)
    cuda = device.type == "cuda"

    def to_device(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not cuda:
            return x, y
        # from pinned host memory the copy overlaps with the GPU's work instead of blocking the host
        x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = rng.integers(0, num_train, micro)
        windows = np.stack([tokens[i * T : i * T + T + 1] for i in ix])  # (B, T+1)
        buf = torch.from_numpy(windows.astype(np.int64))
        return to_device(buf[:, :-1], buf[:, 1:])

    if "loader" in args.features:
        from lockstep.data.sampler import Cursor, GlobalCursorSampler, build_loader
        from lockstep.parallel.mesh import BatchPlan

        plan = BatchPlan(
            global_batch=args.batch_size, world_size=world, micro_batch=micro, grad_accum=accum
        )
        sampler = GlobalCursorSampler(num_train, plan, rank, args.seed, Cursor(), args.steps)
        batches = iter(
            build_loader(
                train_windows,
                sampler,
                dcfg.num_workers,
                dcfg.prefetch_factor,
                cuda,
                local_world_size=world,
            )
        )
        get_batch = lambda: to_device(*next(batches))  # noqa: E731

    torch.manual_seed(args.seed)
    model = build_gpt(mcfg).to(device)
    optimizer = build_adamw(model, ocfg)
    # nanoGPT's order: compile, then DDP wraps the compiled module (lockstep compiles in place,
    # also before DDP)
    compiled = torch.compile(model) if args.compile else model
    ddp_model = DDP(compiled, gradient_as_bucket_view=True) if world > 1 else compiled
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    result = train(args, ddp_model, model, optimizer, get_batch, autocast, accum, world, ocfg)

    if rank == 0:
        timed = args.steps - args.warmup
        marks, tokens_per_step = result.pop("marks"), args.batch_size * T
        # nan with --warmup 0: no log point starts the timed region
        elapsed = marks[args.steps] - marks[args.warmup] if args.warmup in marks else float("nan")
        result |= {
            "impl": "raw",
            "world_size": world,
            "precision": args.precision,
            "threads": torch.get_num_threads(),
            "device": args.device,
            "compile": args.compile,
            "micro_batch": micro,
            "grad_accum": accum,
            "tokens_per_step": tokens_per_step,
            "steps_timed": timed,
            "elapsed_s": elapsed,
            "tokens_per_s": timed * tokens_per_step / elapsed,
            "window_tokens_per_s": [
                args.log_interval * tokens_per_step / (marks[s] - marks[s - args.log_interval])
                for s in range(args.warmup + args.log_interval, args.steps + 1, args.log_interval)
                if s - args.log_interval in marks
            ],
            "flops_per_token": model.flops_per_token(),
            "params": model.num_params(),
            "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
            "features": args.features,
        }
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    del ddp_model, optimizer
    if world > 1:
        dist.destroy_process_group()


def train(
    args: argparse.Namespace,
    ddp_model: torch.nn.Module,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    get_batch,
    autocast,
    accum: int,
    world: int,
    ocfg: OptimConfig,
) -> dict:
    """`accum` micro-steps (DDP syncs on the last), clip, step; the host reads the loss at logs."""

    def lr_at(step: int) -> float:
        return lr_factor(step, args.steps, ocfg)

    scheduler = None
    if "scheduler" in args.features:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    device = next(model.parameters()).device
    window_loss = torch.zeros(())

    marks: dict[int, float] = {}
    losses: list[float] = []
    first_step_time = None
    prof_from, prof_to = (int(x) for x in args.profile.split(":")) if args.profile else (-1, -1)
    profiler = None
    for step in range(args.steps):
        if step == prof_from:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            profiler.start()
        if step == prof_to and profiler is not None:
            profiler.stop()
            profiler.export_chrome_trace(args.profile_out)
            profiler = None
        if scheduler is None:
            for group in optimizer.param_groups:
                group["lr"] = ocfg.learning_rate * lr_at(step)
        for micro_step in range(accum):
            x, y = get_batch()
            if world > 1:  # nanoGPT's way to skip the all-reduce on all but the last micro-step
                ddp_model.require_backward_grad_sync = micro_step == accum - 1
            with autocast:
                _, loss = ddp_model(x, y)
            # the step's gradient is the mean over its micro-batches
            (loss / accum if accum > 1 else loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ocfg.gradient_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if "metrics_cpu" in args.features:
            window_loss += loss.detach().float().cpu() + 0 * grad_norm.detach().float().cpu()
        if "stop_allreduce" in args.features and world > 1:
            flag = torch.tensor(
                [0.0], dtype=torch.float64, device=device if device.type == "cuda" else "cpu"
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            flag.item()
        done = step + 1
        if done == 1:
            loss.item()  # the first step has finished on the host (time to first step: bench_peers)
            first_step_time = time.time()
        if done % args.log_interval == 0:
            losses.append(loss.item())  # the only host read of the loss (the last micro-batch's)
            marks[done] = time.perf_counter()
    return {"marks": marks, "last_loss": losses[-1], "first_step_time": first_step_time}


if __name__ == "__main__":
    main()
