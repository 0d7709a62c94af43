"""The GPU tier's harness, checked where no GPU is: bench/gpu/run.sh's refusal and plan, a results
folder turned into BENCHMARKS.md's GPU section, the time limit that still leaves junit.xml, and the
GPT-2 bench's logic on a tiny model on the CPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import report as gpu_report  # noqa: E402
import tier as gpu_tier  # noqa: E402
from gpt2 import GPT2  # noqa: E402

RUN_SH = ROOT / "bench" / "gpu" / "run.sh"


def run_sh(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", str(RUN_SH), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env or dict(os.environ),
        cwd=ROOT,
    )
    return proc, time.perf_counter() - start


# ----------------------------------------------------------------------------- plan and refusal


def test_each_invocation_fits_10_minutes_and_all_of_them_a_sessions_device_time():
    per_part = {
        part: sum(s.minutes for s in gpu_tier.steps_of(part)) for part in ("tests", "bench")
    }
    assert all(minutes < 10 for minutes in per_part.values()), per_part
    assert sum(per_part.values()) <= gpu_tier.TOTAL_LIMIT_MIN <= 15 - 1  # a machine starts in ~1
    # the parts' time limits are what bounds them: each estimate covers its limit
    assert (
        per_part["tests"] >= gpu_tier.TESTS_LIMIT_MIN
        and per_part["bench"] >= gpu_tier.BENCH_LIMIT_MIN
    )
    # gpt2.py stops its own runs before the part's limit kills it
    assert gpu_tier.BENCH_BUDGET_S + 60 < 60 * gpu_tier.BENCH_LIMIT_MIN
    # ... also under a --bench-limit-min of its own: the budget follows the limit it is given
    for limit in (3.5, 4.0, 8.0):
        budget = gpu_tier.bench_budget_s(limit)
        assert budget + 60 < 60 * limit, (limit, budget)
        cmd = gpu_tier.part_command("bench", "python3", Path("out"), limit)
        assert cmd[-2:] == ["--budget-s", str(budget)], cmd


def test_the_tests_run_on_xdist_workers_a_file_each_unless_one_is_asked():
    cmd = gpu_tier.part_command("tests", "python3", Path("out"))
    assert cmd[cmd.index("-n") : cmd.index("-n") + 4] == ["-n", "4", "--dist", "loadfile"], cmd
    assert cmd[-1] == "tests/gpu" and "out/junit.xml" in cmd
    serial = gpu_tier.part_command("tests", "python3", Path("out"), test_workers=1)
    assert "-n" not in serial and serial == [
        x for x in cmd if x not in ("-n", "4", "--dist", "loadfile")
    ]
    args = gpu_tier.parse_args(["--test-workers", "2", "--out", "x"])
    assert args.test_workers == 2


def test_plan_prints_the_steps_and_runs_nothing(tmp_path):
    proc, _ = run_sh("--plan", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    total = re.search(r"total (\d+\.\d) min \(limit 14\)", proc.stdout)
    assert total and float(total.group(1)) <= 14, proc.stdout
    for step in ("env", "wheels", "tests", "bench", "report"):
        assert re.search(rf"\d+\.\d min  {step} ", proc.stdout), step
    assert proc.stdout.count("in all (limit 10 per invocation)") == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or any(Path("/dev").glob("nvidia[0-9]*")),
    reason="this machine has nvidia-smi or /dev/nvidia*: the cheap refusal does not apply",
)
def test_without_cuda_one_line_and_exit_2_in_under_5_seconds(tmp_path):
    proc, seconds = run_sh("--out", str(tmp_path / "out"))
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert "no CUDA device" in lines[0] and "nvidia-smi" in lines[0]
    assert seconds < 5
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA device here")
def test_nvidia_smi_present_but_torch_without_cuda_also_refuses(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA Test GPU, 999.1, 81559 MiB'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = dict(
        os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", LOCKSTEP_PYTHON=sys.executable
    )
    proc, _ = run_sh("--out", str(tmp_path / "out"), env=env)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert "torch.cuda.is_available() False" in lines[0] and "NVIDIA Test GPU" in lines[0]
    assert not (tmp_path / "out" / "env.json").exists()


# ----------------------------------------------------------------------------- the section

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">
<testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5" time="123.4">
<testcase classname="tests.gpu.test_train_cuda" name="test_picks_cuda_and_nccl" time="20.1"/>
<testcase classname="tests.gpu.test_compile" name="test_compile_keeps_losses" time="60.2"/>
<testcase classname="tests.gpu.test_fp16" name="test_overflow_is_skipped" time="3.0">
  <failure message="AssertionError: assert 0 == 1">trace</failure></testcase>
<testcase classname="tests.gpu.test_qlora" name="test_qlora_trains" time="0.0">
  <skipped type="pytest.skip" message="QLoRA needs bitsandbytes">reason</skipped></testcase>
<testcase classname="" name="tests.unit.launch.test_k8s" time="0.000">
  <error message="collection failure">Traceback
E   ModuleNotFoundError: No module named 'kubernetes'</error></testcase>
</testsuite></testsuites>
"""
ENV = {
    "gpu": "NVIDIA H100 80GB HBM3",
    "driver": "580.159.04",
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "python": "3.12.3",
    "transformers": "5.23.0",
    "bitsandbytes": "0.50.2",
    "commit": "0123456789ab",
    "date": "2026-12-01 10:00 UTC",
    "command": "bash bench/gpu/run.sh --part all --out /tmp/x",
    "facts": {"capability": "9.0", "memory_gib": 79.2, "multiprocessors": 132, "nccl": "2.27.5"},
    "wheels": None,
    "parts": {},
}


