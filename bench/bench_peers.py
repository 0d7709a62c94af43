"""lockstep against HF Accelerate and Lightning Fabric (and a raw torch loop), side by side in one run.

    pip install -e '.[bench]'                # accelerate>=1.15, lightning>=2.6
    python bench/bench_peers.py              # full run, ~40 min on 2 cores (4 reps); BENCHMARKS.md
    python bench/bench_peers.py --only 1:bf16   # one configuration, 4 reps (~10 min); repeatable
    python bench/bench_peers.py --quick      # smoke check (~5 min; 1 rep resolves nothing)
    python bench/bench_peers.py --workers --only 2:fp32   # data.num_workers 0 / 1 / auto vs raw

The same job four ways: `lockstep train` (its CLI, `--world-size N`), bench/peer_loop.py written the way an
Accelerate or a Fabric user writes it, and bench/raw_loop.py (the minimal loop). Same model (lockstep's
default GPT), data (the token windows of its default corpus), optimizer (fused AdamW, two weight-decay
groups, warmup + cosine), global batch 32, clipping, and bf16 through each framework's own setting. Four
configurations: 1 process and 2-process DDP over gloo, fp32 and bf16. Every 2-process side starts under
torchrun (lockstep: its own launcher, which runs torchrun's elastic agent).

Two measurements per configuration, each side run in turn (the order rotates every repetition):
- throughput: tokens/s from the log point at step --warmup to the one at the last step;
- time to the first step: wall time from starting the command to the end of optimizer step 1 (a 1-step
  run; the loss read on the host), so imports, process start, rendezvous, data and model set-up and
  anything a framework does before training all count.

--workers: raw against `lockstep train` with data.num_workers 0, 1 and auto (no peers needed).
Each run's process tree is sampled every 0.2 s: processes (the launcher, the ranks, their
DataLoader workers), and the peak of their summed RSS and PSS (PSS splits the pages that forked
workers share). Beside tokens/s: how even the log windows of the timed steps are (their
coefficient of variation, and the slowest over the fastest).

Reuses bench_train.py's machinery: waiting for a quiet machine, measuring the CPU other processes take
during each run (a disturbed run is repeated), machine facts, and the BENCHMARKS.md section writer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_train as bt

PEER_LOOP = bt.ROOT / "bench" / "peer_loop.py"
IMPLS = ("raw", "lockstep", "accelerate", "fabric")
PEERS = ("accelerate", "fabric", "raw")  # the columns comparing lockstep with each, in this order
MARK_BEGIN = "<!-- bench_peers:begin (written by bench/bench_peers.py; edits between the markers are replaced) -->"
MARK_END = "<!-- bench_peers:end -->"
WORKERS_BEGIN = (
    "<!-- bench_peers_workers:begin (written by bench/bench_peers.py --workers; "
    "edits between the markers are replaced) -->"
)
WORKERS_END = "<!-- bench_peers_workers:end -->"
# lockstep:N = `lockstep train --set data.num_workers=N`
WORKER_SIDES = ("raw", "lockstep:0", "lockstep:1", "lockstep:auto")


def command(
    impl: str, nproc: int, precision: str, steps: int, warmup: int, log_interval: int, work: Path
) -> list[str]:
    timing = [
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--log-interval",
        str(log_interval),
        "--batch-size",
        str(bt.GLOBAL_BATCH),
        "--precision",
        precision,
        "--out",
        str(work / "result.json"),
    ]
    match impl:
        case "lockstep":
            cmd = bt.lockstep_command(nproc, precision, steps, log_interval, str(work / "run"))
            return [bt._bin(cmd[0]), *cmd[1:]]
        case "raw":
            script = [str(bt.RAW_LOOP), *timing]
        case "accelerate" | "fabric":
            script = [str(PEER_LOOP), "--framework", impl, *timing]
        case _:
            raise ValueError(f"unknown side {impl!r}; one of {', '.join(IMPLS)}")
    if nproc == 1:
        return [sys.executable, *script]
    return [bt._bin("torchrun"), "--standalone", f"--nproc_per_node={nproc}", *script]


def run_once(
    impl: str, nproc: int, precision: str, steps: int, warmup: int, log_interval: int, work: Path
) -> dict:
    """One run: tokens/s over the timed steps (when there are any) and the first step's end, from the start."""
    cmd = command(impl, nproc, precision, steps, warmup, log_interval, work)
    start = time.time()
    bt._run(cmd, work)
    if impl == "lockstep":
        records = [
            json.loads(line)
            for line in (work / "run" / "metrics.jsonl").read_text().splitlines()
            if line
        ]
        times = {r["step"]: r["time"] for r in records if r.get("split") == "train"}
        tok_s = (
            (steps - warmup) * bt.GLOBAL_BATCH * bt.SEQ_LEN / (times[steps] - times[warmup])
            if warmup in times
            else float("nan")
        )
        first = times.get(1)
    else:
        result = json.loads((work / "result.json").read_text())
        tok_s, first = result.get("tokens_per_s", float("nan")), result["first_step_time"]
    return {"tokens_per_s": tok_s, "first_step_s": (first - start) if first else float("nan")}


