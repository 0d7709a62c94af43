"""What the always-on step clock (lockstep.train.step_clock) costs a step: its own work, timed
directly, against the step it measures.

    python bench/step_clock_cost.py            # the default GPT and the GPT-2-small shape (124M)
    python bench/step_clock_cost.py --model default

Per step the loop makes 8 laps, and under DDP each parameter's gradient hook reads the clock once.
Both are timed here on the models' real parameters (a backward of a one-element loss per parameter
fires the real hooks), 200 steps' worth, against one real training step of the same model on this
CPU (one process, fp32, the median of 5). Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from lockstep.config import ModelConfig
from lockstep.models.gpt import GPT
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("default", "124M"), action="append", help="(both)")
    args = p.parse_args()
    print(f"torch {torch.__version__}; `python {' '.join(sys.argv)}`")
    print(
        "| model | parameters watched | the clock, per step (µs) | a training step (ms) | share |"
    )
    print("|---|---|---|---|---|")
    for name, cfg in MODELS.items():
        if args.model and name.split(" ")[0] not in args.model:
            continue
        torch.manual_seed(0)
        model = GPT(cfg)
        cost, watched = clock_cost(model)
        step = step_time(GPT(cfg), cfg)
        print(f"| {name} | {watched} | {1e6 * cost:.0f} | {1000 * step:.0f} | {cost / step:.3%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
