"""GPT-2 124M on one GPU: `lockstep train` vs the raw loop (bench/raw_loop.py), side by side.

    python3 bench/gpu/gpt2.py --out bench.json              # a CUDA machine, ~6-7 min on an H100
    python3 bench/gpu/gpt2.py --quick --device cpu --out x  # the harness on a tiny model, ~30 s

Both sides train lockstep's GPT (12 layers, 768 wide, 12 heads, context 1024, vocab 50304) in bf16
autocast with fused AdamW on the same tokens per step, compile off and on. For each compile mode the
raw loop and lockstep run alternately, each in its own process, and both are timed over the same
steps: from the log point at --warmup to the one at --steps (sides.py says how each is read). MFU
divides model FLOPs/s (`GPT.flops_per_token()` x tokens/s) by a bf16 matmul peak measured in the
same job, in its own process before the runs (lockstep.peak_flops.measure_peak_flops at 8192^3,
best of 3). Peak memory is torch.cuda.max_memory_allocated on both sides.

Time: a run that is not expected to end within --budget-s (by the longest earlier run of the same
side and mode) is skipped and reported as skipped; every run's process is stopped at the budget
plus a minute. bench.json is rewritten after every run, so a SIGINT (run.sh's time limit) keeps
what has run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]
from report import render_bench  # noqa: E402
from sides import Sides, child_env  # noqa: E402

GPT2 = {
    "vocab_size": 50304,
    "hidden_size": 768,
    "layers": 12,
    "attention_heads": 12,
    "max_seq_length": 1024,
}
TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "layers": 2,
    "attention_heads": 2,
    "max_seq_length": 64,
}
# 32 x 1024 = 32,768 tokens per step as micro-batch 16 x 2 accumulation steps: a 16 x 1024 forward
# keeps an H100's matmuls large (16,384 rows); uncompiled, its activations (~0.5 MB a token over 12
# layers, ~8.5 GB) plus the logits (16,384 x 50,304 in bf16, again in fp32 for the loss, and their
# gradients: ~12 GB) and the weights with AdamW state (~2 GB) come to about 25 GB, a third of an
# H100; and the accumulation path is part of what is timed.
BATCH = {"global": 32, "micro": 16}
WHY_BATCH = (
    "a 16 x 1024 forward keeps the matmuls large while uncompiled activations and the fp32 "
    "logits (16 x 1,024 x 50,304) need about a third of 80 GB; the accumulation is timed too"
)
DATA_NOTE = (
    "the byte tokens of lockstep's embedded corpus (its default data): ids < 256 inside a "
    "{vocab:,} vocabulary; the compute does not depend on which ids the tokens are, so "
    "throughput and memory are those of the same model on any text (the loss is not GPT-2's)"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="harness smoke run: a tiny model (2 layers, 64 wide, vocab 512), 4 steps, "
        "compile off, fp32 (CPUs without AVX-512 emulate bf16 ~100x slower), "
        "1 run per side",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="default bf16; quick fp32")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 80; quick 4)")
    p.add_argument(
        "--warmup", type=int, help="untimed steps first, compile included (default 20; quick 2)"
    )
    p.add_argument("--log-interval", type=int, help="default 10; quick 2")
    p.add_argument("--reps", type=int, help="runs per side and compile mode (default 2; quick 1)")
    p.add_argument("--compile", choices=("off", "on", "both"), help="default both; quick off")
    p.add_argument(
        "--budget-s",
        type=float,
        default=400.0,
        help="skip a run expected to end after this many seconds",
    )
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    p.add_argument("--peak-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = {
        "steps": (80, 4),
        "warmup": (20, 2),
        "log_interval": (10, 2),
        "reps": (2, 1),
        "compile": ("both", "off"),
        "precision": ("bf16", "fp32"),
    }
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    sys.path.insert(0, str(ROOT / "bench"))
    from raw_loop import check_timed_steps  # torch with it: only once the arguments are parsed

    check_timed_steps(p, args)
    return args


# ----------------------------------------------------------------------------- peak and model


def peak_worker(args: argparse.Namespace) -> None:
    """Child mode: the best of 3 matmul peaks on the device, and the device's name, as JSON."""
    import torch

    from lockstep.peak_flops import cpu_model, measure_peak_flops, probe_size

    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()
    size = 256 if args.quick else probe_size(dev)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    seconds = 0.2 if args.quick else 1.0
    peaks = [measure_peak_flops(dev, dtype, size=size, seconds=seconds) for _ in range(3)]
    print(json.dumps({"device": name, "peaks": peaks, "size": size}))