def least_disturbed(run, describe, args: argparse.Namespace) -> dict:
    """run(tmp_dir) after the machine goes quiet, repeated (args.retries) while other processes took
    more than args.max_foreign of the CPUs; the least disturbed result, its "foreign" share set.
    describe(out, attempt) is the progress line printed after each attempt."""
    best = None
    for attempt in range(1, args.retries + 2):
        bt.wait_quiet(args.max_foreign, args.max_wait)
        with tempfile.TemporaryDirectory(prefix="bench_peers.") as tmp, bt.ForeignLoad() as load:
            out = run(Path(tmp))
        out["foreign"] = load.share
        print(describe(out, attempt), flush=True)
        if best is None or out["foreign"] < best["foreign"]:
            best = out
        if out["foreign"] <= args.max_foreign:
            break
    return best


def measured(
    impl: str,
    nproc: int,
    precision: str,
    steps: int,
    warmup: int,
    log_interval: int,
    args: argparse.Namespace,
    label: str,
) -> dict:
    """run_once after the machine goes quiet, repeated while other processes disturbed it."""
    return least_disturbed(
        lambda tmp: run_once(impl, nproc, precision, steps, warmup, log_interval, tmp),
        lambda out, attempt: (
            f"  {label:<40} {out['tokens_per_s']:9.0f} tok/s   "
            f"first step {out['first_step_s']:5.2f} s   "
            f"foreign load {100 * out['foreign']:4.1f}%   attempt {attempt}"
        ),
        args,
    )


# ----------------------------------------------------------------------------- --workers


def process_tree(root: int) -> list[int]:
    """`root` and every process under it (from /proc), alive at the time of the call."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # ended meanwhile
                continue
            # the name in brackets may hold spaces; the parent's pid is the second field after it
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        tree += frontier
    return [pid for pid in tree if pid in parents]


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in kB; (0, 0) once it has ended."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
        fields = dict(line.split(":", 1) for line in lines)
    except (OSError, ValueError):
        return 0, 0
    return int(fields["Rss"].split()[0]), int(fields["Pss"].split()[0])


def run_sampled(cmd: list[str], cwd: Path, every: float = 0.2) -> dict:
    """Run `cmd`, sampling its process tree every `every` s: the most processes alive at once, and
    the peak of their summed RSS and PSS (GB). Its output goes to cwd/output.txt."""
    with open(cwd / "output.txt", "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=bt._child_env(), stdout=out, stderr=subprocess.STDOUT
        )
        most, rss, pss = 0, 0, 0
        while proc.poll() is None:
            tree = process_tree(proc.pid)
            mem = [memory_kb(pid) for pid in tree]
            most = max(most, len(tree))
            rss = max(rss, sum(m[0] for m in mem))
            pss = max(pss, sum(m[1] for m in mem))
            time.sleep(every)
    if proc.returncode != 0:
        tail = "\n".join((cwd / "output.txt").read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{tail}")
    return {"processes": most, "rss_gb": rss / 1e6, "pss_gb": pss / 1e6}


def window_stats(windows: list[float]) -> dict:
    """How even the log windows' tokens/s are: coefficient of variation (%), slowest / fastest."""
    return {
        "cv_pct": 100 * statistics.pstdev(windows) / statistics.mean(windows),
        "slow_fast": min(windows) / max(windows),
    }


