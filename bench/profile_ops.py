"""Where lockstep's step time differs from the raw loop's: a torch.profiler op table of both, side by side.

    python bench/profile_ops.py                       # 1 process, bf16, steps 30..60 profiled; prints the table
    python bench/profile_ops.py --nproc 2 --precision fp32 --out BENCHMARKS.md

Both sides train the same job as bench_train.py (lockstep's default GPT, global batch 32): `lockstep train`
with `train.profile_steps` and bench/raw_loop.py with `--profile`, the same steps, each under `perf stat`
for the counters this machine has (hardware counters are often not exposed in a VM: they then read "not
supported"; the software ones, task-clock, context switches, CPU migrations and page faults, always work).
The runs alternate raw, lockstep, raw, lockstep (--reps each); the table sums the profiled ops of all of a
side's runs, so noise shows as a spread in every op at once and a real difference in a few.

Per op (`cpu_op` events of rank 0's trace): calls per step and inclusive milliseconds per step, lockstep
over raw. The step total is the profiled window's wall time per step.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
from pathlib import Path

import bench_train as bt

MARK_BEGIN = "<!-- profile_ops:begin (written by bench/profile_ops.py; edits between the markers are replaced) -->"
MARK_END = "<!-- profile_ops:end -->"
COUNTERS = "task-clock,context-switches,cpu-migrations,page-faults,cycles,instructions"


def traced(cmd: list[str], work: Path) -> dict[str, float]:
    """Run cmd under `perf stat` (when there is one); its counters, summed over the process tree."""
    stat = work / "perf.csv"
    perf = shutil.which("perf")
    full = [perf, "stat", "-x", ",", "-o", str(stat), "-e", COUNTERS, "--", *cmd] if perf else cmd
    bt._run(full, work)
    counters: dict[str, float] = {}
    if perf and stat.exists():
        for line in stat.read_text().splitlines():
            parts = line.split(",")
            if len(parts) > 2 and not line.startswith("#"):
                value, event = parts[0], parts[2]
                counters[event] = (
                    float(value) if value.replace(".", "", 1).isdigit() else float("nan")
                )
    return counters


def op_table(trace: Path, steps: int) -> tuple[dict[str, tuple[float, float]], float]:
    """{op: (calls per step, inclusive ms per step)} of the trace's CPU ops, and its wall ms per step."""
    events = json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in ops:
        totals[e["name"]][0] += 1
        totals[e["name"]][1] += e["dur"] / 1000
    start = min(e["ts"] for e in ops)
    end = max(e["ts"] + e["dur"] for e in ops)
    return {name: (n / steps, ms / steps) for name, (n, ms) in totals.items()}, (
        end - start
    ) / 1000 / steps


def run_side(
    impl: str, args: argparse.Namespace, work: Path
) -> tuple[dict, float, dict[str, float]]:
    a, b = args.window
    if impl == "raw":
        cmd = [
            sys.executable,
            str(bt.RAW_LOOP),
            "--steps",
            str(args.steps),
            "--warmup",
            "10",
            "--log-interval",
            "10",
            "--batch-size",
            str(bt.GLOBAL_BATCH),
            "--precision",
            args.precision,
            "--profile",
            f"{a}:{b}",
            "--profile-out",
            str(work / "raw.trace.json"),
        ]
        if args.nproc > 1:
            cmd = [bt._bin("torchrun"), "--standalone", f"--nproc_per_node={args.nproc}", *cmd[1:]]
        trace = work / "raw.trace.json"
    else:
        cmd = bt.lockstep_command(args.nproc, args.precision, args.steps, 10, str(work / "run"))
        cmd = [bt._bin(cmd[0]), *cmd[1:], "--profile-steps", f"{a}:{b}"]
        trace = work / "run" / "profile" / f"rank0.steps{a}-{b}.pt.trace.json"
    counters = traced(cmd, work)
    table, wall = op_table(trace, b - a)
    return table, wall, counters


