"""The doctor's probes on real processes (lockstep/doctor/probes.py): each probe on a 2-process gloo group, the
doctor in-process on one; and `lockstep doctor` run as a user would: a healthy 2-rank job, a failing check with its
fix, an unreachable store."""

from __future__ import annotations

import ctypes
import json
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import run_lockstep, run_main, run_ranks

from lockstep.config import DistributedConfig
from lockstep.doctor import MiB, format_report, run_doctor
from lockstep.doctor.filesystem import probe_filesystem
from lockstep.doctor.probes import (
    probe_all_reduce,
    probe_bandwidth,
    probe_barrier,
    probe_clock,
    probe_local,
    probe_one_rank,
)
from lockstep.doctor.report import CORRECTNESS_DTYPES, CORRECTNESS_NUMEL, KiB
from lockstep.peak_flops import cpu_model
from lockstep.runtime import init_runtime, shutdown_runtime
from lockstep.train.links import probe_ring

SIZES = ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB"]


def doctor(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_lockstep("doctor", *args, timeout=timeout, check=False, env=env)


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


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One `lockstep doctor --nproc 2 --json` (the launcher and 2 workers) for the table and the
    JSON tests: the table is lockstep.doctor.format_report of that JSON document, as
    lockstep/cli/doctor.py prints it without --json. Its output dir does not exist: the doctor makes
    it for the markers and removes it (a user's files in an existing one stay:
    test_a_users_files_in_the_output_dir_stay)."""
    out = tmp_path_factory.mktemp("doctor") / "run"
    return doctor("--nproc", 2, "--output-dir", out, "--json"), out


def test_two_ranks_table(two_ranks):
    proc, out = two_ranks
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    text = format_report(json.loads(proc.stdout)) + "\n"
    assert "2 ranks on 1 host (gloo" in text
    ranks = [
        line.split()
        for line in text.splitlines()
        if re.match(r"\s+[01]\s+[01]\s+\S+\s+cpu\s", line)
    ]
    assert [r[:2] for r in ranks] == [["0", "0"], ["1", "1"]]
    rows = check_rows(text)
    for name in (
        "process group",
        "devices",
        "device",
        "matmul peak",
        "versions",
        "all_reduce correctness",
        "all_reduce bandwidth",
        "p2p ring",
        "barrier latency",
        "clock skew",
        "output dir writable",
        "shared filesystem",
        "free disk",
        "environment",
    ):
        assert rows[name][0] == "ok", (name, rows[name])
    assert "float32, float64, int64, bfloat16" in rows["all_reduce correctness"][1]
    assert rows["device"][1].startswith(f"CPU {cpu_model()}, ")
    assert "(ranks 0-1 on host " in rows["device"][1]
    peak = (
        r"(float32|bfloat16) [\d.]+ [GT]FLOP/s to [\d.]+ [GT]FLOP/s on .* \(ranks 0-1\), "
        r"[\d.]+ [GT]FLOP/s each with a host's ranks at once"  # both ranks of this host computing
    )
    assert re.fullmatch(peak, rows["matmul peak"][1]), rows["matmul peak"][1]
    assert f"ranks 0-1 share {out}" in rows["shared filesystem"][1]
    bw = text.split("busbw (GB/s)\n", 1)[1].split("\n\n")[0].splitlines()
    assert [" ".join(line.split()[:2]) for line in bw] == SIZES
    assert text.rstrip().endswith("no check failed (0 warnings)")
    assert not out.exists()  # the doctor created it for its markers and removed them, and it


def test_two_ranks_json(two_ranks):
    proc, _ = two_ranks
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)  # stdout is one JSON document, nothing else
    assert report["ok"] is True and all(c["ok"] for c in report["checks"])
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:  # each rank's device and the matmul peak it measured
        assert r["hardware"]["kind"] == "cpu" and r["hardware"]["name"] == cpu_model()
        assert r["peak"]["flops"] > 0 and r["peak"]["size"] == 512
    assert {c["name"]: c["status"] for c in report["checks"]}["shared filesystem"] == "ok"
    bw = report["bandwidth"]
    assert [b["bytes"] for b in bw] == [1024 * 4**i for i in range(9)] and bw[-1][
        "bytes"
    ] == 64 * MiB
    for b in bw:
        assert b["algbw_gbps"] > 0 and b["busbw_gbps"] == pytest.approx(
            b["algbw_gbps"] * 2 * (2 - 1) / 2
        )
        assert b["algbw_gbps"] == pytest.approx(b["bytes"] / (b["time_us"] / 1e6) / 1e9)


def test_a_users_files_in_the_output_dir_stay(tmp_path, restore_torch_threads):
    (tmp_path / "keep.txt").write_text("user file")
    assert run_doctor(tmp_path, 64 * KiB, timeout=10, environ={}).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]  # markers and .doctor removed


def test_unwritable_output_dir_fails_with_a_fix(tmp_path):
    # tests run as root, where chmod does not stop writes: a path through a regular file cannot be created
    (tmp_path / "file.txt").write_text("")
    proc = doctor(
        "--nproc", 2, "--output-dir", tmp_path / "file.txt" / "sub", "--max-size", "64KiB"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    rows = check_rows(proc.stdout)
    assert rows["output dir writable"][0] == "FAIL"
    assert "fix: pass --output-dir a directory every rank can create and write" in proc.stdout
    assert f"{tmp_path / 'file.txt'} is a file, not a directory" in proc.stdout
    # the other checks still ran
    assert rows["all_reduce correctness"][0] == rows["p2p ring"][0] == "ok"
    assert "FAILED: 1 of" in proc.stdout and "Traceback" not in proc.stderr


def test_unreachable_store_fails_in_bounded_time(tmp_path, capsys, monkeypatch):
    """A worker of a torchrun job whose store is not there, in this process (the path `lockstep
    doctor` takes under a launcher: main() -> run_doctor -> join_group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nobody listens on it once closed
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "x",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # a torchrun worker asks to die with its parent (init_runtime: PR_SET_PDEATHSIG); not pytest
    libc, death_signal = ctypes.CDLL(None), ctypes.c_int()
    libc.prctl(2, ctypes.byref(death_signal))  # PR_GET_PDEATHSIG
    start = time.monotonic()
    try:
        code, _, err = run_main(capsys, "doctor", "--timeout", 5, "--output-dir", tmp_path)
    finally:
        libc.prctl(1, death_signal.value)  # PR_SET_PDEATHSIG
    assert time.monotonic() - start < 30
    assert code == 1, err[-3000:]
    assert f"rank 1 of 2 could not reach the rendezvous store at 127.0.0.1:{port}" in err
    assert "fix: start every rank with the same MASTER_ADDR / MASTER_PORT" in err
    assert "Traceback" not in err


# ---- each probe, in-process, on a real 2-process gloo group ----


def _every_probe(rt, out: str) -> dict:
    return {
        "local": probe_local(rt, None, {"NCCL_DEBUG": "INFO", "HOME": "/root"}),
        "all_reduce": probe_all_reduce(rt),
        "bandwidth": probe_bandwidth(rt, 8 * KiB),
        "ring": probe_ring(rt, numel=1000),
        "barrier": probe_barrier(rt, rounds=5),
        "clock": probe_clock(rt, rounds=2),
        "fs": probe_filesystem(rt, Path(out) / "new" / "runs", "n0nce"),
    }


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("probes")
    return run_ranks(_every_probe, str(out)), out


def test_local_facts(probes):
    ranks, _ = probes
    for rank, facts in enumerate(ranks):
        local = facts["local"]
        assert (local["rank"], local["local_rank"], local["device"], local["device_id"]) == (
            rank,
            rank,
            "cpu",
            "cpu",
        )
        assert local["env"] == {
            "NCCL_DEBUG": "INFO"
        }  # only the variables that matter to collectives
        assert local["versions"]["torch"] == torch.__version__ and local["device_error"] is None
        assert local["hardware"]["kind"] == "cpu"
        assert local["hardware"]["threads"] == 1  # run_ranks: one thread per rank


def test_all_reduce_sums_are_exact_in_every_dtype(probes):
    ranks, _ = probes
    expected = {
        f"{dtype} x {numel}": "ok" for dtype in CORRECTNESS_DTYPES for numel in CORRECTNESS_NUMEL
    }
    assert ranks[0]["all_reduce"] == ranks[1]["all_reduce"] == expected


def test_bandwidth_rows_are_the_slowest_ranks_time(probes):
    ranks, _ = probes
    rows = ranks[0]["bandwidth"]
    # one table: each size's time is the maximum over the ranks
    assert rows == ranks[1]["bandwidth"]
    assert [r["bytes"] for r in rows] == [1024, 4096, 8192] and [r["size"] for r in rows] == [
        "1 KiB",
        "4 KiB",
        "8 KiB",
    ]
    for r in rows:
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] / 1e6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(n-1)/n = 1 on two ranks
        assert r["iterations"] == 20


def test_ring_barrier_and_clock(probes):
    ranks, _ = probes
    assert [(f["ring"]["ok"], f["ring"]["from"]) for f in ranks] == [(True, 1), (True, 0)]
    for facts in ranks:
        assert len(facts["barrier"]) == 5 and all(t >= 0 for t in facts["barrier"])
        assert len(facts["clock"]) == 2 and facts["clock"][0] <= facts["clock"][1]


def test_filesystem_markers_are_seen_by_both_and_removed_with_the_folders_made(probes):
    ranks, out = probes
    for facts in ranks:
        fs = facts["fs"]
        assert fs["error"] is None and fs["seen"] == [0, 1]
        assert fs["disk_path"] == str(out / "new" / "runs") and fs["free_bytes"] > 0
    assert list(out.iterdir()) == []  # new/runs/.doctor were created for the markers, and removed


def test_one_process_doctor_in_process(tmp_path, restore_torch_threads):
    report = run_doctor(tmp_path / "runs", 64 * KiB, timeout=10, environ={})
    assert report.ok and report.rank == 0 and report.bandwidth == []
    assert (
        report.summary
        == f"1 rank on 1 host (no process group, standalone); output dir {tmp_path / 'runs'}"
    )
    assert {c.name: c.status for c in report.checks} == {
        "process group": "skip",
        "devices": "ok",
        "device": "ok",
        "matmul peak": "ok",
        "versions": "ok",
        "output dir writable": "ok",
        "free disk": "ok",
        "environment": "ok",
    }
    assert report.ranks[0]["peak"]["flops"] > 0
    assert report.ranks[0]["hardware"]["name"] == cpu_model()
    assert not (tmp_path / "runs").exists()


# ---- world size 1: the 1-rank group a GPU runs the all_reduce rows on (gloo here, nccl there) ----


def test_one_rank_group_runs_the_all_reduce_probes_and_goes(tmp_path, restore_torch_threads):
    rt = init_runtime(DistributedConfig(device="cpu"), {})
    facts: dict = {}
    try:
        rows = probe_one_rank(rt, facts, 8 * KiB, timeout=10, backend="gloo")
    finally:
        shutdown_runtime(rt)
    exact = {f"{d} x {n}": "ok" for d in CORRECTNESS_DTYPES for n in CORRECTNESS_NUMEL}
    assert facts == {"all_reduce": exact}
    assert [r["bytes"] for r in rows] == [1024, 4096, 8192]
    # busbw = algbw x 2(n-1)/n: 0 on one rank
    assert all(r["algbw_gbps"] > 0 and r["busbw_gbps"] == 0.0 for r in rows)
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(
    torch.distributed.is_nccl_available(), reason="this torch has NCCL: tests/gpu/test_doctor.py"
)
def test_a_1_rank_group_that_cannot_start_is_a_fact_not_a_crash(restore_torch_threads):
    rt = init_runtime(DistributedConfig(device="cpu"), {})
    facts: dict = {}
    try:
        assert probe_one_rank(rt, facts, 8 * KiB, timeout=10, backend="nccl") == []
    finally:
        shutdown_runtime(rt)
    assert facts == {"group_error": "RuntimeError: Distributed package doesn't have NCCL built in"}
    assert not torch.distributed.is_initialized()


def test_two_ranks_report_is_a_plan_s_device_profile(two_ranks, tmp_path):
    """`lockstep plan --device-profile report.json`: the cluster as this doctor measured it."""
    from lockstep.plan.profiles import MEASURED_EFFICIENCY, load_profile

    proc, _ = two_ranks
    report = json.loads(proc.stdout)
    path = tmp_path / "cluster.json"
    path.write_text(proc.stdout)
    profile = load_profile(str(path))
    ram = report["ranks"][0]["hardware"]["memory_gib"]
    assert profile.memory_gib == pytest.approx(ram / 2) and profile.reserve_gib == 0
    # the peak each rank reached with the other computing beside it, as in training
    together = [r["peak"]["together_flops"] for r in report["ranks"]]
    assert profile.bf16_tflops == min(together) / 1e12
    largest = max(report["bandwidth"], key=lambda b: b["bytes"])
    assert largest["size"] == "64 MiB"
    assert profile.intra_node_gbs == profile.inter_node_gbs == largest["busbw_gbps"] > 0
    assert profile.compute_efficiency == MEASURED_EFFICIENCY and profile.link_efficiency == 1
    assert "(2 ranks on 1 host)" in profile.name