def run_worker_side(
    side: str, nproc: int, precision: str, args: argparse.Namespace, work: Path
) -> dict:
    """One throughput run of a --workers side: tokens/s, its windows' evenness, processes and
    memory."""
    if side == "raw":
        cmd = command("raw", nproc, precision, args.steps, args.warmup, args.log_interval, work)
    else:
        run_dir = str(work / "run")
        cmd = bt.lockstep_command(nproc, precision, args.steps, args.log_interval, run_dir)
        cmd = [bt._bin(cmd[0]), *cmd[1:], "--set", f"data.num_workers={side.split(':')[1]}"]
    out = run_sampled(cmd, work)
    if side == "raw":
        result = json.loads((work / "result.json").read_text())
        tok_s, windows = result["tokens_per_s"], result["window_tokens_per_s"]
    else:
        lines = (work / "run" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line]
        train = {r["step"]: r for r in records if r.get("split") == "train"}
        timed = (args.steps - args.warmup) * bt.GLOBAL_BATCH * bt.SEQ_LEN
        tok_s = timed / (train[args.steps]["time"] - train[args.warmup]["time"])
        windows = [r["tokens_per_s"] for step, r in sorted(train.items()) if step > args.warmup]
        said = [
            line
            for line in (work / "output.txt").read_text().splitlines()
            if "DataLoader worker" in line
        ]
        out["said"] = said[0].split("INFO ", 1)[-1] if said else "?"
    return out | window_stats(windows) | {"tokens_per_s": tok_s, "windows": len(windows)}


def measured_side(
    side: str, nproc: int, precision: str, args: argparse.Namespace, label: str
) -> dict:
    """run_worker_side after the machine goes quiet, repeated while other processes disturbed it."""

    def describe(out: dict, attempt: int) -> str:
        out["foreign_pct"] = 100 * out["foreign"]
        return (
            f"  {label}: {out['tokens_per_s']:8.0f} tok/s  windows cv {out['cv_pct']:4.1f}%  "
            f"slowest/fastest {out['slow_fast']:.2f}  {out['processes']} processes  "
            f"RSS {out['rss_gb']:.2f} GB  PSS {out['pss_gb']:.2f} GB  "
            f"foreign {out['foreign_pct']:4.1f}%  {out.get('said', '')}"
        )

    return least_disturbed(
        lambda tmp: run_worker_side(side, nproc, precision, args, tmp), describe, args
    )


def measure_workers(configs: list[tuple[int, str]], args: argparse.Namespace) -> list[dict]:
    rows = []
    for nproc, precision in configs:
        runs: dict[str, list[dict]] = {side: [] for side in WORKER_SIDES}
        for rep in range(args.reps):
            k = rep % len(WORKER_SIDES)
            for side in WORKER_SIDES[k:] + WORKER_SIDES[:k]:
                label = f"{side:<14} {nproc}p {precision} run {rep + 1}"
                runs[side].append(measured_side(side, nproc, precision, args, label))
        rows.append({"nproc": nproc, "precision": precision, "runs": runs})
    return rows