def render(
    rows: dict, walls: dict, counters: dict, args: argparse.Namespace, info: dict, command: str
) -> str:
    a, b = args.window
    lines = [
        MARK_BEGIN,
        f"## Op table: lockstep vs the raw loop, {args.nproc} process(es), {args.precision}",
        "",
        f"- date: {info['date']}; command: `{command}`; {info['cpu']}, {info['cores']} cores "
        f"(ISA: {info['isa']}), torch {info['torch']}; lockstep at `{info['commit']}`",
        f"- profiled: steps {a}..{b - 1} of {args.steps}, rank 0, {args.reps} runs per side alternating; "
        "per step, summed over a side's runs then divided by them",
        f"- profiled window, wall ms per step: raw {sum(walls['raw']) / len(walls['raw']):.1f} "
        f"(runs {', '.join(f'{w:.1f}' for w in walls['raw'])}), lockstep "
        f"{sum(walls['lockstep']) / len(walls['lockstep']):.1f} (runs {', '.join(f'{w:.1f}' for w in walls['lockstep'])})",
        "",
        "| op | calls/step raw | calls/step lockstep | ms/step raw | ms/step lockstep | lockstep / raw |",
        "|---|---|---|---|---|---|",
    ]
    ranked = sorted(rows, key=lambda op: -max(rows[op]["raw"][1], rows[op]["lockstep"][1]))
    for op in ranked[: args.top]:
        (nr, mr), (nl, ml) = rows[op]["raw"], rows[op]["lockstep"]
        ratio = f"{ml / mr:.3f}" if mr else "only lockstep"
        lines.append(f"| `{op}` | {nr:.1f} | {nl:.1f} | {mr:.2f} | {ml:.2f} | {ratio} |")
    lines += [
        "",
        "Counters of the whole run (perf stat, every process of the side; summed over its runs):",
        "",
        "| counter | raw | lockstep | lockstep / raw |",
        "|---|---|---|---|",
    ]
    for name in COUNTERS.split(","):
        r, lk = (
            counters["raw"].get(name, float("nan")),
            counters["lockstep"].get(name, float("nan")),
        )
        shown = [("not supported" if v != v else f"{v:,.0f}") for v in (r, lk)]
        ratio = f"{lk / r:.3f}" if r == r and lk == lk and r else "-"
        lines.append(f"| {name} | {shown[0]} | {shown[1]} | {ratio} |")
    lines += ["", MARK_END, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--steps", type=int, default=70)
    p.add_argument(
        "--window",
        type=lambda s: tuple(int(x) for x in s.split(":")),
        default=(30, 60),
        metavar="A:B",
    )
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--top", type=int, default=20, help="ops shown, by time")
    p.add_argument("--out", type=Path, help="also write the section into this markdown file")
    args = p.parse_args(argv)
    from lockstep.config import DataConfig
    from lockstep.data.text import prepare_tokens

    prepare_tokens(DataConfig(), seq_len=bt.SEQ_LEN)
    info = bt.machine_info()
    command = "python bench/profile_ops.py" + (
        " " + " ".join(argv or sys.argv[1:]) if (argv or sys.argv[1:]) else ""
    )
    sums: dict[str, dict[str, list[float]]] = {"raw": {}, "lockstep": {}}
    walls: dict[str, list[float]] = {"raw": [], "lockstep": []}
    counters: dict[str, dict[str, float]] = {"raw": {}, "lockstep": {}}
    for rep in range(args.reps):
        for impl in ("raw", "lockstep"):
            bt.wait_quiet(0.10, 60.0)
            with tempfile.TemporaryDirectory(prefix="profile_ops.") as tmp:
                table, wall, ctr = run_side(impl, args, Path(tmp))
            walls[impl].append(wall)
            print(
                f"  {impl:<9} run {rep + 1}: {wall:.1f} ms/step in the profiled window", flush=True
            )
            for op, (n, ms) in table.items():
                acc = sums[impl].setdefault(op, [0.0, 0.0])
                acc[0] += n / args.reps
                acc[1] += ms / args.reps
            for name, value in ctr.items():
                counters[impl][name] = counters[impl].get(name, 0.0) + value
    ops = set(sums["raw"]) | set(sums["lockstep"])
    rows = {
        op: {impl: tuple(sums[impl].get(op, (0.0, 0.0))) for impl in ("raw", "lockstep")}
        for op in ops
    }
    section = render(rows, walls, counters, args, info, command)
    print("\n" + section)
    if args.out:
        bt.write_section(args.out, section, MARK_BEGIN, MARK_END)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
