"""The same training job written the way an Accelerate 1.15 or a Lightning Fabric 2.6 user writes it.

bench_peers.py runs it side by side with `lockstep train` and bench/raw_loop.py. Everything that is not the
framework is shared and equal to lockstep's defaults: lockstep's GPT (ModelConfig()), the token windows of its
default corpus (TokenWindows, a DataLoader with 1 worker process and prefetch 4, shuffled, each rank its
shard), AdamW (fused, two weight-decay groups), warmup + cosine through LambdaLR, gradient clipping at
optim.gradient_clip_norm, bf16 autocast through the framework's own mixed-precision setting, and
`loss.item()` only at log points.

    python bench/peer_loop.py --framework accelerate --steps 90 --precision bf16                 # 1 process
    torchrun --standalone --nproc_per_node 2 bench/peer_loop.py --framework fabric --steps 90   # 2-process DDP

Under torchrun both frameworks find the process group's environment and start a gloo group on CPU: the
launcher is the same for every side of the comparison, so start-up is compared as well as throughput.
Throughput is timed as in raw_loop.py (log point at --warmup to log point at the last step); the time the
first optimizer step finished (wall clock, after a host read of its loss) is reported as `first_step_time`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from raw_loop import build_adamw, lr_factor  # the same optimizer and schedule as the raw loop's

from lockstep.config import DataConfig, ModelConfig, OptimConfig
from lockstep.data.sampler import available_cores, resolve_num_workers
from lockstep.data.text import TokenWindows, prepare_tokens
from lockstep.models.gpt import build_gpt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=("accelerate", "fabric"), required=True)
    p.add_argument("--steps", type=int, default=90, help="optimizer steps in all")
    p.add_argument(
        "--warmup", type=int, default=10, help="steps before the timed region (must be a log point)"
    )
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="global batch in sequences")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", help="write the result as JSON here (rank 0)")
    return p.parse_args(argv)


def build_job(world: int, args: argparse.Namespace):
    """(model, optimizer, scheduler, train windows, micro-batch) as lockstep's defaults make them."""
    mcfg, dcfg, ocfg = ModelConfig(), DataConfig(), OptimConfig()
    # a cache hit: the bench prepares it first
    cache = prepare_tokens(dcfg, seq_len=mcfg.max_seq_length)
    windows = TokenWindows(cache, mcfg.max_seq_length, "train", dcfg.eval_fraction)
    torch.manual_seed(args.seed)
    model = build_gpt(mcfg)
    optimizer = build_adamw(model, ocfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args.steps, ocfg)
    )
    return (
        model,
        optimizer,
        scheduler,
        windows,
        args.batch_size // world,
        ocfg.gradient_clip_norm,
        dcfg,
    )


def loader(
    windows: TokenWindows, micro: int, dcfg: DataConfig, seed: int, world: int
) -> torch.utils.data.DataLoader:
    """Shuffled; workers and prefetch as lockstep's data.num_workers (auto: by the cores per rank) and
    prefetch_factor; the framework shards it."""
    workers = resolve_num_workers(dcfg.num_workers, world, available_cores())[0]
    extra = {"prefetch_factor": dcfg.prefetch_factor, "persistent_workers": True} if workers else {}
    return torch.utils.data.DataLoader(
        windows,
        batch_size=micro,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(seed),
        **extra,
    )


def run_accelerate(args: argparse.Namespace) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(
        cpu=True, mixed_precision="bf16" if args.precision == "bf16" else "no"
    )
    model, optimizer, scheduler, windows, micro, clip, dcfg = build_job(
        accelerator.num_processes, args
    )
    data = loader(windows, micro, dcfg, args.seed, accelerator.num_processes)  # one node
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = model(x, y)  # prepare() wrapped forward in autocast
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    result = train(step, data, args, accelerator.process_index)
    accelerator.end_training()
    return result


def run_fabric(args: argparse.Namespace) -> dict:
    import lightning as L

    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    fabric = L.Fabric(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        precision="bf16-mixed" if args.precision == "bf16" else "32-true",
    )
    fabric.launch()  # under torchrun: joins the group torchrun's environment describes
    model, optimizer, scheduler, windows, micro, clip, dcfg = build_job(fabric.world_size, args)
    model, optimizer = fabric.setup(model, optimizer)
    # setup_dataloaders adds a DistributedSampler
    data = fabric.setup_dataloaders(loader(windows, micro, dcfg, args.seed, fabric.world_size))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = model(x, y)  # setup() wrapped forward in the precision plugin's autocast
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    result = train(step, data, args, fabric.global_rank)
    if fabric.world_size > 1:
        torch.distributed.destroy_process_group()
    return result


def train(step, data, args: argparse.Namespace, rank: int) -> dict:
    """Run `step` over `data` for args.steps steps (re-iterating epochs); time it as raw_loop.py does."""
    marks: dict[int, float] = {}
    losses: list[float] = []
    first_step_time = None
    done, epoch = 0, 0
    while done < args.steps:
        sampler = getattr(data, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for x, y in data:
            loss = step(x, y)
            done += 1
            if done == 1:
                loss.item()  # the first step has finished on the host
                first_step_time = time.time()
            if done % args.log_interval == 0:
                losses.append(loss.item())
                marks[done] = time.perf_counter()
            if done == args.steps:
                break
        epoch += 1
    timed = args.steps - args.warmup
    T = ModelConfig().max_seq_length
    result = {
        "impl": args.framework,
        "precision": args.precision,
        "threads": torch.get_num_threads(),
        "first_step_time": first_step_time,
        "last_loss": losses[-1] if losses else None,
    }
    if args.warmup in marks and args.steps in marks:
        elapsed = marks[args.steps] - marks[args.warmup]
        result.update(
            steps_timed=timed, elapsed_s=elapsed, tokens_per_s=timed * args.batch_size * T / elapsed
        )
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run_accelerate(args) if args.framework == "accelerate" else run_fabric(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
