"""Step time of LoRA vs full fine-tuning of the tiny Llama (hidden 64, 2 layers) on 2 processes, side by side.

    python bench/bench_lora.py                  # 3 runs of each, alternating; rewrites its section of BENCHMARKS.md
    python bench/bench_lora.py --reps 1 --out -  # quick: print only

Both sides run `lockstep train` on the text ChatML example's data (examples/chatml_lora) (packed windows of 128 tokens,
per-device batch 2, bf16 autocast, 2 processes over gloo), differing only in model.use_lora.
Step time = global batch / samples per second over the logged windows after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_train import ROOT, _child_env, emit_section, machine_info, wait_quiet

BEGIN = "<!-- bench_lora:begin (written by bench/bench_lora.py; edits between the markers are replaced) -->"
END = "<!-- bench_lora:end -->"


def one_run(work: Path, lora: bool, steps: int, log_interval: int, tag: str) -> dict:
    run = work / f"run-{tag}"
    cmd = [
        str(Path(sys.executable).with_name("lockstep")),
        "train",
        "--config",
        str(ROOT / "examples" / "chatml_lora" / "config.yaml"),
        "--world-size",
        "2",
        "--model",
        str(work / "tiny-llama"),
        "--data",
        str(work / "data" / "train.jsonl"),
        "--output-dir",
        str(run),
        "--max-steps",
        str(steps),
        "--log-interval",
        str(log_interval),
        "--learning-rate",
        "1e-3",
        "--warmup-steps",
        "10",
        "--set",
        f"model.use_lora={str(lora).lower()}",
        "--set",
        "checkpoint.save_interval=0",
        "--set",
        "train.epochs=null",
    ]
    subprocess.run(cmd, cwd=work, env=_child_env(), check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split", "train") == "train" and "samples_per_s" in r][1:]
    sps = statistics.median(r["samples_per_s"] for r in train)
    state = json.loads(next((run / "checkpoints").glob("step_*/state.json")).read_text())
    global_batch = state["global_batch"]
    return {
        "lora": lora,
        "step_ms": 1000 * global_batch / sps,
        "tok_s": statistics.median(r["tokens_per_s"] for r in train),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--log-interval", type=int, default=20)
    p.add_argument(
        "--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file, or - to print only"
    )
    args = p.parse_args(argv)
    info = machine_info()
    sys.path.insert(0, str(ROOT / "examples" / "chatml_lora"))
    from prepare import main as prepare

    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare(work)
        for rep in range(args.reps):
            # alternating, so drift on this shared machine hits both sides
            for lora in (False, True):
                wait_quiet(limit=0.15, max_wait=120)
                results.append(one_run(work, lora, args.steps, args.log_interval, f"{rep}-{lora}"))
                print(results[-1], flush=True)
    full = [r["step_ms"] for r in results if not r["lora"]]
    lora = [r["step_ms"] for r in results if r["lora"]]
    med_full, med_lora = statistics.median(full), statistics.median(lora)
    command = "python bench/bench_lora.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        BEGIN,
        "## LoRA vs full fine-tuning: tiny Llama, 2 processes",
        "",
        f"- date: {info['date']}; `{command.strip()}`; lockstep at `{info['commit']}`",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); torch {info['torch']}",
        "- model: LlamaForCausalLM hidden 64, 2 layers, vocab ~300 (`lockstep.tools.tiny`), 0.13M params; LoRA r=8 on "
        "all linear layers (0.016M trainable); ChatML example data packed into 128-token windows, per-device batch 2, "
        f"bf16 autocast, gloo; {args.steps} steps per run, medians of the logged windows after the first",
        f"- runs alternate full, LoRA ({args.reps} of each)",
        "",
        "| mode | step time (ms, median) | per run (ms) | tokens/s (median) |",
        "|---|---|---|---|",
        f"| full fine-tuning | {med_full:.1f} | {', '.join(f'{x:.1f}' for x in full)} | "
        f"{statistics.median(r['tok_s'] for r in results if not r['lora']):,.0f} |",
        f"| LoRA | {med_lora:.1f} | {', '.join(f'{x:.1f}' for x in lora)} | "
        f"{statistics.median(r['tok_s'] for r in results if r['lora']):,.0f} |",
        "",
        f"LoRA / full step time: **{med_lora / med_full:.2f}**.",
        "",
        END,
    ]
    section = "\n".join(lines) + "\n"
    emit_section(section, args.out, BEGIN, END)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