def _cell(runs: list[dict], key: str, fmt: str) -> str:
    """The median over runs, with their range."""
    values = [r[key] for r in runs]
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def render_workers(
    rows: list[dict], info: dict[str, str], args: argparse.Namespace, command_line: str
) -> str:
    lines = [
        WORKERS_BEGIN,
        "## DataLoader workers on few cores: data.num_workers 0 / 1 / auto vs the raw loop",
        "",
        f"- date: {info['date']}; command: `{command_line}`",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); "
        f"torch {info['torch']}, Python {info['python']}; lockstep at `{info['commit']}`",
        "- job: as in the section above (lockstep's default GPT, global batch "
        f"{bt.GLOBAL_BATCH}); raw = bench/raw_loop.py under torchrun (no DataLoader); lockstep = "
        "`lockstep train` with `--set data.num_workers=N`",
        f"- steps {args.warmup}..{args.steps} timed, log windows of {args.log_interval} steps; "
        f"{args.reps} runs per side, the order rotating; medians over runs (range in brackets). "
        "Window CV = stdev / mean of the windows' tokens/s within a run; slowest / fastest = the "
        "run's slowest window over its fastest. Processes = the most alive at once in the "
        "command's tree; RSS / PSS = the peak of their sum, sampled every 0.2 s. vs raw: the ratio "
        "to the raw run of the same rotation; a difference only where all of at least "
        f"{bt.MIN_REPS} agree in sign",
        "",
        "| processes | precision | side | workers per rank | tok/s | window CV % | "
        "slowest / fastest | processes alive | peak RSS GB | peak PSS GB | foreign load % | "
        "tok/s vs raw | peak PSS vs raw |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for side, runs in row["runs"].items():
            said = runs[0].get("said", "")
            workers = "-" if side == "raw" else said.split(" DataLoader")[0].removeprefix("data: ")
            cells = [
                _cell(runs, key, fmt)
                for key, fmt in (
                    ("tokens_per_s", ",.0f"),
                    ("cv_pct", ".1f"),
                    ("slow_fast", ".2f"),
                    ("processes", "g"),
                    ("rss_gb", ".2f"),
                    ("pss_gb", ".2f"),
                    ("foreign_pct", ".0f"),
                )
            ]
            versus = (
                ["-", "-"]
                if side == "raw"
                else [
                    bt.resolve_ratios(
                        versus_peer(row["runs"], "raw", key, side),
                        f"{{pct}} {more}",
                        f"{{pct}} {less}",
                    )
                    for key, more, less in (
                        ("tokens_per_s", "faster", "slower"),
                        ("pss_gb", "more", "less"),
                    )
                ]
            )
            lines.append(
                f"| {row['nproc']} | {row['precision']} | {side} | {workers} | "
                + " | ".join(cells + versus)
                + " |"
            )
    said = {
        r["said"] for row in rows for runs in row["runs"].values() for r in runs if r.get("said")
    }
    lines += ["", "What lockstep said (its log, rank 0):", ""]
    lines += [f"- `{line}`" for line in sorted(said)]
    lines += [
        "",
        "Foreign load: the share of the CPUs other processes used during a run (a run "
        f"above {100 * args.max_foreign:.0f}% is repeated, up to {args.retries} times, and "
        "the least disturbed one kept).",
        WORKERS_END,
        "",
    ]
    return "\n".join(lines)


def rotated(rep: int) -> list[str]:
    """The sides in turn, starting one further each repetition: no side always runs first or after another."""
    k = rep % len(IMPLS)
    return list(IMPLS[k:] + IMPLS[:k])


def versus_peer(
    runs: dict[str, list[dict]], peer: str, key: str, side: str = "lockstep"
) -> list[float]:
    """`side`'s `key` over the peer's, per repetition (runs[side][rep]: one rotation of the
    sides)."""
    return bt.paired_ratios([r[key] for r in runs[side]], [r[key] for r in runs[peer]])


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _span(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs]
    return (
        f"{min(values):,.0f}-{max(values):,.0f}"
        if key == "tokens_per_s"
        else f"{min(values):.2f}-{max(values):.2f}"
    )


