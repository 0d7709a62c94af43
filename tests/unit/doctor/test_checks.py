"""The doctor's verdicts on the cluster (lockstep/doctor/checks.py): `build_checks` fed facts from
clusters this machine does not have (GPUs, several hosts), its rows in order, and the fix under each
failure."""

from __future__ import annotations

from lockstep.doctor import build_checks
from lockstep.doctor.checks import check_group
from unit.doctor.facts import H100, fact, gpu_fact, one_rank

BW = [{"size": "64 MiB", "busbw_gbps": 1.0, "algbw_gbps": 1.0}]
EXACT = {
    f"{d} x {n}": "ok" for d in ("float32", "float64", "int64", "bfloat16") for n in (257, 1 << 20)
}


def checks(facts) -> dict:
    return {c.name: c for c in build_checks(facts, BW, "/runs", "nccl")}


def test_two_ranks_on_one_gpu_fail_with_the_fix():
    c = checks(
        [fact(0, device="cuda:0", device_id="GPU-1"), fact(1, device="cuda:0", device_id="GPU-1")]
    )["devices"]
    assert c.status == "fail" and "2 ranks on one GPU cuda:0 (ranks 0-1 on host a)" in c.detail
    assert c.fix == "set CUDA_VISIBLE_DEVICES per rank or launch one process per GPU"
    ok = checks(
        [
            fact(0, device="cuda:0", device_id="GPU-1"),
            fact(1, device="cuda:1", device_id="GPU-2"),
            fact(2, host="b", local_rank=0, device="cuda:0", device_id="GPU-3"),
        ]
    )["devices"]
    assert ok.status == "ok", ok.detail


def test_version_mismatch_names_the_ranks():
    c = checks([fact(0), fact(1), fact(2, host="b", local_rank=0, torch_version="2.12.0")])[
        "versions"
    ]
    assert c.status == "fail"
    assert "torch differs: 2.13.0 on ranks 0-1 on host a, 2.12.0 on rank 2 on host b" in c.detail
    assert "same container image or venv" in c.fix


def test_unshared_filesystem_and_clock_skew_warn():
    facts = [fact(0, seen=[0, 1]), fact(1, seen=[0, 1]), fact(2, host="b", local_rank=0, seen=[2])]
    facts[2]["clock"] = [105.0]
    got = checks(facts)
    assert got["shared filesystem"].status == "warn"
    assert (
        "rank 2 (host b) sees no other rank's marker: not shared" in got["shared filesystem"].detail
    )
    assert got["clock skew"].status == "warn"
    assert (
        "rank 2 (b) is 4.999 s ahead of rank 0 (a) (barrier latency 1.00 ms subtracted)"
        in got["clock skew"].detail
    )
    assert all(c.ok for c in got.values())  # warnings keep exit code 0


def test_one_cpu_process_skips_the_group_checks_with_a_tip():
    got = build_checks([one_rank(fact(0))], [], "/runs", None)
    assert [c.name for c in got] == [
        "process group",
        "devices",
        "device",
        "matmul peak",
        "versions",
        "output dir writable",
        "free disk",
        "environment",
    ]
    assert got[0].status == "skip" and got[0].advice == [
        "check N ranks with `lockstep doctor --nproc N`, or run it under torchrun / srun"
    ]
    assert (
        got[2].detail
        == "CPU AMD EPYC 7B13, 23.5 GiB RAM, 2 thread(s), AVX2, no bf16 kernels (rank 0 on host a)"
    )
    assert got[3].status == "ok" and got[3].detail == "float32 40 GFLOP/s on AMD EPYC 7B13 (rank 0)"
    assert all(c.ok for c in got)  # a skip is no failure


