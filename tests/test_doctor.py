"""lockstep doctor on real processes: a healthy 2-rank job, a failing check with its fix, an unreachable store;
and the checks themselves fed facts from clusters this machine does not have (GPUs, several hosts)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from lockstep.errors import ConfigError
from lockstep.doctor import MiB, build_checks, bus_bandwidth, parse_size, span

SIZES = ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB"]


def doctor(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lockstep", "doctor", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def check_rows(table: str) -> dict[str, tuple[str, str]]:
    """'name  status  detail' rows of the human table -> {name: (status, detail)}."""
    rows, inside = {}, False
    for line in table.splitlines():
        if line.startswith("check "):
            inside = True
        elif inside and not line.strip():
            break
        elif inside and not line.startswith(" "):
            m = re.match(r"(\S+(?: \S+)*?)\s{2,}(ok|warn|FAIL|skip)\s+(.*)", line)
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_two_ranks_table(tmp_path):
    out = tmp_path / "run"
    proc = doctor("--nproc", 2, "--output-dir", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    text = proc.stdout
    assert "2 ranks on 1 host (gloo" in text
    ranks = [line.split() for line in text.splitlines() if re.match(r"\s+[01]\s+[01]\s+\S+\s+cpu\s", line)]
    assert [r[:2] for r in ranks] == [["0", "0"], ["1", "1"]]
    rows = check_rows(text)
    for name in ("process group", "devices", "versions", "all_reduce correctness", "all_reduce bandwidth",
                 "p2p ring", "barrier latency", "clock skew", "output dir writable", "shared filesystem",
                 "free disk", "environment"):
        assert rows[name][0] == "ok", (name, rows[name])
    assert "float32, float64, int64, bfloat16" in rows["all_reduce correctness"][1]
    assert f"ranks 0-1 share {out}" in rows["shared filesystem"][1]
    bw = text.split("busbw (GB/s)\n", 1)[1].split("\n\n")[0].splitlines()
    assert [" ".join(line.split()[:2]) for line in bw] == SIZES
    assert text.rstrip().endswith("no check failed (0 warnings)")
    assert not out.exists()  # the doctor created it for its markers and removed them, and it


def test_two_ranks_json(tmp_path):
    (tmp_path / "keep.txt").write_text("user file")
    proc = doctor("--nproc", 2, "--output-dir", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)  # stdout is one JSON document, nothing else
    assert report["ok"] is True and all(c["ok"] for c in report["checks"])
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert {c["name"]: c["status"] for c in report["checks"]}["shared filesystem"] == "ok"
    bw = report["bandwidth"]
    assert [b["bytes"] for b in bw] == [1024 * 4 ** i for i in range(9)] and bw[-1]["bytes"] == 64 * MiB
    for b in bw:
        assert b["algbw_gbps"] > 0 and b["busbw_gbps"] == pytest.approx(b["algbw_gbps"] * 2 * (2 - 1) / 2)
        assert b["algbw_gbps"] == pytest.approx(b["bytes"] / (b["time_us"] / 1e6) / 1e9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]  # markers and .doctor removed


def test_unwritable_output_dir_fails_with_a_fix(tmp_path):
    # tests run as root, where chmod does not stop writes: a path through a regular file cannot be created
    (tmp_path / "file.txt").write_text("")
    proc = doctor("--nproc", 2, "--output-dir", tmp_path / "file.txt" / "sub", "--max-size", "64KiB")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    rows = check_rows(proc.stdout)
    assert rows["output dir writable"][0] == "FAIL"
    assert "fix: pass --output-dir a directory every rank can create and write" in proc.stdout
    assert f"{tmp_path / 'file.txt'} is a file, not a directory" in proc.stdout
    assert rows["all_reduce correctness"][0] == rows["p2p ring"][0] == "ok"  # the other checks still ran
    assert "FAILED: 1 of" in proc.stdout and "Traceback" not in proc.stderr


def test_unreachable_store_fails_in_bounded_time(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nobody listens on it once closed
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "x"}
    start = time.monotonic()
    proc = doctor("--timeout", 5, "--output-dir", tmp_path, env=env, timeout=60)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"rank 1 of 2 could not reach the rendezvous store at 127.0.0.1:{port}" in proc.stderr
    assert "fix: start every rank with the same MASTER_ADDR / MASTER_PORT" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- the checks on facts from clusters this machine does not have ----

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