def run(impl: str, compiled: bool, tok: float | None, mem: float, status: str = "ok") -> dict:
    return dict(impl=impl, compile=compiled, status=status, tokens_per_s=tok, peak_mem_mb=mem)


def bench_json(raw_on: float = 500_000, ls_on: float | None = 480_000) -> dict:
    skipped = "ok" if ls_on else "skipped: time budget 390 s"
    runs = [
        run("raw", False, 400_000, 20_480),
        run("lockstep", False, 396_000, 21_504),
        run("raw", True, raw_on, 10_240),
        run("lockstep", True, ls_on, 11_264, skipped),
    ]
    return {
        "device": "NVIDIA H100 80GB HBM3",
        "precision": "bf16",
        "peak_flops": 790e12,
        "peak_runs": [780e12, 790e12, 785e12],
        "peak_size": 8192,
        "model": {**GPT2, "params": 123_587_328, "flops_per_token": 855e6},
        "batch": {"global": 32, "micro": 16, "accum": 2, "tokens_per_step": 32768, "why": "why"},
        "data_note": "byte tokens",
        "steps": 80,
        "warmup": 20,
        "log_interval": 10,
        "compile_modes": [False, True],
        "order": "raw, lockstep",
        "runs": runs,
        "commands": {
            "raw": "python3 bench/raw_loop.py ...",
            "lockstep": "python3 -m lockstep train ...",
        },
        "command": "python3 bench/gpu/gpt2.py --out OUT/bench.json",
        "wall_s": 400.0,
    }


def part(command: str, rc: int, wall_s: float, limit_s: float) -> dict:
    """A part's entry in env.json, as tier.run_part writes it."""
    status = f"finished (exit {rc})"
    return dict(command=command, status=status, rc=rc, wall_s=wall_s, limit_s=limit_s)


def results_folder(path: Path, tests: bool = True, bench: bool = True) -> Path:
    path.mkdir(parents=True)
    env = json.loads(json.dumps(ENV))
    if tests:
        (path / "junit.xml").write_text(JUNIT)
        env["parts"]["tests"] = part("python3 -m pytest -m gpu ... tests/gpu", 1, 130.0, 450.0)
    if bench:
        (path / "bench.json").write_text(json.dumps(bench_json()))
        env["parts"]["bench"] = part("python3 bench/gpu/gpt2.py ...", 0, 401.0, 480.0)
    (path / "env.json").write_text(json.dumps(env))
    return path


