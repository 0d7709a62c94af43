"""A rank throttled by the kernel: a cgroup with a CPU quota (CFS bandwidth control), as a container's
CPU limit or a noisy neighbour's share throttles a process. A process joins it by writing its pid to
the group's cgroup.procs; its threads then run at most `share` of one CPU in each period.

cgroup v1 (a `cpu` hierarchy: cpu.cfs_quota_us) and v2 (cpu.max, where the root enables the cpu
controller for its children) both work; a machine that allows neither (no root, no cpu controller)
raises Unavailable, and the tests that need it skip saying why.
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


def _make(name: str, share: float) -> Path:
    quota = max(1000, int(share * PERIOD_US))
    if (V1 / "cpu.cfs_quota_us").exists():
        group = V1 / name
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
        return group
    if "cpu" in (V2 / "cgroup.subtree_control").read_text().split():
        group = V2 / name
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        return group
    raise Unavailable("no cgroup cpu controller to set a quota in")


@contextlib.contextmanager
def cpu_quota(share: float):
    """A fresh cgroup whose processes get at most `share` of one CPU; yields its directory (a process
    joins by writing its pid to DIR/cgroup.procs). Removed afterwards, once its processes are gone."""
    name = f"lockstep-throttle-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group = _make(name, share)
    except OSError as e:
        raise Unavailable(f"cannot make a cgroup with a CPU quota: {e}") from None
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


def join(group: str | Path, pid: int | None = None) -> None:
    """Move process `pid` (default: this one), all its threads, into `group`."""
    Path(group, "cgroup.procs").write_text(str(pid or os.getpid()))


def leave(group: str | Path, pid: int | None = None) -> None:
    """Move process `pid` (default: this one) out of `group`, into the hierarchy's root."""
    join(Path(group).parent, pid)
