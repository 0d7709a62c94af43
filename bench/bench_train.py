"""lockstep's training throughput against a minimal raw PyTorch loop, side by side in one run.

    python bench/bench_train.py          # full run, ~18 min on 2 cores (4 reps); BENCHMARKS.md
    python bench/bench_train.py --quick  # smoke check (~3 min, 1 rep: resolves nothing), prints it

Four configurations: 1 process and 2-process DDP (gloo), each in fp32 and bf16 autocast.
Same model (lockstep's default GPT: hidden 256, 4 heads, 4 layers, seq 128), same data
(lockstep's token cache of its default corpus), global batch 32. For each configuration the
raw loop (bench/raw_loop.py; torchrun for 2 processes) and `lockstep train` (its CLI,
`--world-size N`) run alternately, raw-lockstep-raw-lockstep. Both are timed over the same
steps: from the log point at step --warmup to the log point at the last step (lockstep: the
`time` field of metrics.jsonl; its end-of-run eval and checkpoint come after the last log).

What the repetitions resolve (resolve_ratios, shared with bench_peers.py): a ratio is taken per
repetition, between two runs made back to back, and a difference is stated only where all of at
least MIN_REPS repetitions agree in sign; otherwise the table says no difference was resolved and
gives the median and range of the ratios. On a shared 2-core host one side's runs vary 7-41%,
so the median of 2 runs per side could not carry the 2-3% differences a row once claimed.

MFU divides model FLOPs/s (`GPT.flops_per_token()` x tokens/s) by a matmul peak measured here
(`lockstep.peak_flops.measure_peak_flops`, best of 3) at the configuration's thread count; for
2 processes both measure at once, 1 thread each, and the peaks are summed. Both columns use
the same denominator, so their ratio is the throughput ratio.

The machine is shared: before every run the bench waits for the other processes to go quiet,
and a run during which other processes used more than --max-foreign of the CPUs is run again
(up to --retries times); the foreign share of each kept run is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAW_LOOP = ROOT / "bench" / "raw_loop.py"
MARK_BEGIN = "<!-- bench_train:begin (written by bench/bench_train.py; edits between the markers are replaced) -->"
MARK_END = "<!-- bench_train:end -->"
ABL_BEGIN = "<!-- bench_train_ablations:begin (written by bench/bench_train.py --ablations) -->"
ABL_END = "<!-- bench_train_ablations:end -->"
# raw loop + one lockstep per-step feature at a time (see bench/raw_loop.py --with)
ABLATIONS = [
    (),
    ("loader",),
    ("stop_allreduce",),
    ("metrics_cpu", "scheduler"),
    ("loader", "stop_allreduce", "metrics_cpu", "scheduler"),
]
TARGET = 0.98  # lockstep within 2% of the raw loop
GLOBAL_BATCH, SEQ_LEN = 32, 128
CONFIGS = [(1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")]  # (processes, precision)
# Thread settings a user gets: one process takes torch's default (one thread per core); torchrun
# and lockstep both give each of N processes cores // N threads (1 here). Inherited
# OMP/MKL settings would make the two sides differ, so they are removed from the children.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


# ----------------------------------------------------------------------------- the machine's load


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine; steal counts as busy (another VM ran)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def _children_cpu() -> float:
    # includes the children's waited-for descendants
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class ForeignLoad:
    """Share of the machine's CPU time that processes other than our children used during a block."""

    def __enter__(self) -> "ForeignLoad":
        self._busy0, self._total0 = _busy_jiffies()
        self._own0 = _children_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, total = _busy_jiffies()
        tick = os.sysconf("SC_CLK_TCK")
        own = _children_cpu() - self._own0
        span = max(total - self._total0, 1) / tick  # CPU-seconds available (all cores)
        self.share = max(0.0, ((busy - self._busy0) / tick - own) / span)