def test_a_results_folder_becomes_the_section_with_its_numbers(tmp_path):
    section = gpu_report.render_section(gpu_report.load_results([results_folder(tmp_path / "r")]))
    assert section.startswith("<!-- gpu_tier:begin") and section.rstrip().endswith(
        gpu_report.MARK_END
    )
    assert "driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130, NCCL 2.27.5" in section
    assert (
        "lockstep at `0123456789ab`" in section
        and "`bash bench/gpu/run.sh --part all --out /tmp/x`" in section
    )
    assert "5 tests: **2 passed, 1 failed, 1 errors, 1 skipped** (123 s, from junit.xml)" in section
    assert (
        "failed: `tests.gpu.test_fp16::test_overflow_is_skipped`: AssertionError: assert 0 == 1"
        in section
    )
    assert "No module named 'kubernetes'" in section  # a collection error says what it was
    # compile off: 396k / 400k = 0.990, met; on: 480k / 500k = 0.960, not met;
    # MFU 480k x 855M / 790T = 51.9%
    assert "| off | 400,000 | 396,000 | 0.990 | 43.3% | 42.9% | 20.00 GiB | 21.00 GiB |" in section
    assert "| on | 500,000 | 480,000 | 0.960 | 54.1% | 51.9% | 10.00 GiB | 11.00 GiB |" in section
    assert (
        "with compile off: **met** (0.9900)" in section
        and "with compile on: **not met** (0.9600)" in section
    )
    assert "MFU >= 45% with compile (lockstep): **met** (51.9%; raw 54.1%)" in section


def test_a_part_that_did_not_run_or_was_skipped_says_so(tmp_path):
    only_tests = gpu_report.render_section(
        gpu_report.load_results([results_folder(tmp_path / "t", bench=False)])
    )
    assert "Not run; no bench.json." in only_tests
    bench = bench_json(ls_on=None)  # lockstep's compile-on run skipped for time
    folder = results_folder(tmp_path / "b", tests=False)
    (folder / "bench.json").write_text(json.dumps(bench))
    section = gpu_report.render_section(gpu_report.load_results([folder]))
    assert "Not run; no junit.xml." in section
    assert "| on | 500,000 | not measured | not measured |" in section
    assert "(skipped: time budget 390 s)" in section
    assert "MFU >= 45% with compile (lockstep): not measured" in section


def test_separate_invocations_merge_and_the_file_is_rewritten_in_place(tmp_path):
    copy = tmp_path / "BENCHMARKS.md"
    shutil.copy(ROOT / "BENCHMARKS.md", copy)
    original = copy.read_text()
    dirs = [
        results_folder(tmp_path / "tests", bench=False),
        results_folder(tmp_path / "bench", tests=False),
    ]
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu" / "report.py"),
            *map(str, dirs),
            "--benchmarks",
            str(copy),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    once = copy.read_text()
    assert once.count("<!-- gpu_tier:begin") == 1 and once.count(gpu_report.MARK_END) == 1
    assert "**2 passed, 1 failed" in once and "| on | 500,000 | 480,000 |" in once
    if "<!-- gpu_tier:begin" not in original:  # appended: everything before it is kept as it was
        assert once.startswith(original.rstrip("\n"))
    gpu_report.update_benchmarks(dirs, copy)
    assert copy.read_text() == once  # idempotent
    gpu_report.update_benchmarks(dirs[:1], copy)  # replaced between the markers, the rest kept
    again = copy.read_text()
    assert again.count("<!-- gpu_tier:begin") == 1 and "Not run; no bench.json." in again
    outside = once.split("<!-- gpu_tier:begin")[0]
    assert again.startswith(outside)


