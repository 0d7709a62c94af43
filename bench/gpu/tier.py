"""The GPU tier: `pytest -m gpu` and the GPT-2 124M benchmark on one CUDA GPU, then the GPU section
of BENCHMARKS.md. bench/gpu/run.sh is its command line (`bash bench/gpu/run.sh --help`).

Without CUDA it says so in one line and exits 2, before importing torch where the machine has
neither nvidia-smi nor /dev/nvidia* (machine.py). It uses the torch it finds and never installs one;
`--wheels DIR` installs that folder's wheels (what the machine lacks: bench/gpu/fetch_wheels.sh
downloads them) into /tmp/lockstep-site, which goes first on PYTHONPATH, then the repository (used
in place, not installed).

Each part runs in its own process group under a time limit: at the limit the group gets SIGINT
(pytest still writes junit.xml, gpt2.py still writes bench.json, lockstep runs stop as on Ctrl-C),
30 s later SIGKILL. After each part the results folder (--out) holds env.json and the part's files,
and the section is rewritten from it (report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from machine import (  # noqa: E402
    SITE,
    NoCuda,
    describe_machine,
    install_wheels,
    no_cuda_reason,
    part_env,
)

PART_FILES = {"tests": ("junit.xml", "tests.log"), "bench": ("bench.json", "bench.log")}
# Each invocation must end within 10 minutes (the device tool's limit per command), and both within
# the 15 minutes of device time a session is lent, less about one for the machine's start. On an
# H200 (2026-11-26) the 31 GPU tests took ~410 s one after the other; on an H100 (2026-11-27) the
# 34 took 186 s on 4 pytest-xdist workers (TEST_WORKERS, a test file each: the machine's 16 cores
# start the tests' processes side by side) and the bench's first repetition of its four runs 117 s:
# 4.5 minutes hold the tests, 4 the bench's first repetition (the second is skipped).
TESTS_LIMIT_MIN, BENCH_LIMIT_MIN = 4.5, 4.0
TEST_WORKERS = 4
INVOCATION_LIMIT_MIN, TOTAL_LIMIT_MIN = 10.0, 14.0
# gpt2.py skips a run expected to end after its budget and stops its runs 60 s after it: the budget
# leaves that minute and 20 s to write the results inside the part's limit
BUDGET_MARGIN_S = 80


def bench_budget_s(bench_limit_min: float) -> int:
    """The --budget-s that lets gpt2.py end inside a bench limit of this many minutes."""
    return max(30, round(60 * bench_limit_min) - BUDGET_MARGIN_S)


BENCH_BUDGET_S = bench_budget_s(BENCH_LIMIT_MIN)  # 160 s at the default 4 minutes
GRACE_S = 30  # from SIGINT to SIGKILL


@dataclass(frozen=True)
class Step:
    name: str
    minutes: float  # estimated on an H100; the parts are bounded by their time limits
    what: str


def steps_of(
    part: str, tests_limit: float = TESTS_LIMIT_MIN, bench_limit: float = BENCH_LIMIT_MIN
) -> list[Step]:
    """What one invocation of `--part tests|bench` does, in order, with estimated minutes."""
    if part == "tests":
        body = Step(
            "tests",
            tests_limit + GRACE_S / 60,
            f"python3 -m pytest -m gpu -n {TEST_WORKERS} tests/gpu (SIGINT at {tests_limit:g} min; "
            "junit.xml is "
            "still written) -> junit.xml, tests.log",
        )
    else:
        body = Step(
            "bench",
            bench_limit + GRACE_S / 60,
            "GPT-2 124M, lockstep vs the raw loop, compile off and on, up to 2 runs each "
            f"(bench/gpu/gpt2.py; a run expected to end after {bench_budget_s(bench_limit)} s is "
            f"skipped; "
            f"SIGINT at {bench_limit:g} min) -> bench.json, bench.log",
        )
    return [
        Step(
            "env",
            0.3,
            "check CUDA (nvidia-smi, torch.cuda); record device, driver, CUDA, torch, commit -> env.json",
        ),
        Step(
            "wheels",
            0.3,
            f"with --wheels DIR only: pip install --no-index --no-deps DIR/*.whl --target {SITE}",
        ),
        body,
        Step(
            "report",
            0.1,
            "rewrite the GPU section from the results folder -> section.md, BENCHMARKS.md",
        ),
    ]


def plan_text(tests_limit: float = TESTS_LIMIT_MIN, bench_limit: float = BENCH_LIMIT_MIN) -> str:
    lines = ["GPU tier plan (estimates for one H100; --plan runs nothing):"]
    total = 0.0
    for i, part in enumerate(("tests", "bench"), 1):
        steps = steps_of(part, tests_limit, bench_limit)
        minutes = sum(s.minutes for s in steps)
        total += minutes
        lines.append(
            f"  invocation {i}: bash bench/gpu/run.sh --part {part} [--wheels DIR] [--out DIR]"
        )
        lines += [f"    {s.minutes:4.1f} min  {s.name:<7} {s.what}" for s in steps]
        lines.append(
            f"    {minutes:4.1f} min  in all (limit {INVOCATION_LIMIT_MIN:g} per invocation)"
        )
    lines += [
        f"  total {total:.1f} min (limit {TOTAL_LIMIT_MIN:g}); `--part all` (the default) runs "
        "both parts in one invocation, the env and wheels steps once",
        "  separate invocations write separate folders: python3 bench/gpu/report.py DIR1 DIR2 merges them into BENCHMARKS.md",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the results folder


def open_results(out: Path, env: dict) -> dict:
    """env.json for this invocation: earlier parts in `out` are kept if they ran on this machine
    (GPU, driver, torch) at this commit; another machine's files are deleted, not mixed in."""
    out.mkdir(parents=True, exist_ok=True)
    old = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    same = all(old.get(k) == env.get(k) for k in ("gpu", "driver", "torch", "commit"))
    parts = old.get("parts", {}) if same else {}
    for part, names in PART_FILES.items():
        if part not in parts:
            for name in names:
                (out / name).unlink(missing_ok=True)
    return {**env, "parts": parts}


