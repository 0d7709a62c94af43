"""A rank throttled by the kernel: a cgroup with a CPU quota (CFS bandwidth control), as a container's
CPU limit or a noisy neighbour's share throttles a process. A process joins it by writing its pid to
the group's cgroup.procs; its threads then run at most `share` of one CPU in each period.

cgroup v1 (a `cpu` hierarchy: cpu.cfs_quota_us) and v2 (cpu.max, where the root enables the cpu
controller for its children) both work; a machine that allows neither (no root, no cpu controller)
raises Unavailable, and the tests that need it skip saying why. A favoured cgroup (a high CPU weight)
keeps the ranks a test compares ahead of the test workers beside them: a pair of ranks on CI's two
busy cores once read 107 against 211 GFLOP/s, no quota on either.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

V1, V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
PERIOD_US = 20_000  # short periods: a throttled process runs in short bursts, not 100 ms ones


class Unavailable(Exception):
    pass


def _make(name: str, v1: dict[str, int], v2: dict[str, str]) -> Path:
    """A fresh cgroup at the cpu hierarchy's root with `v1` or `v2` settings, whichever it runs."""
    if (V1 / "cpu.cfs_quota_us").exists():
        group, settings = V1 / name, v1
    elif "cpu" in (V2 / "cgroup.subtree_control").read_text().split():
        group, settings = V2 / name, v2
    else:
        raise Unavailable("no cgroup cpu controller to set a quota in")
    group.mkdir()
    for file, value in settings.items():
        (group / file).write_text(str(value))
    return group


@contextlib.contextmanager
def _group(v1: dict[str, int], v2: dict[str, str]):
    """A fresh cgroup with these settings, yielded as its directory; removed afterwards, once its
    processes are gone."""
    name = f"lockstep-throttle-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group = _make(name, v1, v2)
    except OSError as e:
        raise Unavailable(f"cannot make a cgroup with CPU settings: {e}") from None
    try:
        yield group
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                group.rmdir()
                break
            except OSError:  # its last processes are still exiting
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)


def cpu_quota(share: float):
    """A cgroup whose processes get at most `share` of one CPU (a process joins by writing its pid
    to DIR/cgroup.procs)."""
    quota = max(1000, int(share * PERIOD_US))
    v1 = {"cpu.cfs_period_us": PERIOD_US, "cpu.cfs_quota_us": quota}
    return _group(v1, {"cpu.max": f"{quota} {PERIOD_US}"})


def cpu_favoured():
    """A cgroup whose processes run before the host's other ones: a hundred times the default
    weight (v1 cpu.shares 1024, v2 cpu.weight 100), so a test that compares ranks' speeds does not
    measure the test workers running beside it."""
    return _group({"cpu.shares": 102_400}, {"cpu.weight": "10000"})


def join(group: str | Path, pid: int | None = None) -> None:
    """Move process `pid` (default: this one), all its threads, into `group`."""
    Path(group, "cgroup.procs").write_text(str(pid or os.getpid()))


def leave(group: str | Path, pid: int | None = None, to: str | Path | None = None) -> None:
    """Move process `pid` (default: this one) out of `group`, into group `to` (default: the
    hierarchy's root)."""
    join(to or Path(group).parent, pid)