def test_write_report_keeps_the_folder_small_and_flat(tmp_path):
    out = results_folder(tmp_path / "r")
    copy = tmp_path / "B.md"
    copy.write_text("# Benchmarks\n\nkept\n")
    gpu_tier.write_report(SimpleNamespace(out=out, benchmarks=copy))
    names = {p.name for p in out.iterdir()}
    assert (
        names <= set(gpu_report.FILES)
        and len(names) <= 8
        and all(p.is_file() for p in out.iterdir())
    )
    assert (out / "section.md").read_text() in copy.read_text() and copy.read_text().startswith(
        "# Benchmarks\n\nkept\n"
    )


def test_results_of_another_machine_are_not_kept(tmp_path):
    out = results_folder(tmp_path / "r")
    kept = gpu_tier.open_results(out, {**ENV, "parts": None})
    assert set(kept["parts"]) == {"tests", "bench"} and (out / "junit.xml").exists()
    moved = gpu_tier.open_results(out, {**ENV, "gpu": "NVIDIA H200", "parts": None})
    assert (
        moved["parts"] == {}
        and not (out / "junit.xml").exists()
        and not (out / "bench.json").exists()
    )


def test_the_time_limit_interrupts_pytest_which_still_writes_junit(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_fast():\n    pass\n\ndef test_slow():\n    time.sleep(600)\n"
    )
    junit, log = tmp_path / "junit.xml", tmp_path / "tests.log"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:timeout",
        "--junitxml",
        str(junit),
        str(tmp_path / "test_slow.py"),
    ]
    start = time.monotonic()
    # 12 s: pytest must start and pass test_fast first; with no plugin but its own it starts in ~0.5 s
    # (with the suite's, coverage and xdist included, it once took over 8 s on a loaded 2-core CI)
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    status, rc = gpu_tier.run_limited(cmd, log, limit_s=12, env=env)
    assert status == f"stopped at the {12 / 60:g}-minute limit" and rc != 0
    assert time.monotonic() - start < 90
    summary = gpu_report.parse_junit(junit)
    assert (
        summary["passed"] == 1
        and summary["interrupted"] == 1
        and "KeyboardInterrupt" in log.read_text()
    )


# ------------------------------------------------------------------------ the GPT-2 bench's logic


@pytest.mark.slow
def test_gpt2_bench_runs_both_sides_on_cpu_and_keeps_its_runs_when_a_time_limit_interrupts_it(
    tmp_path,
):
    """One quick bench of two repetitions, stopped by SIGINT (run.sh's time limit) once the first
    has run both sides: those runs are kept, and the table is printed with the interruption."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu" / "gpt2.py"), "--quick", "--device", "cpu"]
    proc = subprocess.Popen(
        [*cmd, "--reps", "2", "--out", str(out)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240

    def runs() -> int:
        return len(json.loads(out.read_text())["runs"]) if out.exists() else 0

    while runs() < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # bench.json is rewritten after every run
    os.killpg(proc.pid, signal.SIGINT)  # as run.sh does at its limit
    stdout = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, stdout[-3000:]
    bench = json.loads(out.read_text())
    assert bench["interrupted"].startswith("stopped by SIGINT")
    assert 2 <= len(bench["runs"]) < 4, bench["runs"]
    first = {r["impl"]: r for r in bench["runs"][:2]}
    assert set(first) == {"raw", "lockstep"} and all(r["status"] == "ok" for r in first.values())
    assert all(r["tokens_per_s"] > 0 for r in first.values())
    assert bench["batch"] == {
        **bench["batch"],
        "global": 8,
        "micro": 4,
        "accum": 2,
        "tokens_per_step": 8 * 64,
    }
    assert bench["peak_flops"] > 0 and bench["model"]["flops_per_token"] > 0
    assert "| off |" in stdout and "lockstep / raw" in stdout and "stopped by SIGINT" in stdout
    assert "stopped by SIGINT" in "\n".join(gpu_report.render_bench(bench))