def write_report(args: argparse.Namespace) -> None:
    """section.md in the results folder, and the same section in BENCHMARKS.md."""
    from report import MARK_BEGIN, MARK_END, load_results, render_section, write_section

    section = render_section(load_results([args.out]))
    (args.out / "section.md").write_text(section)
    write_section(args.benchmarks, section, MARK_BEGIN, MARK_END)
    print(
        f"run.sh: wrote {args.out / 'section.md'} and the gpu_tier section of {args.benchmarks}",
        flush=True,
    )


# ----------------------------------------------------------------------------- running a part


def default_sigint() -> None:
    """In a child, before it runs: SIGINT back to its default. A run.sh started in the background
    (`nohup ... &`, a batch script) passes SIGINT on ignored, and a Python started so never turns it
    into KeyboardInterrupt: the time limit's SIGINT would be lost and pytest write no junit.xml."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_limited(
    cmd: list[str], log_path: Path, limit_s: float, env: dict[str, str]
) -> tuple[str, int]:
    """Run cmd, its output into log_path and ours; SIGINT to its group at limit_s, SIGKILL later."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    out = getattr(sys.stdout, "buffer", None)  # pytest's capture may give a text stream only
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=default_sigint,
        )

        def copy() -> None:  # chunks, not lines: pytest -q prints its dots without newlines
            for chunk in iter(lambda: os.read(proc.stdout.fileno(), 65536), b""):
                log.write(chunk)
                log.flush()
                if out is not None:
                    out.write(chunk)
                else:
                    sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=limit_s)
            status = f"finished (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                rc = proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            status = f"stopped at the {limit_s / 60:g}-minute limit"
        reader.join(timeout=10)
    return status, rc


