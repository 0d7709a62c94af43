"""What the always-on step clock (lockstep.train.step_clock) costs a step: its own work, timed
directly, against the step it measures.

    python bench/step_clock_cost.py            # the default GPT and the GPT-2-small shape (124M)
    python bench/step_clock_cost.py --model default

Per step the loop makes 8 laps, and under DDP each parameter's gradient hook reads the clock once.
Both are timed here on the models' real parameters (a backward of a one-element loss per parameter
fires the real hooks), 200 steps' worth, against one real training step of the same model on this
CPU (one process, fp32, the median of 5). Under FSDP and TP each wait in a collective is timed
instead (lockstep.train.collective_waits): the waits of one step are counted on 2 real gloo ranks
with lockstep's own layouts, and the timing's cost per wait is timed around a wait that returns at
once. Prints two tables; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lockstep.config import ModelConfig
from lockstep.models.gpt import GPT
from lockstep.train.collective_waits import timed_wait, timed_waits
from lockstep.train.step_clock import StepClock

MODELS = {
    "default GPT (3.2M)": ModelConfig(
        vocab_size=256, hidden_size=256, attention_heads=8, layers=4, max_seq_length=128
    ),
    "124M": ModelConfig(
        vocab_size=50304, hidden_size=768, attention_heads=12, layers=12, max_seq_length=64
    ),
}
STEPS = 200


def clock_cost(model: torch.nn.Module) -> tuple[float, int]:
    """(seconds per step of the clock's own work: 8 laps and one hook call per parameter, the
    number of parameters watched)."""
    params = [p for p in model.parameters() if p.requires_grad]
    clock = StepClock(torch.device("cpu"), watch=params)
    hooks = [h for p in params for h in p._post_accumulate_grad_hooks.values()]
    began = time.perf_counter()
    for _ in range(STEPS):
        for _phase in ("other", "data"):
            clock.lap(_phase)
        for p, hook in zip(params, hooks):
            hook(p)
        clock.lap_backward()
        for _phase in ("optimizer", "checkpoint", "comm", "checkpoint"):
            clock.lap(_phase)
        clock.step_done()
    return (time.perf_counter() - began) / STEPS, len(params)


def step_time(model: torch.nn.Module, cfg: ModelConfig, batch: int = 8) -> float:
    """The median of 5 real training steps (forward, backward, AdamW) after one untimed."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_length))
    times = []
    for i in range(6):
        began = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def wait_cost(calls: int = 100_000) -> float:
    """Seconds the timing adds to one wait: a wait that returns at once, timed and bare."""

    def bare() -> None:
        return None

    timed = timed_wait(bare, threading.get_ident(), lambda _s: None)
    costs = []
    for fn in (timed, bare):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        costs.append((time.perf_counter() - began) / calls)
    return max(costs[0] - costs[1], 0.0)


def _count_waits(rank: int, store: str, cfg: ModelConfig, out) -> None:
    """One rank of two: a step under FSDP and one under TP (lockstep's apply_fsdp, apply_tp), each
    one's waits counted."""
    from torch.distributed.device_mesh import init_device_mesh

    from lockstep.parallel.fsdp import apply_fsdp
    from lockstep.parallel.tp import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_length))
    for layout, apply in (("fsdp", apply_fsdp), ("tp", apply_tp)):
        torch.manual_seed(0)
        model = GPT(cfg)
        apply(model, mesh)
        waits: list[float] = []
        for _ in range(2):  # the second step counted: the first may set things up
            waits.clear()
            with timed_waits(torch.device("cpu"), waits.append):
                _, loss = model(x, x)
                loss.backward()
        if rank == 0:
            out.put((layout, len(waits)))
    dist.destroy_process_group()


def waits_per_step(cfg: ModelConfig) -> dict[str, int]:
    """The waits in collectives of one forward and backward under FSDP and under TP, on 2 real gloo
    ranks."""
    # forks of this process, before it has run any op (main counts first): no import again, and
    # no intra-op thread pool yet to be lost across the fork
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_count_waits, args=(r, store, cfg, out)) for r in range(2)]
        for proc in procs:
            proc.start()
        counts = dict(out.get(timeout=300) for _ in range(2))
        for proc in procs:
            proc.join(60)
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("default", "124M"), action="append", help="(both)")
    args = p.parse_args()
    print(f"torch {torch.__version__}; `python {' '.join(sys.argv)}`")
    print(
        "| model | parameters watched | the clock, per step (µs) | a training step (ms) | share |"
    )
    print("|---|---|---|---|---|")
    names = [n for n in MODELS if not args.model or n.split(" ")[0] in args.model]
    waits = {name: waits_per_step(MODELS[name]) for name in names}  # first: see waits_per_step
    steps = {}
    for name in names:
        cfg = MODELS[name]
        torch.manual_seed(0)
        model = GPT(cfg)
        cost, watched = clock_cost(model)
        step = step_time(GPT(cfg), cfg)
        print(f"| {name} | {watched} | {1e6 * cost:.0f} | {1000 * step:.0f} | {cost / step:.3%} |")
        steps[name] = step
    per_wait = wait_cost()
    print(f"\nUnder FSDP and TP: the timing of a wait costs {1e9 * per_wait:.0f} ns.")
    print("| model | layout | waits per step (2 ranks) | the timing, per step (µs) | share |")
    print("|---|---|---|---|---|")
    for name, step in steps.items():
        for layout, n in waits[name].items():
            cost = n * per_wait
            print(f"| {name} | {layout} | {n} | {1e6 * cost:.1f} | {cost / step:.4%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
