"""The cost of DDP's find_unused_parameters, on the built-in GPT and on the custom TTS stand-in, 2 ranks side by side.

    python bench/bench_ddp.py                    # 3 runs of each, alternating; rewrites its BENCHMARKS.md section
    python bench/bench_ddp.py --reps 1 --out -   # quick: print only

lockstep chooses find_unused_parameters=True for every model but the built-in GPT (a rare branch would hang
plain DDP), and tells the user that false is faster when no batch can leave a parameter out. This measures by
how much. Every run is `lockstep train --world-size 2`; only parallel.find_unused_parameters differs:

- GPT: lockstep's default model on the embedded corpus, fp32; plain DDP is its default, find_unused forced on.
- TTS stand-in (examples/custom_conditioning): its data rewritten so every sample takes both branches (a
  prompt, the whispered style), so plain DDP is valid too; find_unused is its default, false forced on, which
  also runs lockstep's guard (one graph walk and one flag all-reduce per step).

Step time = global batch / samples per second over the logged windows after the first.
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

BEGIN = "<!-- bench_ddp:begin (written by bench/bench_ddp.py; edits between the markers are replaced) -->"
END = "<!-- bench_ddp:end -->"
TTS = ROOT / "examples" / "custom_conditioning"
CASES = {  # name: (model, find_unused setting, what it is)
    "gpt plain": ("gpt", "auto", "default: plain DDP"),
    "gpt find_unused": ("gpt", "true", "forced"),
    "tts find_unused": ("tts", "auto", "default: find_unused"),
    "tts plain": ("tts", "false", "forced, guarded"),
}


def tts_data(work: Path) -> Path:
    """The stand-in's rows, each with a prompt and the whispered style: every micro-batch uses every parameter."""
    sys.path.insert(0, str(TTS))
    import prepare

    path = prepare.main(work / "tts-all-branches")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for i, row in enumerate(rows):
        row["prompt"] = row["prompt"] or [i % 64] * 8
        row["style"] = "whisper"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_run(work: Path, name: str, data: Path, tag: str, gpt_steps: int) -> dict:
    model, setting, _ = CASES[name]
    run = work / f"run-{tag}"
    lockstep = str(Path(sys.executable).with_name("lockstep"))
    common = [
        "--world-size",
        "2",
        "--output-dir",
        str(run),
        "--eval-interval",
        "0",
        "--log-interval",
        "10",
        "--mixed-precision",
        "no",
        "--set",
        "checkpoint.save_interval=0",
        "--set",
        "checkpoint.resume=none",
        "--set",
        f"parallel.find_unused_parameters={setting}",
    ]
    if model == "gpt":
        cmd = [
            lockstep,
            "train",
            *common,
            "--max-steps",
            str(gpt_steps),
            "--set",
            "train.sample_tokens=0",
            "--set",
            "data.max_bytes=4000000",
            "--set",
            f"data.cache_dir={work / 'cache'}",
            "--peak-flops",
            "1e12",
        ]
        batch = 32
    else:
        cmd = [
            lockstep,
            "train",
            "--config",
            str(TTS / "config.yaml"),
            *common,
            "--data",
            str(data),
            "--set",
            "parallel.check_grads=false",
        ]
        batch = 16
    env = {**_child_env(), "PYTHONPATH": str(TTS)}
    subprocess.run(cmd, cwd=work, env=env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split", "train") == "train" and "samples_per_s" in r]
    timed = train[1:] or train
    return {
        "case": name,
        "step_ms": 1000 * batch / statistics.median(r["samples_per_s"] for r in timed),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--gpt-steps", type=int, default=40)
    p.add_argument(
        "--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file, or - to print only"
    )
    args = p.parse_args(argv)
    info = machine_info()
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = tts_data(work)
        for rep in range(args.reps):
            for name in CASES:  # alternating, so drift on this shared machine hits every case
                wait_quiet(limit=0.15, max_wait=120)
                results.append(
                    one_run(work, name, data, f"{rep}-{name.replace(' ', '-')}", args.gpt_steps)
                )
                print(results[-1], flush=True)
    command = "python bench/bench_ddp.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        BEGIN,
        "## DDP settings: the cost of find_unused_parameters, 2 ranks",
        "",
        f"- date: {info['date']}; `{command.strip()}`; lockstep at `{info['commit']}`",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); torch {info['torch']}",
        f"- GPT: the default model (3.2M params), global batch 32, fp32, {args.gpt_steps} steps; TTS stand-in: "
        "examples/custom_conditioning (0.04M params), global batch 16 = 2 x micro 4 x accum 2, fp32, 120 steps, every "
        f"sample taking both branches; gloo, 1 thread per rank; cases alternate, {args.reps} runs each",
        "",
        "| model | find_unused_parameters | step time (ms, median) | vs the other setting | per run (ms) |",
        "|---|---|---|---|---|",
    ]
    medians = {
        name: statistics.median(r["step_ms"] for r in results if r["case"] == name)
        for name in CASES
    }
    for name, (model, setting, what) in CASES.items():
        other = next(n for n, (m, s, _) in CASES.items() if m == model and n != name)
        per_run = ", ".join(f"{r['step_ms']:.1f}" for r in results if r["case"] == name)
        value = {"auto": "auto", "true": "true", "false": "false"}[setting]
        lines.append(
            f"| {model} | {value} ({what}) | {medians[name]:.1f} | {medians[name] / medians[other]:.3f} | "
            f"{per_run} |"
        )
    lines += ["", END]
    emit_section("\n".join(lines) + "\n", args.out, BEGIN, END)


if __name__ == "__main__":
    main()
