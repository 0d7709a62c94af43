"""Peak memory per rank and step time of ddp vs fsdp vs tensor parallel on 2 ranks, side by side.

    python bench/bench_parallel.py                   # 2 runs of each, alternating; rewrites its BENCHMARKS.md section
    python bench/bench_parallel.py --reps 1 --out -  # quick: print only

Every run is `lockstep train --world-size 2` on the embedded corpus with the same GPT (wider than the
default so that model state, not the Python process, dominates memory), the same global batch and
seed; only parallel.* differs. Step time = global batch / samples per second over the logged windows
after the first. Memory, the larger of the two ranks: the model state it holds between steps (parameters and
optimizer state: its shards only), and its peak resident set (on CPU this includes Python, torch's
libraries, activations and whatever the allocator kept; compare differences between rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_train import ROOT, _child_env, emit_section, machine_info, wait_quiet

BEGIN = "<!-- bench_parallel:begin (written by bench/bench_parallel.py; edits between the markers are replaced) -->"
END = "<!-- bench_parallel:end -->"
MODEL = [
    "--hidden-size",
    "512",
    "--attention-heads",
    "8",
    "--layers",
    "6",
    "--max-seq-length",
    "128",
]
LAYOUTS = {
    "ddp": [],
    "fsdp": ["--set", "parallel.data_parallel=fsdp"],
    "tp=2": ["--set", "parallel.tensor_parallel=2"],
}


def one_run(work: Path, name: str, steps: int, log_interval: int, precision: str, tag: str) -> dict:
    run = work / f"run-{tag}"
    cmd = [
        str(Path(sys.executable).with_name("lockstep")),
        "train",
        "--world-size",
        "2",
        *MODEL,
        "--global-batch-size",
        "16",
        "--max-steps",
        str(steps),
        "--log-interval",
        str(log_interval),
        "--mixed-precision",
        precision,
        "--output-dir",
        str(run),
        "--eval-interval",
        "0",
        "--set",
        "checkpoint.save_interval=0",
        "--set",
        "train.sample_tokens=0",
        "--set",
        "data.max_bytes=4000000",
        "--set",
        f"data.cache_dir={work / 'cache'}",
        "--peak-flops",
        "1e12",
        *LAYOUTS[name],
    ]
    subprocess.run(cmd, cwd=work, env=_child_env(), check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split", "train") == "train" and "samples_per_s" in r]
    timed = train[1:] or train
    return {
        "layout": name,
        "step_ms": 1000 * 16 / statistics.median(r["samples_per_s"] for r in timed),
        "peak_mb": max(r["peak_mem_mb"] for r in train),
        "state_mb": max(r["state_mb"] for r in train),
        "loss": train[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--precision", default="no", choices=["no", "bf16"])
    p.add_argument(
        "--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file, or - to print only"
    )
    args = p.parse_args(argv)
    info = machine_info()
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rep in range(args.reps):
            for name in LAYOUTS:  # alternating, so drift on this shared machine hits every layout
                wait_quiet(limit=0.15, max_wait=120)
                results.append(
                    one_run(
                        work, name, args.steps, args.log_interval, args.precision, f"{rep}-{name}"
                    )
                )
                print(results[-1], flush=True)
    command = "python bench/bench_parallel.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    base_ms = statistics.median(r["step_ms"] for r in results if r["layout"] == "ddp")
    base_mb = statistics.median(r["peak_mb"] for r in results if r["layout"] == "ddp")
    lines = [
        BEGIN,
        "## ddp vs fsdp vs tensor parallel: 2 ranks",
        "",
        f"- date: {info['date']}; `{command.strip()}`; lockstep at `{info['commit']}`",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); torch {info['torch']}",
        "- model: GPT hidden 512, 8 heads, 6 layers, seq 128, byte vocab (19.1M params: fp32 weights 73 MB + AdamW "
        "146 MB = 219 MB of model state between steps, unsharded); global batch 16, "
        f"{'fp32' if args.precision == 'no' else 'bf16 autocast'}, gloo, 1 thread per rank; {args.steps} steps per "
        f"run; layouts alternate, {args.reps} runs each",
        "",
        "| layout | step time (ms, median) | vs ddp | model state per rank (MB) | peak resident memory, fullest rank "
        "(MB, median) | vs ddp (MB) | per run (ms / MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in LAYOUTS:
        runs = [r for r in results if r["layout"] == name]
        ms, mb = (
            statistics.median(r["step_ms"] for r in runs),
            statistics.median(r["peak_mb"] for r in runs),
        )
        per_run = ", ".join(f"{r['step_ms']:.0f} / {r['peak_mb']:,.0f}" for r in runs)
        state = statistics.median(r["state_mb"] for r in runs)
        lines.append(
            f"| {name} | {ms:.0f} | {ms / base_ms:.2f} | {state:,.0f} | {mb:,.0f} | {mb - base_mb:+,.0f} | "
            f"{per_run} |"
        )
    lines += ["", END]
    section = "\n".join(lines) + "\n"
    emit_section(section, args.out, BEGIN, END)


if __name__ == "__main__":
    main()
