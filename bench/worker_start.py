"""Worker start, warm vs fresh: how long `lockstep train --world-size N` takes to its first step and
to its end when the workers are forked from the warm server (lockstep/launch/warm_start.py, the
default) and when each is a new interpreter (LOCKSTEP_WORKER_START=fresh, as torchrun starts them),
side by side in one run.

    python bench/worker_start.py    # 2 and 4 workers, 5 reps each (~6 min); BENCHMARKS.md
    python bench/worker_start.py --nproc 2 --reps 3 --out -   # quick: print only

Each repetition runs both modes back to back (the order alternating) on the same tiny GPT and corpus
for 2 steps, so the time is the start and the end of a run: the launcher's own start, the workers'
imports (or fork), model, data and process group, two steps, the final checkpoint and loss plot, and
every process's exit. The first step's time is its row in metrics.jsonl ("time") from the moment the
command was started.
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

from bench_train import ROOT, _child_env, emit_section, machine_info, resolve_ratios, wait_quiet

BEGIN = (
    "<!-- worker_start:begin (written by bench/worker_start.py; "
    "edits between the markers are replaced) -->"
)
END = "<!-- worker_start:end -->"
TINY = [
    "--hidden-size",
    "32",
    "--attention-heads",
    "2",
    "--layers",
    "2",
    "--max-seq-length",
    "32",
    "--max-steps",
    "2",
    "--warmup-steps",
    "1",
    "--log-interval",
    "1",
    "--peak-flops",
    "1e12",
    "--set",
    "train.sample_tokens=0",
    "--set",
    "data.num_workers=0",
]


def one_run(nproc: int, omp: int, mode: str, corpus: Path, work: Path) -> tuple[float, float]:
    """(seconds to the first step, to the end) of one 2-step run with workers started `mode`."""
    run = Path(tempfile.mkdtemp(dir=work))
    env = {**_child_env(), "LOCKSTEP_WORKER_START": mode, "OMP_NUM_THREADS": str(omp)}
    cmd = [
        sys.executable,
        "-m",
        "lockstep",
        "train",
        "--world-size",
        str(nproc),
        "--data",
        str(corpus),
        "--output-dir",
        str(run / "run"),
        "--set",
        f"data.cache_dir={work / 'cache'}",
        *TINY,
    ]
    start = time.time()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, timeout=600)
    end = time.time()
    first = json.loads((run / "run" / "metrics.jsonl").read_text().splitlines()[0])
    return first["time"] - start, end - start


def measure(nproc: int, omp: int, reps: int, corpus: Path, work: Path) -> dict:
    times: dict[str, list[tuple[float, float]]] = {"warm": [], "fresh": []}
    one_run(nproc, omp, "warm", corpus, work)  # warm-up: the token cache, the file cache
    for rep in range(reps):
        wait_quiet(0.2, 30)
        for mode in ("warm", "fresh") if rep % 2 == 0 else ("fresh", "warm"):
            times[mode].append(one_run(nproc, omp, mode, corpus, work))
    return {"nproc": nproc, "omp": omp, **times}


def render(rows: list[dict], info: dict[str, str], command: str) -> str:
    lines = [
        BEGIN,
        "## Worker start: forked from the warm server vs a fresh interpreter each",
        "",
        f"- date: {info['date']}; commit `{info['commit']}`",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); "
        f"torch {info['torch']}, Python {info['python']}",
        f"- command: `{command}`",
        "- a 2-step run of the tiny GPT: seconds from the command's start to the first step and "
        "to its end "
        "(median of the reps, min-max); ratio = fresh / warm per rep, the two modes back to back",
        "- OMP_NUM_THREADS 1: torch starts no thread, the launcher has one, the server is its "
        "fork; above 1 torch starts OpenMP's, and the server is a new interpreter that imports",
        "",
        "| workers | OMP_NUM_THREADS (server) | first step, warm | first step, fresh | end, warm "
        "| end, fresh | fresh / warm (end) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:

        def cell(mode: str, i: int) -> str:
            values = [t[i] for t in row[mode]]
            return f"{statistics.median(values):.1f} s ({min(values):.1f}-{max(values):.1f})"

        ratios = [f[1] / w[1] for w, f in zip(row["warm"], row["fresh"])]
        verdict = resolve_ratios(ratios, above="warm {pct} faster", below="warm {pct} slower")
        lines.append(
            f"| {row['nproc']} | {_server(row['omp'])} | {cell('warm', 0)} | {cell('fresh', 0)} | "
            f"{cell('warm', 1)} | "
            f"{cell('fresh', 1)} | {verdict} |"
        )
    return "\n".join([*lines, "", END, ""])


def _server(omp: int) -> str:
    return f"{omp} ({'fork of the launcher' if omp == 1 else 'new interpreter'})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--omp-threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file to update, or - to print"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-worker-start-") as tmp:
        work = Path(tmp)
        corpus = work / "corpus.txt"
        corpus.write_text(
            "\n\n".join(p.read_text() for p in sorted((ROOT / "lockstep").rglob("*.py"))[:40])
        )
        rows = [
            measure(n, omp, args.reps, corpus, work) for omp in args.omp_threads for n in args.nproc
        ]
    command = "python bench/worker_start.py " + " ".join(argv if argv is not None else sys.argv[1:])
    emit_section(render(rows, machine_info(), command.strip()), args.out, BEGIN, END)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
