"""The output dir's rows (lockstep/doctor/filesystem.py) fed what each rank saw: a path it could not
create, a directory the ranks do not share, a full disk. The probe itself runs on 2 real processes
in test_probes.py, and against a real path through a regular file below."""

from __future__ import annotations

import errno
from pathlib import Path

from lockstep.config import DistributedConfig
from lockstep.doctor.filesystem import (
    DISK_FAIL,
    DISK_WARN,
    check_disk,
    check_shared,
    check_writable,
    probe_filesystem,
)
from lockstep.doctor.report import MiB
from lockstep.runtime import init_runtime, shutdown_runtime
from unit.doctor.facts import fact


def test_a_rank_that_cannot_write_fails_with_the_reason_for_its_errno():
    facts = [fact(0), fact(1, host="b", local_rank=0)]
    facts[1]["fs"] = {
        **facts[1]["fs"],
        "error": "Read-only file system: /runs/.doctor",
        "errno": errno.EROFS,
    }
    c = check_writable(facts, "/runs")
    assert c.status == "fail"
    assert (
        c.detail
        == "/runs cannot be written on rank 1 on host b: Read-only file system: /runs/.doctor"
    )
    assert c.fix.endswith("here /runs is on a read-only filesystem")
    assert check_writable([fact(0), fact(1)], "/runs").status == "ok"


def test_ranks_that_see_different_markers_do_not_share_the_dir():
    facts = [fact(0, seen=[0, 1]), fact(1, seen=[0, 1]), fact(2, host="b", local_rank=0, seen=[2])]
    c = check_shared(facts, "/runs")
    assert c.status == "warn" and c.ok
    assert c.detail == (
        "ranks 0-1 on host a see the markers of ranks 0-1; rank 2 (host b) sees no other rank's "
        "marker: not shared"
    )
    assert "a filesystem every node mounts at the same path" in c.fix
    assert (
        check_shared([fact(0), fact(1)], "/runs").detail
        == "ranks 0-1 share /runs (each sees every marker)"
    )


def test_free_disk_warns_then_fails():
    def free(n):
        facts = [fact(0), fact(1)]
        facts[1]["fs"]["free_bytes"] = n
        return check_disk(facts)

    assert free(DISK_WARN + 1).status == "ok"
    assert free(DISK_WARN - 1).status == "warn" and free(DISK_FAIL - 1).status == "fail"
    c = free(512 * MiB)
    assert c.detail == "512 MiB free on /runs (lowest, rank 1 on host a); below 1 GiB"
    assert c.fix.startswith("free space on /runs or point --output-dir at a larger filesystem")


def test_one_process_probe_through_a_regular_file(tmp_path, restore_torch_threads):
    (tmp_path / "file.txt").write_text("")
    rt = init_runtime(DistributedConfig(device="cpu"), {})
    try:
        fs = probe_filesystem(rt, Path(tmp_path / "file.txt" / "runs"), "n0nce")
    finally:
        shutdown_runtime(rt)
    # the nearest existing path is the file: its disk is the one measured
    assert (
        fs["errno"] == errno.ENOTDIR
        and fs["seen"] == []
        and fs["disk_path"] == str(tmp_path / "file.txt")
    )
    c = check_writable([{**fact(0), "fs": fs}], "out")
    assert c.status == "fail" and c.fix.endswith(
        f"here {tmp_path / 'file.txt'} is a file, not a directory"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]
