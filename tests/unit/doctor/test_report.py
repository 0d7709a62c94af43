"""The doctor's report (lockstep/doctor/report.py): the sizes and spans it prints, the ranks it
groups, and the human report with a row per check, a fix under each failure and a verdict."""

from __future__ import annotations

import pytest

from lockstep.doctor import (
    MiB,
    Report,
    build_checks,
    bus_bandwidth,
    format_report,
    parse_size,
    span,
)
from lockstep.doctor.report import bandwidth_sizes, by_value, format_size, where
from lockstep.errors import ConfigError
from unit.doctor.facts import fact


def test_helpers():
    assert (
        parse_size("64MiB") == 64 * MiB
        and parse_size("256k") == 256 * 1024
        and parse_size("1GiB") == 1 << 30
    )
    with pytest.raises(ConfigError, match="e.g. 64MiB"):
        parse_size("lots")
    assert bus_bandwidth(10.0, 8) == pytest.approx(17.5) and span([0, 1, 2, 5]) == "ranks 0-2, 5"


def test_sizes():
    assert (
        format_size(512) == "512 B"
        and format_size(1536) == "1.5 KiB"
        and format_size(3 << 30) == "3 GiB"
    )
    assert bandwidth_sizes(64 * MiB) == [1024 * 4**i for i in range(9)]
    # the largest is the one asked for, in whole float32s
    assert bandwidth_sizes(5000) == [1024, 4096, 5000]
    assert bandwidth_sizes(5001)[-1] == 5000


def test_human_report_has_a_row_per_check_a_fix_under_each_failure_and_a_verdict():
    facts = [fact(0), fact(1)]
    facts[1]["fs"]["free_bytes"] = 512 * MiB
    bw = [
        {
            "bytes": 1024,
            "size": "1 KiB",
            "iterations": 20,
            "time_us": 50.0,
            "algbw_gbps": 0.02048,
            "busbw_gbps": 0.02048,
        }
    ]
    ranks = [
        {"rank": r, "local_rank": r, "host": "a", "device": "cpu", **facts[r]["versions"]}
        for r in (0, 1)
    ]
    report = Report(
        "2 ranks on 1 host (gloo, standalone); output dir /runs",
        build_checks(facts, bw, "/runs", "gloo"),
        ranks,
        bw,
    )
    data = report.to_dict()
    assert data["ok"] is False and [c["name"] for c in data["checks"] if not c["ok"]] == [
        "free disk"
    ]
    lines = format_report(data).splitlines()
    assert lines[0] == "lockstep doctor: 2 ranks on 1 host (gloo, standalone); output dir /runs"
    assert lines[2].split() == [
        "rank",
        "local_rank",
        "host",
        "device",
        "python",
        "torch",
        "lockstep",
        "cuda",
        "nccl",
    ]
    assert lines[3].split() == ["0", "0", "a", "cpu", "3.11.7", "2.13.0", "0.1.0", "12.4", "2.21.5"]
    disk = next(i for i, line in enumerate(lines) if line.startswith("free disk"))
    assert lines[disk].split()[2] == "FAIL"
    assert (
        lines[disk + 1]
        .strip()
        .startswith("fix: free space on /runs or point --output-dir at a larger filesystem")
    )
    assert lines[-4:-2] == [
        " size  iters  time (us)  algbw (GB/s)  busbw (GB/s)",
        "1 KiB     20       50.0         0.020         0.020",
    ]
    assert lines[-1] == "lockstep doctor: FAILED: 1 of 14 checks (free disk)"


def test_ranks_are_named_by_host_and_grouped_by_value():
    facts = [fact(0), fact(1), fact(2, host="b", local_rank=0), fact(3, host="b", local_rank=1)]
    facts[3]["versions"]["torch"] = "2.12.0"
    assert where(facts, [3, 0, 2, 1]) == "ranks 0-1 on host a; ranks 2-3 on host b"
    assert by_value(facts, lambda f: f["versions"]["torch"]) == {"2.13.0": [0, 1, 2], "2.12.0": [3]}