def wait_quiet(limit: float, max_wait: float) -> float:
    """Wait until other processes use less than `limit` of the CPUs over 1 s; returns the seconds waited."""
    start = time.monotonic()
    while True:
        b0, t0 = _busy_jiffies()
        time.sleep(1.0)
        b1, t1 = _busy_jiffies()
        if (b1 - b0) / max(t1 - t0, 1) < limit or time.monotonic() - start > max_wait:
            return time.monotonic() - start


# ----------------------------------------------------------------------------- running both sides


@dataclass
class Run:
    impl: str  # "raw" | "lockstep"
    tokens_per_s: float
    foreign: float  # share of the CPUs other processes used during the run
    attempts: int
    wall_s: float
    # tokens/s per log window in the timed region
    windows: list[float] = field(default_factory=list)


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _bin(name: str) -> str:
    """A console script of this Python's environment (the venv's lockstep / torchrun)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name) or name


def run_raw(
    nproc: int,
    precision: str,
    steps: int,
    warmup: int,
    log_interval: int,
    work: Path,
    features: tuple[str, ...] = (),
) -> tuple[float, list[float]]:
    out = work / "raw.json"
    args = [
        str(RAW_LOOP),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--log-interval",
        str(log_interval),
        "--batch-size",
        str(GLOBAL_BATCH),
        "--precision",
        precision,
        "--out",
        str(out),
    ]
    for feature in features:
        args += ["--with", feature]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [_bin("torchrun"), "--standalone", f"--nproc_per_node={nproc}", *args]
    _run(cmd, work)
    result = json.loads(out.read_text())
    return result["tokens_per_s"], result["window_tokens_per_s"]


def lockstep_command(
    nproc: int, precision: str, steps: int, log_interval: int, run_dir: str
) -> list[str]:
    return [
        "lockstep",
        "train",
        "--world-size",
        str(nproc),
        "--global-batch-size",
        str(GLOBAL_BATCH),
        "--max-steps",
        str(steps),
        "--log-interval",
        str(log_interval),
        "--eval-interval",
        "0",
        "--save-interval",
        "0",
        "--mixed-precision",
        "no" if precision == "fp32" else "bf16",
        "--resume",
        "none",
        "--output-dir",
        run_dir,
        "--set",
        "train.sample_tokens=0",
    ]


def run_lockstep(
    nproc: int, precision: str, steps: int, warmup: int, log_interval: int, work: Path
) -> tuple[float, list[float]]:
    run_dir = work / "run"
    cmd = lockstep_command(nproc, precision, steps, log_interval, str(run_dir))
    _run([_bin(cmd[0]), *cmd[1:]], work)
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    times = {r["step"]: r["time"] for r in records if r.get("split") == "train"}
    if warmup not in times or steps not in times:
        raise RuntimeError(
            f"{run_dir}/metrics.jsonl has no train records at steps {warmup} and {steps}"
        )
    tokens_per_s = (steps - warmup) * GLOBAL_BATCH * SEQ_LEN / (times[steps] - times[warmup])
    windows = [
        r["tokens_per_s"] for r in records if r.get("split") == "train" and r["step"] > warmup
    ]
    return tokens_per_s, windows


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(
        cmd, cwd=cwd, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{tail}")


def measured(fn, args: argparse.Namespace, label: str) -> Run:
    """Run fn (after the machine goes quiet) until a run is not disturbed by other processes."""
    best: Run | None = None
    for attempt in range(1, args.retries + 2):
        waited = wait_quiet(args.max_foreign, args.max_wait)
        with tempfile.TemporaryDirectory(prefix="bench_train.") as tmp, ForeignLoad() as load:
            start = time.perf_counter()
            tok_s, windows = fn(Path(tmp))
            wall = time.perf_counter() - start
        run = Run(label.split()[0], tok_s, load.share, attempt, wall, windows)
        print(
            f"  {label:<34} {tok_s:9.0f} tok/s   foreign load {100 * load.share:4.1f}%   "
            f"wall {wall:5.1f} s   waited {waited:4.1f} s   attempt {attempt}",
            flush=True,
        )
        if best is None or run.foreign < best.foreign:
            best = run
        if run.foreign <= args.max_foreign:
            break
    best.attempts = attempt
    return best


# ----------------------------------------------------------------------------- matmul peak


def peak_worker(precision: str, threads: int) -> None:
    """Child mode: print the best of 3 measure_peak_flops at `threads` threads."""
    import torch

    from lockstep.peak_flops import measure_peak_flops

    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    print(max(measure_peak_flops(torch.device("cpu"), dtype, seconds=1.0) for _ in range(3)))


def measure_peak(nproc: int, precision: str, cores: int) -> float:
    """Summed matmul peak of nproc processes measuring at once, cores // nproc threads each."""
    cmd = [sys.executable, __file__, "--peak-worker", precision, str(max(1, cores // nproc))]
    procs = [
        subprocess.Popen(cmd, env=_child_env(), stdout=subprocess.PIPE, text=True)
        for _ in range(nproc)
    ]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"peak measurement failed: {outs}")
    return sum(float(o.strip().splitlines()[-1]) for o in outs)


# --------------------------------------------------------------------- what the repetitions resolve

# Paired repetitions below which no difference is stated: on a shared 2-core host one side's runs
# vary 7-41%, and 2-3 pairs agree in sign by chance too often to carry a 2-3% claim.
MIN_REPS = 4


def paired_ratios(top: list[float], bottom: list[float]) -> list[float]:
    """top[i] / bottom[i] per repetition: the two sides of a repetition ran back to back, so a
    change in the machine's speed between repetitions divides out."""
    if len(top) != len(bottom):
        raise ValueError(
            f"{len(top)} runs of one side against {len(bottom)} of the other: a ratio "
            "pairs the runs of one repetition; give both sides the same --reps"
        )
    return [t / b for t, b in zip(top, bottom)]


def agreed_sign(ratios: list[float], ref: float = 1.0) -> int:
    """+1 when every ratio is above `ref`, -1 when every one is below, else 0; 0 as well with
    fewer than MIN_REPS ratios, which cannot tell a difference of a few percent from noise."""
    if len(ratios) < MIN_REPS:
        return 0
    if all(r > ref for r in ratios):
        return 1
    return -1 if all(r < ref for r in ratios) else 0


def resolve_ratios(
    ratios: list[float], above: str = "lockstep {pct} faster", below: str = "lockstep {pct} slower"
) -> str:
    """What per-repetition ratios show, in words: `above` or `below` ({pct}: how far the median
    ratio is from 1) only where every repetition agrees in sign, else that nothing is resolved;
    the median and range of the ratios either way."""
    med = statistics.median(ratios)
    span = (
        f"ratio {med:.3f}"
        if len(ratios) == 1
        else f"ratios {min(ratios):.3f}-{max(ratios):.3f}, median {med:.3f}"
    )
    if len(ratios) < MIN_REPS:
        return f"not resolved: {len(ratios)} of the {MIN_REPS} reps it takes ({span})"
    sign = agreed_sign(ratios)
    if sign == 0:
        return f"no difference resolved ({span})"
    pct = 100 * abs(med - 1)
    words = (above if sign > 0 else below).format(pct=f"{pct:.1f}%" if pct < 1 else f"{pct:.0f}%")
    return f"{words} ({span}; all {len(ratios)} reps agree)"


# ----------------------------------------------------------------------------- report


def machine_info() -> dict[str, str]:
    import torch

    cpu = "unknown"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    try:  # others may edit lockstep while the bench runs: record what it started on
        commit = (
            subprocess.run(
                ["git", "describe", "--always", "--dirty"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.TimeoutExpired):
        commit = "unknown"
    return {
        "commit": commit,
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "arch": platform.machine(),
        "cpu": cpu,
        "isa": " ".join(isa) or "-",
        "cores": str(os.cpu_count()),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{100 * (max(values) - min(values)) / med:.0f}%" if len(values) > 1 else "-"


def render(
    results: list[dict], info: dict[str, str], args: argparse.Namespace, command: str
) -> str:
    lines = [
        MARK_BEGIN,
        "## Training throughput: lockstep vs a raw PyTorch loop",
        "",
        f"- date: {info['date']}",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); "
        f"shared with other work, see the foreign-load column",
        f"- torch {info['torch']}, Python {info['python']}, gloo for DDP; lockstep at `{info['commit']}` when the run started",
        f"- threads: 1 process = torch's default ({info['cores']} threads); 2 processes = 1 thread each "
        "(torchrun's OMP_NUM_THREADS=1 for the raw loop, lockstep's cores // local_world_size); "
        "inherited OMP/MKL_NUM_THREADS removed",
        f"- model: lockstep's default GPT (hidden 256, 4 heads, 4 layers, seq {SEQ_LEN}, byte vocab 256; "
        f"{results[0]['params'] / 1e6:.2f}M params, {results[0]['flops_per_token'] / 1e6:.1f} MFLOP/token), "
        f"global batch {GLOBAL_BATCH} ({GLOBAL_BATCH * SEQ_LEN} tokens/step), default corpus (byte tokens)",
        f"- timed: steps {args.warmup}..{args.steps} ({args.steps - args.warmup} steps after {args.warmup} warm-up "
        f"steps), log interval {args.log_interval}; runs in order raw, lockstep, raw, lockstep, ... "
        f"({args.reps} of each per row); the table shows medians",
        "- lockstep / raw: each repetition's lockstep run over the raw run just before it; a "
        f"difference is stated only where all of at least {MIN_REPS} repetitions agree in sign, "
        "and "
        f"'within 2%?' is yes or no only where every repetition's ratio is on the same side of "
        f"{TARGET:.2f}",
        f"- command: `{command}`",
        "- lockstep side (per run): `"
        + " ".join(lockstep_command(2, "bf16", args.steps, args.log_interval, "RUN_DIR"))
        + "` (with `--world-size 1|2`, `--mixed-precision no|bf16`); lockstep's defaults otherwise, "
        "e.g. `data.num_workers=auto` (0 or 1 by the cores per rank)",
        "- raw side: `python bench/raw_loop.py` (1 process) / `torchrun --standalone --nproc_per_node=2 "
        "bench/raw_loop.py` (2 processes): fused AdamW, autocast, DDP(gradient_as_bucket_view), "
        "clip_grad_norm_, random windows read from the memmap, `loss.item()` at log points only",
        "- MFU: model FLOPs / measured matmul peak (`measure_peak_flops`, best of 3, at the row's threads; "
        "2 processes measure together and their peaks are summed)",
        f"- target: lockstep >= {TARGET:.2f} x raw (within 2%)",
        "",
        "| processes | precision | raw tok/s (spread) | lockstep tok/s (spread) "
        "| lockstep / raw, per rep | within 2%? "
        "| peak GFLOP/s | MFU raw | MFU lockstep | runs raw; lockstep (tok/s) | foreign load max |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        raw = [x.tokens_per_s for x in r["raw"]]
        ls = [x.tokens_per_s for x in r["lockstep"]]
        raw_med, ls_med = statistics.median(raw), statistics.median(ls)
        ratios = paired_ratios(ls, raw)
        # within the target only where every repetition is, as a difference is stated
        within = {1: "yes", -1: "no", 0: "not resolved"}[agreed_sign(ratios, TARGET)]
        peak = r["peak"]
        fpt = r["flops_per_token"]
        foreign = max(x.foreign for x in r["raw"] + r["lockstep"])
        lines.append(
            f"| {r['nproc']} | {r['precision']} | {raw_med:,.0f} ({_spread(raw)}) | {ls_med:,.0f} ({_spread(ls)}) "
            f"| {resolve_ratios(ratios)} | {within} | {peak / 1e9:,.0f} "
            f"| {100 * raw_med * fpt / peak:.1f}% "
            f"| {100 * ls_med * fpt / peak:.1f}% | {', '.join(f'{v:,.0f}' for v in raw)}; "
            f"{', '.join(f'{v:,.0f}' for v in ls)} | {100 * foreign:.0f}% |"
        )
    lines += [
        "",
        "Spread = (max - min) / median over a side's runs. Foreign load = share of all CPUs that processes other "
        "than the benchmarked ones used during a run (a run above "
        f"{100 * args.max_foreign:.0f}% is repeated, up to {args.retries} times).",
        MARK_END,
    ]
    return "\n".join(lines) + "\n"


def render_ablations(
    rows: list[dict], info: dict[str, str], args: argparse.Namespace, command: str
) -> str:
    lines = [
        ABL_BEGIN,
        "## Where lockstep's per-step time goes: the raw loop plus one lockstep feature at a time",
        "",
        f"- date: {info['date']}; same machine, model, batch and timing as above (steps {args.warmup}..{args.steps}); "
        f"variants run round-robin, {args.reps} runs each; medians. vs raw loop: each round's "
        "variant run over its raw-loop run; a difference is stated only where all of at least "
        f"{MIN_REPS} rounds agree in sign",
        f"- command: `{command}`",
        "- features (bench/raw_loop.py `--with`): `loader` = lockstep's DataLoader (TokenWindows + "
        "GlobalCursorSampler, `data.num_workers=auto`, prefetch 4) instead of indexing the memmap in the loop; "
        "`stop_allreduce` = a float64 all-reduce(MAX) each step (StopRequest.agreed; 2 processes only); "
        "`metrics_cpu` = per-step loss / grad-norm `.detach().float().cpu()`; `scheduler` = LambdaLR",
        "",
        "| processes | precision | variant | tok/s | vs raw loop | ms/step vs raw | runs (tok/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    tokens_per_step = GLOBAL_BATCH * SEQ_LEN
    for r in rows:
        base_runs = [x.tokens_per_s for x in r["variants"][()]]
        base = statistics.median(base_runs)
        for features, runs in r["variants"].items():
            med = statistics.median(x.tokens_per_s for x in runs)
            delta_ms = 1000 * tokens_per_step * (1 / med - 1 / base)
            ratios = paired_ratios([x.tokens_per_s for x in runs], base_runs)
            versus = resolve_ratios(ratios, "{pct} faster", "{pct} slower") if features else "-"
            lines.append(
                f"| {r['nproc']} | {r['precision']} | {' + '.join(features) or 'raw loop'} | {med:,.0f} "
                f"| {versus} | {delta_ms:+.1f} "
                f"| {', '.join(f'{x.tokens_per_s:,.0f}' for x in runs)} |"
            )
    lines += ["", ABL_END]
    return "\n".join(lines) + "\n"


def emit_section(section: str, out: str, begin: str, end: str) -> None:
    """Print a rendered section; unless out is "-", also replace it in the markdown file `out`."""
    if out != "-":
        write_section(Path(out), section, begin, end)
    print(section)


def write_section(path: Path, section: str, begin: str = MARK_BEGIN, end: str = MARK_END) -> None:
    """Replace the text between the markers (or append the section): the rest of the file is kept."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    key = begin.split(" (")[0]
    if key in text and end in text:
        head, _, rest = text.partition(key)
        _, _, tail = rest.partition(end)
        text = head + section.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke check: fewer steps, 1 run per side, no file written",
    )
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 90; quick 25)")
    p.add_argument("--warmup", type=int, help="untimed steps at the start (default 10; quick 5)")
    p.add_argument("--log-interval", type=int, help="default 10; quick 5")
    p.add_argument(
        "--reps",
        type=int,
        help="runs per side per configuration "
        f"(default {MIN_REPS}; quick 1, which cannot resolve a difference)",
    )
    p.add_argument(
        "--only", action="append", metavar="NPROC:PRECISION", help="e.g. 2:bf16 (repeatable)"
    )
    p.add_argument(
        "--max-foreign",
        type=float,
        default=0.10,
        help="foreign CPU share that makes a run count as disturbed",
    )
    p.add_argument("--retries", type=int, help="re-runs of a disturbed run (default 2; quick 0)")
    p.add_argument(
        "--max-wait",
        type=float,
        help="seconds to wait for a quiet machine before each run (default 60; quick 10)",
    )
    p.add_argument(
        "--out", type=Path, help="markdown file to update (default BENCHMARKS.md; quick: none)"
    )
    p.add_argument(
        "--ablations",
        action="store_true",
        help="instead: time the raw loop with one lockstep per-step feature added at a time",
    )
    p.add_argument(
        "--peak-worker", nargs=2, metavar=("PRECISION", "THREADS"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "steps": 25 if quick else 90,
        "warmup": 5 if quick else 10,
        "log_interval": 5 if quick else 10,
        "reps": 1 if quick else MIN_REPS,
        "retries": 0 if quick else 2,
        "max_wait": 10.0 if quick else 60.0,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None and not quick:
        args.out = ROOT / "BENCHMARKS.md"
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
    if args.peak_worker:
        peak_worker(args.peak_worker[0], int(args.peak_worker[1]))
        return 0
    from lockstep.config import DataConfig, ModelConfig
    from lockstep.data.text import prepare_tokens
    from lockstep.models.gpt import build_gpt

    configs = CONFIGS
    if args.only:
        configs = [(int(n), prec) for n, prec in (o.split(":") for o in args.only)]
    cores = os.cpu_count() or 1
    info = machine_info()
    command = "python bench/bench_train.py" + (" " + " ".join(argv) if argv else "")
    print(
        f"{info['date']}  {info['cpu']} ({info['cores']} cores)  torch {info['torch']}", flush=True
    )
    prepare_tokens(DataConfig(), seq_len=SEQ_LEN)  # tokenize once, outside every timed run
    model = build_gpt(ModelConfig())
    flops_per_token, params = model.flops_per_token(), model.num_params()
    del model

    started = time.perf_counter()
    if args.ablations:
        rows = []
        for nproc, precision in configs if args.only else [(1, "bf16"), (2, "bf16")]:
            variants = [
                f for f in ABLATIONS if nproc > 1 or "stop_allreduce" not in f or len(f) > 1
            ]
            row = {"nproc": nproc, "precision": precision, "variants": {f: [] for f in variants}}
            for rep in range(args.reps):
                for features in variants:
                    row["variants"][features].append(
                        measured(
                            lambda work: run_raw(
                                nproc,
                                precision,
                                args.steps,
                                args.warmup,
                                args.log_interval,
                                work,
                                features,
                            ),
                            args,
                            f"raw+{'+'.join(features) or '-'} {nproc}p {precision} run {rep + 1}",
                        )
                    )
            rows.append(row)
        section = render_ablations(rows, info, args, command)
        print("\n" + section + f"\ntotal {time.perf_counter() - started:.0f} s")
        if args.out:
            write_section(args.out, section, ABL_BEGIN, ABL_END)
            print(f"wrote {args.out}")
        return 0
    results = []
    for nproc, precision in configs:
        wait_quiet(args.max_foreign, args.max_wait)
        peak = measure_peak(nproc, precision, cores)
        print(
            f"{nproc} process(es), {precision}: matmul peak {peak / 1e9:,.0f} GFLOP/s", flush=True
        )
        row = {
            "nproc": nproc,
            "precision": precision,
            "peak": peak,
            "flops_per_token": flops_per_token,
            "params": params,
            "raw": [],
            "lockstep": [],
        }
        for rep in range(args.reps):
            row["raw"].append(
                measured(
                    lambda work: run_raw(
                        nproc, precision, args.steps, args.warmup, args.log_interval, work
                    ),
                    args,
                    f"raw      {nproc}p {precision} run {rep + 1}",
                )
            )
            row["lockstep"].append(
                measured(
                    lambda work: run_lockstep(
                        nproc, precision, args.steps, args.warmup, args.log_interval, work
                    ),
                    args,
                    f"lockstep {nproc}p {precision} run {rep + 1}",
                )
            )
        results.append(row)
    section = render(results, info, args, command)
    print()
    print(section)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.out:
        write_section(args.out, section)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
