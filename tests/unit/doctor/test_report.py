"""The doctor's verdicts (lockstep/doctor/report.py): the checks fed facts from clusters this machine does not have
(GPUs, several hosts), the sizes and spans they print, and the human report."""

from __future__ import annotations

import pytest

from lockstep.doctor import MiB, Report, build_checks, bus_bandwidth, format_report, parse_size, span
from lockstep.doctor.report import bandwidth_sizes, format_size
from lockstep.errors import ConfigError


def fact(rank, host="a", local_rank=None, device="cpu", device_id=None, torch_version="2.13.0", seen=None):
    local_rank = rank if local_rank is None else local_rank
    return {"rank": rank, "local_rank": local_rank, "local_world_size": 2, "host": host, "device": device,
            "device_id": device_id or device, "device_error": None, "pid": 1,
            "versions": {"python": "3.11.7", "torch": torch_version, "lockstep": "0.1.0", "cuda": "12.4",
                         "nccl": "2.21.5"},
            "env": {"OMP_NUM_THREADS": "4"}, "all_reduce": {"float32 x 257": "ok"},
            "ring": {"ok": True, "from": 0, "seconds": 0.001}, "barrier": [0.001] * 20, "clock": [100.0 + rank * 1e-4],
            "fs": {"error": None, "errno": None, "seen": seen if seen is not None else [0, 1], "free_bytes": 100 << 30,
                   "disk_path": "/runs"}}


def checks(facts) -> dict:
    bw = [{"size": "64 MiB", "busbw_gbps": 1.0, "algbw_gbps": 1.0}]
    return {c.name: c for c in build_checks(facts, bw, "/runs", "nccl")}


def test_two_ranks_on_one_gpu_fail_with_the_fix():
    c = checks([fact(0, device="cuda:0", device_id="GPU-1"), fact(1, device="cuda:0", device_id="GPU-1")])["devices"]
    assert c.status == "fail" and "2 ranks on one GPU cuda:0 (ranks 0-1 on host a)" in c.detail
    assert c.fix == "set CUDA_VISIBLE_DEVICES per rank or launch one process per GPU"
    ok = checks([fact(0, device="cuda:0", device_id="GPU-1"), fact(1, device="cuda:1", device_id="GPU-2"),
                 fact(2, host="b", local_rank=0, device="cuda:0", device_id="GPU-3")])["devices"]
    assert ok.status == "ok", ok.detail


def test_version_mismatch_names_the_ranks():
    c = checks([fact(0), fact(1), fact(2, host="b", local_rank=0, torch_version="2.12.0")])["versions"]
    assert c.status == "fail"
    assert "torch differs: 2.13.0 on ranks 0-1 on host a, 2.12.0 on rank 2 on host b" in c.detail
    assert "same container image or venv" in c.fix


def test_unshared_filesystem_and_clock_skew_warn():
    facts = [fact(0, seen=[0, 1]), fact(1, seen=[0, 1]), fact(2, host="b", local_rank=0, seen=[2])]
    facts[2]["clock"] = [105.0]
    got = checks(facts)
    assert got["shared filesystem"].status == "warn"
    assert "rank 2 (host b) sees no other rank's marker: not shared" in got["shared filesystem"].detail
    assert got["clock skew"].status == "warn"
    assert "rank 2 (b) is 4.999 s ahead of rank 0 (a) (barrier latency 1.00 ms subtracted)" in got["clock skew"].detail
    assert all(c.ok for c in got.values())  # warnings keep exit code 0


def test_low_disk_and_helpers():
    facts = [fact(0), fact(1)]
    facts[1]["fs"]["free_bytes"] = 512 * MiB
    assert checks(facts)["free disk"].status == "fail"
    assert parse_size("64MiB") == 64 * MiB and parse_size("256k") == 256 * 1024 and parse_size("1GiB") == 1 << 30
    with pytest.raises(ConfigError, match="e.g. 64MiB"):
        parse_size("lots")
    assert bus_bandwidth(10.0, 8) == pytest.approx(17.5) and span([0, 1, 2, 5]) == "ranks 0-2, 5"