def part_command(
    part: str,
    python: str,
    out: Path,
    bench_limit_min: float = BENCH_LIMIT_MIN,
    test_workers: int = TEST_WORKERS,
) -> list[str]:
    if part == "tests":
        # tests/gpu/ holds every GPU test: the CPU tiers' modules import packages a GPU image may
        # lack (kubernetes, mlflow), which would count as errors here. --continue-on-collection-
        # errors: a GPU module whose import fails must not stop the others (junit.xml counts it)
        flags = "-m gpu -q -p no:cacheprovider --continue-on-collection-errors".split()
        if test_workers > 1:  # a file per worker: a module's fixtures (one doctor run) stay one
            flags += ["-n", str(test_workers), "--dist", "loadfile"]
        return [python, "-m", "pytest", *flags, "--junitxml", str(out / "junit.xml"), "tests/gpu"]
    budget = ["--budget-s", str(bench_budget_s(bench_limit_min))]
    return [python, "bench/gpu/gpt2.py", "--out", str(out / "bench.json"), *budget]


def run_part(part: str, args: argparse.Namespace, env: dict) -> bool:
    """Run one part under its limit, record it in env.json, rewrite the section; True if passed."""
    out = args.out
    for name in PART_FILES[part]:
        (out / name).unlink(missing_ok=True)  # a part that dies leaves no earlier run's file behind
    cmd = part_command(part, args.python, out, args.bench_limit_min, args.test_workers)
    limit = 60 * (args.tests_limit_min if part == "tests" else args.bench_limit_min)
    start = time.monotonic()
    log = out / PART_FILES[part][1]
    status, rc = run_limited(cmd, log, limit, part_env(env["wheels"] is not None))
    shown = shlex.join(["python3", *cmd[1:]]).replace(f"{out}/", "OUT/")
    env["parts"][part] = {
        "command": shown,
        "status": status,
        "rc": rc,
        "wall_s": time.monotonic() - start,
        "limit_s": limit,
    }
    (out / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    write_report(args)
    return rc == 0 and status.startswith("finished")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bash bench/gpu/run.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", action="store_true", help="print the steps and minutes; run nothing")
    p.add_argument("--part", choices=("tests", "bench", "all"), default="all")
    p.add_argument("--wheels", type=Path, metavar="DIR", help="install DIR/*.whl first (offline)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("gpu-results"),
        help="results folder, at most 8 files (default gpu-results/)",
    )
    p.add_argument(
        "--benchmarks",
        type=Path,
        default=ROOT / "BENCHMARKS.md",
        help="the markdown file whose GPU section is rewritten",
    )
    p.add_argument("--tests-limit-min", type=float, default=TESTS_LIMIT_MIN)
    p.add_argument("--bench-limit-min", type=float, default=BENCH_LIMIT_MIN)
    p.add_argument(
        "--test-workers",
        type=int,
        default=TEST_WORKERS,
        help=f"pytest-xdist workers for the tests (default {TEST_WORKERS}; 1: one after the other)",
    )
    args = p.parse_args(argv)
    args.python = os.environ.get("LOCKSTEP_PYTHON", "python3")
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.plan:
        print(plan_text(args.tests_limit_min, args.bench_limit_min))
        return 0
    reason = no_cuda_reason()
    if reason:
        print(
            f"run.sh: no CUDA device here ({reason}); the GPU tier needs one NVIDIA GPU: nothing "
            "was run (--plan shows the steps)",
            file=sys.stderr,
        )
        return 2
    wheels = install_wheels(args.wheels, args.python) if args.wheels else None
    command = "bash bench/gpu/run.sh" + (" " + shlex.join(argv) if argv else "")
    try:
        env = open_results(args.out, describe_machine(args.python, wheels, command))
    except NoCuda as e:
        print(f"run.sh: {e}", file=sys.stderr)
        return 2
    (args.out / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    print(
        f"run.sh: {env['gpu']}, driver {env['driver']}, torch {env['torch']}, CUDA {env['cuda']}, "
        f"lockstep {env['commit']}; results in {args.out}",
        flush=True,
    )
    parts = ("tests", "bench") if args.part == "all" else (args.part,)
    ok = [run_part(part, args, env) for part in parts]
    done = ", ".join(f"{part} {env['parts'][part]['status']}" for part in parts)
    print(f"run.sh: {done}; results in {args.out}")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
