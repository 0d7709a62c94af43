"""Gradient compression on a slow link: step time and bytes on two throttled namespace "nodes", and loss parity.

    python bench/bench_compression.py                                  # full run, writes its BENCHMARKS.md section
    python bench/bench_compression.py --rates 1gbit --settings none,bf16 --no-buckets --no-parity --out -

Two "nodes" are network namespaces joined by a veth pair (tests/netns.py); tc tbf holds each direction to the rate
(netem is missing from these kernels). Each node runs `lockstep launch --nnodes 2`, one process with one thread:
two one-core machines. The model is the built-in GPT at ~25M parameters (hidden 512, 8 heads, 8 layers, seq 128,
byte vocabulary 256) in fp32, so a step's gradients are 4 bytes a parameter, global batch 8 (micro-batch 4 a rank).

- step time: from the `time` of consecutive train records in metrics.jsonl (log_interval 1), median over steps
  --skip+1.. (the first steps: DDP's bucket rebuild, and PowerSGD's plain all-reduce before powersgd_start_step 2);
- bytes per step: both veth ends' transmit counters, sampled every 20 ms, between the records of those steps
  (frames with their headers: this is what the link carries);
- communication time: the step time minus the same setting's step time on the same namespace pair without tbf
  (the veth then moves ~2 GB/s, so that run is compute plus the compression's own work); it is the communication
  backward could not hide. "wire" is the bound bytes / 2 directions / the rate measured by one TCP stream;
- bucket size and gradient_as_bucket_view, uncompressed, on the 1 Gbit/s link;
- loss parity: `lockstep train --world-size 2` on this host (the arithmetic does not depend on the link) with the
  default GPT (3.2M), same seed and data, --parity-steps steps; train loss of the last log window and eval loss.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_train import ROOT, ForeignLoad, _child_env, emit_section, machine_info, wait_quiet

sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402  (tests/netns.py: the two-namespace link)

BEGIN = "<!-- bench_compression:begin (written by bench/bench_compression.py; edits between the markers are replaced) -->"
END = "<!-- bench_compression:end -->"
SETTINGS = ("none", "bf16", "fp16", "powersgd")
MODEL = {"hidden_size": 512, "attention_heads": 8, "layers": 8, "max_seq_length": 128}
# beside the default (25.0, True): the 1 Gbit/s "none" run
BUCKETS = ((5.0, True), (100.0, True), (25.0, False))
_ports = iter(range(29500 + os.getpid() % 200, 65000, 7))


def write_config(path: Path, work: Path, steps: int) -> Path:
    model = ", ".join(f"{k}: {v}" for k, v in MODEL.items())
    path.write_text(
        "\n".join(
            [
                f"model: {{{model}}}",
                f"train: {{max_steps: {steps}, batch_size: 8, sample_tokens: 0, log_interval: 1, eval_interval: 0, "
                # the straggler watch's link probe would add its own bytes to the ones counted
                "eval_batches: 1, mixed_precision: 'no', peak_flops: 1.0e12, probe_links: false}",
                f"data: {{num_workers: 0, max_bytes: 4000000, cache_dir: '{work / 'cache'}'}}",
                "checkpoint: {save_interval: 0, resume: none}",
                "parallel: {powersgd_start_step: 2}",
            ]
        )
        + "\n"
    )  # the default rank; compressed from step 3 on
    return path


def link_run(link: netns.Link, cfg: Path, run: Path, sets: dict[str, str], skip: int) -> dict:
    """One 2-node job on `link`: median step time, bytes per step over the measured steps, parameters."""
    over = [
        a
        for k, v in {"checkpoint.output_dir": str(run), **sets}.items()
        for a in ("--set", f"{k}={v}")
    ]
    port = next(_ports)
    cmds = tuple(
        [
            sys.executable,
            "-m",
            "lockstep",
            "launch",
            str(cfg),
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--rdzv-endpoint",
            f"{link.a.addr}:{port}",
            "--rdzv-timeout",
            "60",
            *over,
        ]
        for rank in (0, 1)
    )
    env = {**_child_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    wait_quiet(limit=0.15, max_wait=120)
    with ForeignLoad() as load, netns.ByteMeter(link) as meter:
        netns.run_on_both(link, cmds, timeout=900, env=env)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    t = {r["step"]: r["time"] for r in records if r["split"] == "train"}
    last = max(t)
    log = (run / "logs" / "rank0.log").read_text()
    return {
        "step_s": statistics.median(t[s] - t[s - 1] for s in range(skip + 1, last + 1)),
        "bytes": (meter.bytes_at(t[last]) - meter.bytes_at(t[skip])) / (last - skip),
        "params": re.search(r"GPT ([\d.]+M) params", log)[1],
        "foreign": load.share,
        "compression": (re.search(r"grad compression: ([^\n]*)", log) or [None, "(no log line)"])[
            1
        ],
    }


def least_disturbed(run, args: argparse.Namespace) -> dict:
    """run(attempt) until other processes took at most --max-foreign of the CPUs during it (up to --retries more
    times); the least disturbed result. The machine is shared: a test run beside a 2-core bench doubles its steps."""
    best = None
    for attempt in range(args.retries + 1):
        r = run(attempt)
        if best is None or r["foreign"] < best["foreign"]:
            best = r
        if r["foreign"] <= args.max_foreign:
            break
        print(
            f"    (other processes took {100 * r['foreign']:.0f}% of the CPUs: again)", flush=True
        )
    return best


def parity_run(work: Path, setting: str, steps: int, rank: int = 32) -> dict:
    run = work / f"parity-{setting}-{rank}"
    cmd = [
        sys.executable,
        "-m",
        "lockstep",
        "train",
        "--world-size",
        "2",
        "--output-dir",
        str(run),
        "--max-steps",
        str(steps),
        "--global-batch-size",
        "16",
        "--log-interval",
        "50",
        "--eval-interval",
        "0",
        "--save-interval",
        "0",
        "--resume",
        "none",
        "--mixed-precision",
        "no",
        "--set",
        "train.sample_tokens=0",
        "--set",
        "data.max_bytes=4000000",
        "--set",
        f"data.cache_dir={work / 'cache'}",
        "--set",
        f"parallel.grad_compression={setting}",
        "--set",
        f"parallel.powersgd_rank={rank}",
    ]  # default start step
    wait_quiet(limit=0.15, max_wait=120)
    subprocess.run(
        cmd, cwd=work, env=_child_env(), check=True, capture_output=True, text=True, timeout=1800
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    return {
        "train_loss": train[-1]["loss"],
        "eval_loss": next(r["loss"] for r in records if r["split"] == "eval"),
    }


def measure(args: argparse.Namespace, work: Path) -> tuple[dict, dict]:
    """(runs keyed by (rate, setting-or-bucket label), measured link rates in bytes/s)."""
    runs: dict[tuple[str, str], list[dict]] = {}
    rates: dict[str, float] = {}
    cfg = write_config(work / "c.yaml", work, args.steps)
    for rate in ["unthrottled", *args.rates]:
        with netns.two_nodes(None if rate == "unthrottled" else rate) as link:
            rates[rate] = netns.measure_rate(link, seconds=2.0, port=next(_ports))
            print(f"link {rate}: one TCP stream moves {rates[rate] / 1e6:.1f} MB/s", flush=True)
            cases = [(s, {"parallel.grad_compression": s}) for s in args.settings]
            if rate == "1gbit" and args.buckets:
                cases += [
                    (
                        f"none, bucket {cap:g} MB, view {str(view).lower()}",
                        {
                            "parallel.bucket_cap_mb": str(cap),
                            "parallel.gradient_as_bucket_view": str(view).lower(),
                        },
                    )
                    for cap, view in BUCKETS
                ]
            for rep in range(args.reps):
                for (
                    label,
                    sets,
                ) in cases:  # alternating, so drift on this shared machine hits every case
                    tag = f"{rate}-{len(runs)}-{rep}-{label.split(',')[0]}"
                    r = least_disturbed(
                        lambda n: link_run(link, cfg, work / f"{tag}-{n}", sets, args.skip), args
                    )
                    runs.setdefault((rate, label), []).append(r)
                    print(
                        f"  {rate:>11} {label:<34} step {r['step_s']:6.3f} s  {r['bytes'] / 1e6:7.2f} MB/step  "
                        f"{r['params']} params  foreign {100 * r['foreign']:4.1f}%  [{r['compression']}]",
                        flush=True,
                    )
    return runs, rates


def render(
    runs: dict, rates: dict, parity: dict, args: argparse.Namespace, info: dict, command: str
) -> str:
    med = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
    sent = {k: statistics.median(r["bytes"] for r in v) for k, v in runs.items()}
    params = next(iter(runs.values()))[0]["params"]
    lines = [
        BEGIN,
        "## Gradient compression on a throttled two-node link",
        "",
        f"- date: {info['date']}; `{command.strip()}`; lockstep at `{info['commit']}`",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); torch {info['torch']}",
        f"- two network namespaces joined by a veth pair, tc tbf on both ends; one process (1 thread) per namespace "
        f"node; GPT {params} params ({', '.join(f'{k} {v}' for k, v in MODEL.items())}, vocab 256), fp32, global "
        f"batch 8, {args.steps} steps, medians over steps {args.skip + 1}-{args.steps}; powersgd rank 32 (the "
        "default), start step 2; "
        f"{args.reps} run(s) per case. Link rate = one TCP stream's payload: "
        + ", ".join(f"{k} {v / 1e6:.1f} MB/s" for k, v in rates.items()),
        "- comm = step time minus the same setting's step time without tbf (exposed communication: what backward did "
        "not hide); wire = bytes per step / 2 directions / link rate (the time the bytes alone need); others' CPU = "
        "share of the CPUs other processes took during the run (a run above --max-foreign is repeated, the least "
        "disturbed kept)",
        "",
        "| link | grad_compression | step (s) | vs none | MB/step (both ways) | vs none | comm (s) | vs none | "
        "wire (s) | others' CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in rates:
        for s in args.settings:
            k, base = (rate, s), (rate, "none")
            if k not in med:
                continue
            comm = med[k] - med.get(("unthrottled", s), float("nan"))
            comm_none = med.get(base, float("nan")) - med.get(("unthrottled", "none"), float("nan"))
            lines.append(
                f"| {rate} | {s} | {med[k]:.3f} | {med[k] / med.get(base, float('nan')):.2f} | "
                f"{sent[k] / 1e6:.1f} | {sent[k] / sent.get(base, float('nan')):.3f} | "
                + (
                    f"{comm:.3f} | {comm / comm_none:.2f} | "
                    if rate != "unthrottled"
                    else "- | - | "
                )
                + f"{sent[k] / 2 / rates[rate]:.3f} | {100 * max(r['foreign'] for r in runs[k]):.0f}% |"
            )
    buckets = [k for k in runs if "bucket" in k[1]]
    if buckets:
        lines += [
            "",
            "Bucket size and gradient_as_bucket_view, grad_compression none, 1 Gbit/s link:",
            "",
            "| bucket_cap_mb, gradient_as_bucket_view | step (s) | vs 25 MB, view true | MB/step |",
            "|---|---|---|---|",
        ]
        base = ("1gbit", "none")
        for k in [base, *buckets]:
            label = "25 MB, view true (default)" if k == base else k[1].split("bucket ")[1]
            lines.append(
                f"| {label} | {med[k]:.3f} | {med[k] / med[base]:.3f} | {sent[k] / 1e6:.1f} |"
            )
    if parity:
        lines += [
            "",
            f"Loss parity: `lockstep train --world-size 2` on one host (the arithmetic does not depend on the "
            f"link), default GPT (3.2M), fp32, global batch 16, {args.parity_steps} steps, seed 1337, same data; "
            "powersgd start step 10 (the default):",
            "",
            "| grad_compression | train loss (last 50 steps) | eval loss | eval vs none |",
            "|---|---|---|---|",
        ]
        for s, p in parity.items():
            rel = (
                (p["eval_loss"] - parity["none"]["eval_loss"]) / parity["none"]["eval_loss"]
                if "none" in parity
                else 0
            )
            lines.append(
                f"| {s} | {p['train_loss']:.4f} | {p['eval_loss']:.4f} | {100 * rel:+.2f}% |"
            )
        if "none" in parity and len(parity) > 1:
            rel = {
                k: abs(p["eval_loss"] / parity["none"]["eval_loss"] - 1)
                for k, p in parity.items()
                if k != "none"
            }
            half = [v for k, v in rel.items() if not k.startswith("powersgd")]
            lines += [
                "",
                "Largest relative difference of the final eval loss from none: "
                + "; ".join(
                    [f"bf16/fp16 {100 * max(half):.2f}%"] * bool(half)
                    + [f"{k} {100 * v:.2f}%" for k, v in rel.items() if k.startswith("powersgd")]
                ),
            ]
    return "\n".join(lines + ["", END]) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--rates",
        default="1gbit,100mbit",
        help="tc rates, comma-separated (an unthrottled run comes first)",
    )
    p.add_argument(
        "--settings", default=",".join(SETTINGS), help="grad_compression settings, comma-separated"
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--skip",
        type=int,
        default=3,
        help="steps left out of the medians (compression starts at 3)",
    )
    p.add_argument("--reps", type=int, default=1)
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="share of the CPUs others may take during a run",
    )
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--parity-steps", type=int, default=300)
    p.add_argument(
        "--parity-ranks",
        default="32,4",
        help="powersgd_rank values of the parity runs (32: the default)",
    )
    p.add_argument("--no-buckets", dest="buckets", action="store_false")
    p.add_argument("--no-parity", dest="parity", action="store_false")
    p.add_argument(
        "--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file, or - to print only"
    )
    args = p.parse_args(argv)
    args.rates = [r for r in args.rates.split(",") if r]
    args.settings = [s for s in args.settings.split(",") if s]
    args.parity_ranks = [int(r) for r in args.parity_ranks.split(",") if r]
    if "none" not in args.settings:
        args.settings.insert(0, "none")  # every ratio is against it
    info = machine_info()
    print(
        f"{info['date']}  {info['cpu']} ({info['cores']} cores, {info['isa']})  torch {info['torch']}",
        flush=True,
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_compression.") as tmp:
        work = Path(tmp)
        runs, rates = measure(args, work)
        parity = {}
        cases = [(s, 32) for s in args.settings if s != "powersgd"]
        cases += [("powersgd", r) for r in args.parity_ranks if "powersgd" in args.settings]
        for s, r in cases if args.parity else []:
            label = f"powersgd rank {r}" if s == "powersgd" else s
            parity[label] = parity_run(work, s, args.parity_steps, r)
            s = label
            print(
                f"  parity {s:<16} train {parity[s]['train_loss']:.4f}  eval {parity[s]['eval_loss']:.4f}",
                flush=True,
            )
    section = render(
        runs, rates, parity, args, info, "python bench/bench_compression.py " + " ".join(argv)
    )
    emit_section(section, args.out, BEGIN, END)
    print(f"total {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
