"""bench/suite_cpu.py: a pytest run with the plugin writes each test's CPU seconds, a process the test
starts counted in (it inherits its worker's cgroup), and the report names the costly test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import suite_cpu  # noqa: E402

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"


def test_a_child_process_s_cpu_is_the_test_s_and_the_report_names_it(tmp_path):
    if not os.access(suite_cpu.CGROUP, os.W_OK):
        pytest.skip(f"no writable cpuacct cgroup hierarchy at {suite_cpu.CGROUP}")
    (tmp_path / "test_two.py").write_text(
        "import subprocess, sys\n\n"
        "def test_busy_child():\n"
        f"    subprocess.run([sys.executable, '-c', {BUSY!r}], check=True)\n\n"
        "def test_idle():\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(BENCH), "LOCKSTEP_SUITE_CPU_DIR": str(tmp_path / "out")}
    for name in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):
        env.pop(name, None)  # the run below is a plain pytest, not one of this suite's workers
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "suite_cpu",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(tmp_path / "test_two.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "main.jsonl").read_text().splitlines()]
    cpu = {r["id"].split("::")[1]: r["cpu"] for r in rows}
    assert cpu["test_busy_child"] >= 0.5 and cpu["test_idle"] < 0.2, cpu
    text = suite_cpu.report(suite_cpu.load(tmp_path / "out"), None, 5)
    assert text.startswith("2 tests, ") and "test_two.py::test_busy_child" in text.splitlines()[-2]
    half = {k: v / 2 for k, v in suite_cpu.load(tmp_path / "out").items()}
    against = suite_cpu.report(suite_cpu.load(tmp_path / "out"), half, 5)
    assert "against " in against and "test_two.py" in against.splitlines()[-1]
