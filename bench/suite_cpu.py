"""Where the test suite's CPU goes, test by test, while it runs as CI runs it (three xdist workers).

A pytest plugin (`-p suite_cpu`) moves each pytest worker into a cpuacct cgroup of its own, which every
process it starts inherits (ranks, torchrun's agents, Slurm's daemons, namespace nodes), and writes
each test's CPU seconds: the group's usage at its end minus at its start, its fixtures' setup
included. On a machine where tests run side by side, wall times say little about what each costs;
this does (issue 26: what to cut, and what coverage's tracer costs each test).

    PYTHONPATH=bench .venv/bin/python -m pytest -p suite_cpu -n 3 --dist loadfile \\
        --no-loadscope-reorder --cov                  # OUT: $LOCKSTEP_SUITE_CPU_DIR or ./suite-cpu
    python bench/suite_cpu.py OUT [--against OTHER] [--top 30]

The report prints the CPU seconds by tier, by file and the costliest tests; with --against another
run's folder (the same suite without --cov, say), the difference per file. Needs root and a cgroup
v1 cpuacct hierarchy; without one the plugin writes nothing and says so once. Numbers go to
BENCHMARKS.md, "The test suite on a fresh clone"; nothing here is a threshold.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

CGROUP = Path("/sys/fs/cgroup/cpuacct")
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
OUT = Path(os.environ.get("LOCKSTEP_SUITE_CPU_DIR", "suite-cpu"))
_group: Path | None = None


def _usage() -> int:
    return int((_group / "cpuacct.usage").read_text())


def pytest_configure(config) -> None:
    global _group
    group = CGROUP / f"lockstep-suite-{os.getpid()}-{WORKER}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        print(f"suite_cpu: no cpuacct cgroup here ({e}); nothing measured", file=sys.stderr)
        return
    _group = group
    OUT.mkdir(parents=True, exist_ok=True)


def pytest_unconfigure(config) -> None:
    """Back to the root group; this one goes once the processes left in it have."""
    if _group is not None:
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
        try:
            _group.rmdir()
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The group's CPU and the wall time around the whole test."""
    if _group is None:
        yield
        return
    used, start = _usage(), time.time()
    yield
    row = {"id": item.nodeid, "cpu": (_usage() - used) / 1e9, "wall": time.time() - start}
    with (OUT / f"{WORKER}.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def load(folder: Path) -> dict[str, float]:
    rows = [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.open()]
    return {r["id"]: r["cpu"] for r in rows}


def report(run: dict[str, float], other: dict[str, float] | None, top: int) -> str:
    def by(key, rows):
        out = collections.defaultdict(float)
        for test, cpu in rows.items():
            out[key(test)] += cpu
        return out

    def file_of(test: str) -> str:
        return test.split("::")[0]

    def tier_of(test: str) -> str:  # tests/unit/..., tests/e2e/...
        parts = file_of(test).split("/")
        return parts[1] if len(parts) > 2 else "."

    lines = [f"{len(run)} tests, {sum(run.values()):.0f} CPU-s in all"]
    tiers = by(tier_of, run)
    lines.append(", ".join(f"{tier} {cpu:.0f}" for tier, cpu in sorted(tiers.items())))
    files, others = by(file_of, run), by(file_of, other or {})
    if other is not None:
        lines.append(f"against {sum(other.values()):.0f} CPU-s; file: this, other, difference")
        for f in sorted(files, key=lambda f: others.get(f, 0) - files[f])[:top]:
            lines.append(
                f"{files[f]:8.1f} {others.get(f, 0):8.1f} {files[f] - others.get(f, 0):+8.1f}  {f}"
            )
        return "\n".join(lines)
    lines += [f"{cpu:8.1f}  {f}" for f, cpu in sorted(files.items(), key=lambda x: -x[1])[:top]]
    lines += [f"{cpu:8.1f}  {t}" for t, cpu in sorted(run.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder the plugin wrote")
    parser.add_argument("--against", type=Path, help="another run's folder, to compare with")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    other = load(args.against) if args.against else None
    print(report(load(args.out), other, args.top))


if __name__ == "__main__":
    main()