def test_one_gpu_runs_the_all_reduce_rows_on_a_1_rank_nccl_group():
    bw = [
        {
            "bytes": 64 << 20,
            "size": "64 MiB",
            "iterations": 4,
            "time_us": 40.0,
            "algbw_gbps": 1677.7,
            "busbw_gbps": 0.0,
        }
    ]
    facts = [one_rank(gpu_fact(0), all_reduce=EXACT)]
    got = build_checks(facts, bw, "/runs", "nccl")
    assert [c.name for c in got] == [
        "process group",
        "devices",
        "device",
        "matmul peak",
        "versions",
        "all_reduce correctness",
        "all_reduce bandwidth",
        "output dir writable",
        "free disk",
        "environment",
    ]
    rows = {c.name: c for c in got}
    assert rows["process group"].status == "ok" and rows["process group"].detail == (
        "one process: a 1-rank nccl group on cuda:0 ran the all_reduce checks; ring, barrier, "
        "clock and shared-filesystem checks need several"
    )
    assert rows["all_reduce correctness"].status == "ok" and rows[
        "all_reduce correctness"
    ].detail == (
        "exact sums on all ranks for float32, float64, int64, bfloat16 at 257 and 1048576 elements"
    )
    assert rows["all_reduce bandwidth"].detail.startswith(
        "algbw 1677.70 GB/s at 64 MiB on 1 rank: its all_reduce crosses no link"
    )
    assert rows["device"].status == "ok" and rows["device"].detail == (
        "NVIDIA H100 80GB HBM3, 79.2 GiB, capability 9.0, 132 SMs, bf16, CUDA 13.0, NCCL 2.27.5 "
        "(rank 0 on host a)"
    )
    assert rows["matmul peak"].status == "ok" and rows["matmul peak"].detail == (
        "bfloat16 780 TFLOP/s on NVIDIA H100 80GB HBM3 (rank 0), 79% of its datasheet's 989 TFLOP/s"
    )
    assert all(c.ok and c.status != "warn" for c in got)


def test_a_1_rank_nccl_group_that_cannot_start_fails_with_the_fix():
    error = "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error"
    facts = [one_rank(gpu_fact(0, H100), group_error=error)]
    c = check_group(facts, "nccl")
    assert (
        c.status == "fail"
        and c.detail == f"one process: a 1-rank nccl group on cuda:0 could not run: {error}"
    )
    assert c.fix.startswith(
        "nccl cannot start on this device, and training on several GPUs needs it: rerun with "
        "NCCL_DEBUG=INFO"
    )
    assert "supports torch's CUDA 12.4" in c.fix  # the rank's versions["cuda"]
    rows = {c.name: c for c in build_checks(facts, [], "/runs", "nccl")}
    # it failed as it formed
    assert not rows["process group"].ok and "all_reduce correctness" not in rows
    facts[0]["all_reduce"] = EXACT  # it failed later, in the bandwidth probe
    rows = {c.name: c for c in build_checks(facts, [], "/runs", "nccl")}
    assert (
        rows["all_reduce correctness"].status == "ok"
        and rows["all_reduce bandwidth"].status == "skip"
    )
    assert rows["all_reduce bandwidth"].detail == "not measured" and not rows["process group"].ok


def test_eight_gpus_on_two_hosts():
    facts = [gpu_fact(r, host="ab"[r // 4], local_rank=r % 4, tflops=770 + r) for r in range(8)]
    got = checks(facts)
    assert got["process group"].detail == "nccl: 8 ranks on 2 host(s) joined"
    assert got["devices"].status == "ok"
    assert got["device"].detail.endswith("NCCL 2.27.5 (ranks 0-3 on host a; ranks 4-7 on host b)")
    assert got["matmul peak"].status == "ok" and got["matmul peak"].detail == (
        "bfloat16 770 TFLOP/s to 777 TFLOP/s on NVIDIA H100 80GB HBM3 (ranks 0-7), 78% to 79% of "
        "its datasheet's 989 TFLOP/s"
    )


def test_wrong_sums_and_a_broken_ring_fail_with_their_fixes():
    facts = [fact(0), fact(1)]
    facts[1]["all_reduce"]["float32 x 257"] = "wrong: element 3 is 5.0, expected 4.0"
    facts[1]["ring"] = {"ok": False, "from": 0, "seconds": 0.1}
    got = checks(facts)
    assert got["all_reduce correctness"].status == "fail"
    assert (
        got["all_reduce correctness"].detail
        == "float32 x 257 on rank 1: wrong: element 3 is 5.0, expected 4.0"
    )
    assert "NCCL_P2P_DISABLE=1 or NCCL_IB_DISABLE=1" in got["all_reduce correctness"].fix
    assert got["p2p ring"].status == "fail"
    assert got["p2p ring"].detail == "wrong payload received on 0 -> 1 (sender -> receiver)"


def test_environment_that_slows_or_hangs_a_job_warns():
    facts = [fact(0), fact(1)]
    facts[0]["env"] = {
        "NCCL_P2P_DISABLE": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "OMP_NUM_THREADS": "4",
    }
    env = checks(facts)["environment"]
    assert env.status == "warn" and env.ok
    assert env.fix.startswith(
        "NCCL_P2P_DISABLE=1 turns off direct GPU-to-GPU copies (rank 0): unset it"
    )
    assert (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 leaves the other ranks hanging when one fails" in env.fix
    )
    assert "NCCL_P2P_DISABLE differs: 1 on rank 0, <unset> on rank 1" in env.advice