def measure_peak(args: argparse.Namespace) -> dict:
    """In a process of its own, so that no CUDA context of ours stays beside the runs."""
    cmd = [
        sys.executable,
        __file__,
        "--peak-worker",
        "--device",
        args.device,
        "--precision",
        args.precision,
    ] + (["--quick"] if args.quick else [])
    print(f"$ {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"gpt2.py: the matmul peak measurement failed (exit {proc.returncode}; "
            "its output is above)"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def model_facts(shape: dict) -> dict:
    """Parameters and FLOPs per token of lockstep's GPT at `shape`, built on the meta device."""
    import torch

    from lockstep.config import ModelConfig
    from lockstep.models.gpt import build_gpt

    with torch.device("meta"):
        model = build_gpt(ModelConfig(**shape))
    return {**shape, "params": model.num_params(), "flops_per_token": model.flops_per_token()}


# ----------------------------------------------------------------------------- the runs


def run_bench(args: argparse.Namespace, argv: list[str]) -> dict:
    from lockstep.config import DataConfig
    from lockstep.data.text import prepare_tokens

    start = time.monotonic()
    shape = TINY if args.quick else GPT2
    batch = {"global": 8, "micro": 4} if args.quick else dict(BATCH)
    prepare_tokens(DataConfig(), seq_len=shape["max_seq_length"])  # once, before any timed run
    peak = measure_peak(args)
    print(
        f"{peak['device']}: {args.precision} matmul peak {max(peak['peaks']) / 1e12:,.3f} TFLOP/s",
        flush=True,
    )
    sides = Sides(
        device=args.device,
        precision=args.precision,
        shape=shape,
        global_batch=batch["global"],
        micro_batch=batch["micro"],
        steps=args.steps,
        warmup=args.warmup,
        log_interval=args.log_interval,
        peak_flops=max(peak["peaks"]),
    )
    batch |= {
        "accum": batch["global"] // batch["micro"],
        "tokens_per_step": sides.tokens_per_step,
        "why": "a tiny smoke run" if args.quick else WHY_BATCH,
    }
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    order = ", ".join(f"raw, lockstep (compile {'on' if m else 'off'})" for m in modes)
    bench = {
        "quick": args.quick,
        "device": peak["device"],
        "device_type": args.device,
        "peak_flops": sides.peak_flops,
        "peak_runs": peak["peaks"],
        "peak_size": peak["size"],
        "model": model_facts(shape),
        "batch": batch,
        "precision": args.precision,
        "data_note": DATA_NOTE.format(vocab=shape["vocab_size"]),
        "steps": args.steps,
        "warmup": args.warmup,
        "log_interval": args.log_interval,
        "compile_modes": modes,
        "reps": args.reps,
        "budget_s": args.budget_s,
        "order": f"per repetition: {order}",
        "commands": sides.shown(),
        "allocator": sides.allocator(),
        "runs": [],
        "command": "python3 bench/gpu/gpt2.py" + (" " + shlex.join(argv) if argv else ""),
    }
    try:
        run_all(bench, sides, args, start)
    except KeyboardInterrupt:  # run.sh's time limit: what has run is kept, and said to be all
        bench["interrupted"] = "stopped by SIGINT (a time limit): the runs not listed did not run"
    bench["wall_s"] = time.monotonic() - start
    save(bench, args.out)
    return bench


def run_all(bench: dict, sides: Sides, args: argparse.Namespace, start: float) -> None:
    """Per repetition, raw then lockstep per compile mode; a run not expected to fit is skipped."""
    walls: dict[tuple[str, bool], float] = {}  # the longest run so far of each side and mode
    for rep in range(1, args.reps + 1):
        for compiled in bench["compile_modes"]:
            for impl in ("raw", "lockstep"):
                elapsed = time.monotonic() - start
                if elapsed + walls.get((impl, compiled), 0.0) > args.budget_s:
                    status = f"skipped: time budget {args.budget_s:.0f} s"
                    run = {"impl": impl, "compile": compiled, "status": status}
                else:
                    run = sides.run(impl, compiled, timeout=max(30.0, args.budget_s + 60 - elapsed))
                    walls[(impl, compiled)] = max(walls.get((impl, compiled), 0.0), run["wall_s"])
                bench["runs"].append({**run, "rep": rep})
                bench["wall_s"] = time.monotonic() - start
                save(bench, args.out)  # a time limit that stops us keeps every run so far
                speed = (
                    f"{run['tokens_per_s']:12,.0f} tok/s  wall {run['wall_s']:5.0f} s"
                    if run["status"] == "ok"
                    else ""
                )
                print(
                    f"  rep {rep} compile {'on ' if compiled else 'off'} {impl:<8} "
                    f"{run['status']:<10} {speed}",
                    flush=True,
                )


def save(bench: dict, out: Path | None) -> None:
    if out:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(bench, indent=1) + "\n")
        tmp.replace(out)  # never a half-written bench.json


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.peak_worker:
        peak_worker(args)
        return 0
    # SIGINT is the time limit's signal: a KeyboardInterrupt here even when whoever started us (a
    # background shell) passed it on ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    bench = run_bench(args, argv)
    print("\n" + "\n".join(render_bench(bench)))
    # skipped for time is reported, not an error; a run that failed or was stopped is
    broken = [
        r for r in bench["runs"] if r["status"] != "ok" and not r["status"].startswith("skip")
    ]
    return 1 if broken or bench.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