def render(
    rows: list[dict],
    info: dict[str, str],
    args: argparse.Namespace,
    versions: dict[str, str],
    command_line: str,
) -> str:
    lines = [
        MARK_BEGIN,
        "## lockstep vs Accelerate and Lightning Fabric (and a raw loop)",
        "",
        f"- date: {info['date']}; command: `{command_line}`",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); torch {info['torch']}, "
        f"Python {info['python']}; {', '.join(f'{k} {v}' for k, v in versions.items())}; lockstep at `{info['commit']}`",
        f"- job: lockstep's default GPT (3.23M params, seq {bt.SEQ_LEN}), global batch {bt.GLOBAL_BATCH}, fused AdamW, "
        "warmup + cosine, clip 1.0; bf16 = each framework's own autocast setting; 2 processes = DDP over gloo under "
        "torchrun (lockstep: `lockstep train --world-size 2`, torchrun's elastic agent in-process)",
        "- sides: `lockstep train` (defaults: data.num_workers auto); bench/peer_loop.py as an Accelerate / Fabric "
        "user writes it (`prepare` / `setup` + `setup_dataloaders`, the same DataLoader settings); bench/raw_loop.py "
        "(indexes the token memmap in the loop, no DataLoader)",
        f"- throughput: steps {args.warmup}..{args.steps}, {args.reps} runs per side, the side order rotating each "
        "repetition; medians, with the range of runs. First step: a separate 1-step run per side and repetition, "
        "wall time from starting the command to the end of step 1",
        "- lockstep vs X: the ratio lockstep / X of each repetition (the two runs in one rotation "
        "of the sides); a difference is stated only where all of at least "
        f"{bt.MIN_REPS} repetitions agree in sign, "
        "else 'no difference resolved', with the median and range of the ratios",
        "",
        "| processes | precision | raw tok/s | lockstep tok/s | accelerate tok/s | fabric tok/s | "
        "lockstep vs accelerate | lockstep vs fabric | lockstep vs raw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        med = {impl: _med(row["tput"][impl], "tokens_per_s") for impl in IMPLS}
        cells = [f"{med[i]:,.0f} ({_span(row['tput'][i], 'tokens_per_s')})" for i in IMPLS]
        versus = [
            bt.resolve_ratios(versus_peer(row["tput"], peer, "tokens_per_s")) for peer in PEERS
        ]
        lines.append(
            f"| {row['nproc']} | {row['precision']} | " + " | ".join(cells + versus) + " |"
        )
    lines += [
        "",
        "Time to the first optimizer step (seconds from starting the command):",
        "",
        "| processes | precision | raw | lockstep | accelerate | fabric "
        "| lockstep vs accelerate | lockstep vs fabric | lockstep vs raw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        med = {impl: _med(row["first"][impl], "first_step_s") for impl in IMPLS}
        cells = [f"{med[i]:.2f} ({_span(row['first'][i], 'first_step_s')})" for i in IMPLS]
        versus = [
            bt.resolve_ratios(
                versus_peer(row["first"], peer, "first_step_s"),
                "lockstep takes {pct} longer",
                "lockstep takes {pct} less",
            )
            for peer in PEERS
        ]
        lines.append(
            f"| {row['nproc']} | {row['precision']} | " + " | ".join(cells + versus) + " |"
        )
    foreign = max(
        r["foreign"]
        for row in rows
        for part in ("tput", "first")
        for runs in row[part].values()
        for r in runs
    )
    lines += [
        "",
        f"Largest foreign load during a kept run: {100 * foreign:.0f}% of the CPUs (a run above "
        f"{100 * args.max_foreign:.0f}% is repeated, up to {args.retries} times).",
        MARK_END,
        "",
    ]
    return "\n".join(lines)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("accelerate", "lightning"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            raise SystemExit(
                f"{name} is not installed; pip install -e '.[bench]' (accelerate>=1.15, lightning>=2.6)"
            )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke check: fewer steps, 1 run per side, no file written",
    )
    p.add_argument(
        "--workers",
        action="store_true",
        help="raw vs lockstep with data.num_workers 0 / 1 / auto: evenness, processes, memory",
    )
    p.add_argument(
        "--steps", type=int, help="optimizer steps per throughput run (default 90; quick 25)"
    )
    p.add_argument("--warmup", type=int, help="untimed steps at the start (default 10; quick 5)")
    p.add_argument("--log-interval", type=int, help="default 10; quick 5")
    p.add_argument(
        "--reps",
        type=int,
        help="runs per side per configuration "
        f"(default {bt.MIN_REPS}; quick 1, which cannot resolve a difference)",
    )
    p.add_argument(
        "--only", action="append", metavar="NPROC:PRECISION", help="e.g. 1:bf16 (repeatable)"
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.10,
        help="foreign CPU share that makes a run disturbed",
    )
    p.add_argument("--retries", type=int, help="re-runs of a disturbed run (default 2; quick 0)")
    p.add_argument(
        "--max-wait", type=float, help="seconds to wait for a quiet machine (default 60; quick 10)"
    )
    p.add_argument(
        "--out", type=Path, help="markdown file to update (default BENCHMARKS.md; quick: none)"
    )
    args = p.parse_args(argv)
    defaults = {
        "steps": 25 if args.quick else 90,
        "warmup": 5 if args.quick else 10,
        "log_interval": 5 if args.quick else 10,
        "reps": 1 if args.quick else bt.MIN_REPS,
        "retries": 0 if args.quick else 2,
        "max_wait": 10.0 if args.quick else 60.0,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None and not args.quick:
        args.out = bt.ROOT / "BENCHMARKS.md"
    if (
        args.warmup % args.log_interval
        or args.steps % args.log_interval
        or args.steps <= args.warmup
    ):
        p.error(
            f"--warmup ({args.warmup}) and --steps ({args.steps}) must be multiples of --log-interval "
            f"({args.log_interval}), with steps > warmup"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from lockstep.config import DataConfig
    from lockstep.data.text import prepare_tokens

    configs = (
        [(int(n), p) for n, p in (o.split(":") for o in args.only)] if args.only else bt.CONFIGS
    )
    info = bt.machine_info()
    command_line = "python bench/bench_peers.py" + (" " + " ".join(argv) if argv else "")
    if args.workers:
        prepare_tokens(DataConfig(), seq_len=bt.SEQ_LEN)
        started = time.perf_counter()
        section = render_workers(measure_workers(configs, args), info, args, command_line)
        print("\n" + section + f"\ntotal {time.perf_counter() - started:.0f} s")
        if args.out:
            bt.write_section(args.out, section, WORKERS_BEGIN, WORKERS_END)
            print(f"wrote {args.out}")
        return 0
    peers = versions()
    print(
        f"{info['date']}  {info['cpu']} ({info['cores']} cores)  torch {info['torch']}  {peers}",
        flush=True,
    )
    prepare_tokens(DataConfig(), seq_len=bt.SEQ_LEN)  # tokenize once, outside every timed run
    started, rows = time.perf_counter(), []
    for nproc, precision in configs:
        row = {
            "nproc": nproc,
            "precision": precision,
            "tput": {i: [] for i in IMPLS},
            "first": {i: [] for i in IMPLS},
        }
        for rep in range(args.reps):
            for impl in rotated(rep):
                row["tput"][impl].append(
                    measured(
                        impl,
                        nproc,
                        precision,
                        args.steps,
                        args.warmup,
                        args.log_interval,
                        args,
                        f"{impl:<10} {nproc}p {precision} run {rep + 1}",
                    )
                )
            for impl in rotated(rep):
                row["first"][impl].append(
                    measured(
                        impl,
                        nproc,
                        precision,
                        1,
                        0,
                        1,
                        args,
                        f"{impl:<10} {nproc}p {precision} first step {rep + 1}",
                    )
                )
        rows.append(row)
    section = render(rows, info, args, peers, command_line)
    print("\n" + section + f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.out:
        bt.write_section(args.out, section, MARK_BEGIN, MARK_END)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