def test_one_process_skips_the_group_checks_with_a_tip():
    got = build_checks([fact(0)], [], "/runs", None)
    assert [c.name for c in got] == ["process group", "devices", "versions", "output dir writable", "free disk",
                                     "environment"]
    assert got[0].status == "skip" and got[0].advice == [
        "check N ranks with `lockstep doctor --nproc N`, or run it under torchrun / srun"]
    assert all(c.ok for c in got)  # a skip is no failure


def test_wrong_sums_and_a_broken_ring_fail_with_their_fixes():
    facts = [fact(0), fact(1)]
    facts[1]["all_reduce"]["float32 x 257"] = "wrong: element 3 is 5.0, expected 4.0"
    facts[1]["ring"] = {"ok": False, "from": 0, "seconds": 0.1}
    got = checks(facts)
    assert got["all_reduce correctness"].status == "fail"
    assert got["all_reduce correctness"].detail == "float32 x 257 on rank 1: wrong: element 3 is 5.0, expected 4.0"
    assert "NCCL_P2P_DISABLE=1 or NCCL_IB_DISABLE=1" in got["all_reduce correctness"].fix
    assert got["p2p ring"].status == "fail"
    assert got["p2p ring"].detail == "wrong payload received on 0 -> 1 (sender -> receiver)"


def test_environment_that_slows_or_hangs_a_job_warns():
    facts = [fact(0), fact(1)]
    facts[0]["env"] = {"NCCL_P2P_DISABLE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "OMP_NUM_THREADS": "4"}
    env = checks(facts)["environment"]
    assert env.status == "warn" and env.ok
    assert env.fix.startswith("NCCL_P2P_DISABLE=1 turns off direct GPU-to-GPU copies (rank 0): unset it")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 leaves the other ranks hanging when one fails" in env.fix
    assert "NCCL_P2P_DISABLE differs: 1 on rank 0, <unset> on rank 1" in env.advice


def test_sizes():
    assert format_size(512) == "512 B" and format_size(1536) == "1.5 KiB" and format_size(3 << 30) == "3 GiB"
    assert bandwidth_sizes(64 * MiB) == [1024 * 4 ** i for i in range(9)]
    assert bandwidth_sizes(5000) == [1024, 4096, 5000]  # the largest is the one asked for, in whole float32s
    assert bandwidth_sizes(5001)[-1] == 5000


def test_human_report_has_a_row_per_check_a_fix_under_each_failure_and_a_verdict():
    facts = [fact(0), fact(1)]
    facts[1]["fs"]["free_bytes"] = 512 * MiB
    bw = [{"bytes": 1024, "size": "1 KiB", "iterations": 20, "time_us": 50.0, "algbw_gbps": 0.02048,
           "busbw_gbps": 0.02048}]
    ranks = [{"rank": r, "local_rank": r, "host": "a", "device": "cpu", **facts[r]["versions"]} for r in (0, 1)]
    report = Report("2 ranks on 1 host (gloo, standalone); output dir /runs", build_checks(facts, bw, "/runs", "gloo"),
                    ranks, bw)
    data = report.to_dict()
    assert data["ok"] is False and [c["name"] for c in data["checks"] if not c["ok"]] == ["free disk"]
    lines = format_report(data).splitlines()
    assert lines[0] == "lockstep doctor: 2 ranks on 1 host (gloo, standalone); output dir /runs"
    assert lines[2].split() == ["rank", "local_rank", "host", "device", "python", "torch", "lockstep", "cuda", "nccl"]
    assert lines[3].split() == ["0", "0", "a", "cpu", "3.11.7", "2.13.0", "0.1.0", "12.4", "2.21.5"]
    disk = next(i for i, line in enumerate(lines) if line.startswith("free disk"))
    assert lines[disk].split()[2] == "FAIL"
    assert lines[disk + 1].strip().startswith("fix: free space on /runs or point --output-dir at a larger filesystem")
    assert lines[-4:-2] == [" size  iters  time (us)  algbw (GB/s)  busbw (GB/s)",
                            "1 KiB     20       50.0         0.020         0.020"]
    assert lines[-1] == "lockstep doctor: FAILED: 1 of 12 checks (free disk)"
