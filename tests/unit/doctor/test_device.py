"""Each rank's device in the doctor (lockstep/doctor/device.py): this CPU's facts and matmul peak
measured for real, the 1-rank group on gloo (the code path a single GPU runs with nccl:
tests/gpu/test_doctor.py), and the device and peak rows fed facts of GPUs this machine does not
have."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from lockstep.doctor.device import (
    CPU_ROUNDS,
    CPU_SIZE,
    CPU_SLOW_FIX,
    CPU_WINDOWS,
    GPU_SLOW_FIX,
    check_hardware,
    check_peak,
    datasheet_tflops,
    one_rank_group,
    peak_dtype,
    probe_hardware,
    probe_peak,
    probe_peak_in_turn,
)
from lockstep.peak_flops import cpu_model
from lockstep.train.step import resolve_mixed_precision
from unit.doctor.facts import A100, CPU, H100, V100, fact, gpu_fact, peak

CPU_DEVICE = torch.device("cpu")


def test_this_cpus_facts():
    hw = probe_hardware(CPU_DEVICE)
    # what training computes in here
    bf16 = resolve_mixed_precision("auto", CPU_DEVICE)[0] == "bf16"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert hw == {
        "kind": "cpu",
        "name": cpu_model(),
        "memory_gib": pytest.approx(ram),
        "bf16": bf16,
        "threads": torch.get_num_threads(),
        "cpus": sorted(os.sched_getaffinity(0)),  # the cores it may run on
        "isa": torch.backends.cpu.get_cpu_capability(),
    }
    assert hw["name"] and hw["memory_gib"] > 0.5


def test_this_cpus_matmul_peak_is_measured_in_its_training_dtype_in_well_under_2_s():
    hw = probe_hardware(CPU_DEVICE)
    start = time.perf_counter()
    got = probe_peak(CPU_DEVICE, hw)
    assert time.perf_counter() - start < 2.0
    assert (
        got["dtype"] == ("bfloat16" if hw["bf16"] else "float32") and got["size"] == CPU_SIZE == 512
    )
    assert got["flops"] > 1e8  # > 0.1 GFLOP/s: even one busy core does ~10 GFLOP/s in fp32


def test_a_device_that_cannot_matmul_is_a_fact_not_a_crash():
    got = probe_peak(torch.device("meta"), CPU)
    assert got == {
        "dtype": "float32",
        "size": 512,
        "error": "RuntimeError: META device type not an accelerator.",
    }
    c = check_peak([{**fact(0), "peak": got}, fact(1, host="b", local_rank=0)])
    assert c.status == "fail" and c.detail == (
        "rank 0 on host a: a 512 x 512 float32 matmul failed: RuntimeError: META device type not "
        "an accelerator."
    )
    assert c.fix.startswith(
        "that device cannot run a matmul: `nvidia-smi` shows whether another process holds"
    )


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has CUDA: the facts are read (tests/gpu)"
)
def test_gpu_facts_that_cannot_be_read_fail_the_device_row():
    hw = probe_hardware(torch.device("cuda", 0))
    assert hw["kind"] == "cuda" and hw["error"].startswith(
        "AssertionError: Torch not compiled with CUDA"
    )
    c = check_hardware([{**gpu_fact(0), "hardware": hw}])
    assert c.status == "fail" and c.detail.startswith(
        "rank 0 on host a: the device's facts could not be read: "
    )
    assert c.fix.startswith("`nvidia-smi` on that host shows whether the driver still sees the GPU")
    facts = [{**gpu_fact(0), "hardware": hw}, gpu_fact(1)]  # the other rows are still built
    assert check_peak(facts).detail.startswith("bfloat16 780 TFLOP/s on cuda:0 (rank 0); ")


def test_peak_dtype_is_what_training_computes_in():
    assert peak_dtype(H100) == torch.bfloat16 and peak_dtype(V100) == torch.float16
    assert peak_dtype(CPU) == torch.float32 and peak_dtype({**CPU, "bf16": True}) == torch.bfloat16


def test_datasheet_numbers_by_device_name():
    names = {
        "NVIDIA H100 80GB HBM3": 989.0,
        "NVIDIA H100 PCIe": 756.0,
        "NVIDIA H100 NVL": 835.0,
        "NVIDIA H200": 989.0,
        "NVIDIA H200 NVL": 835.0,
        "NVIDIA A100-SXM4-80GB": 312.0,
        "NVIDIA A100-PCIE-40GB": 312.0,
        "NVIDIA A100 80GB PCIe": 312.0,
        "NVIDIA L4": None,
        "Tesla V100-SXM2-16GB": None,
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb": None,
    }
    assert {name: datasheet_tflops(name) for name in names} == names


def test_the_device_row_of_one_gpu_model_and_of_two():
    assert check_hardware([gpu_fact(0), gpu_fact(1)]) == check_hardware([gpu_fact(0), gpu_fact(1)])
    c = check_hardware([gpu_fact(0), gpu_fact(1)])
    assert (
        c.status == "ok"
        and c.advice == []
        and c.detail
        == (
            "NVIDIA H100 80GB HBM3, 79.2 GiB, capability 9.0, 132 SMs, bf16, CUDA 13.0, NCCL "
            "2.27.5 (ranks 0-1 on host a)"
        )
    )
    mixed = check_hardware([gpu_fact(0), gpu_fact(1, A100, host="b", local_rank=0)])
    assert mixed.status == "warn" and mixed.ok
    assert mixed.detail.endswith(
        "; NVIDIA A100-SXM4-80GB, 79.2 GiB, capability 8.0, 108 SMs, bf16, CUDA 13.0, NCCL 2.27.5 "
        "(rank 1 on host b)"
    )
    assert mixed.fix.startswith(
        "2 GPU models in one job: every step waits for the slowest; run it on one model"
    )


def test_a_gpu_without_bf16_gets_the_fp16_tip():
    c = check_hardware([gpu_fact(0, V100), gpu_fact(1, V100)])
    assert (
        c.status == "ok"
        and "Tesla V100-SXM2-16GB, 15.8 GiB, capability 7.0, 80 SMs, no bf16" in c.detail
    )
    assert c.advice == [
        "Tesla V100-SXM2-16GB has no bf16: train.mixed_precision=auto trains it in fp32; "
        "train.mixed_precision=fp16 (with a GradScaler) uses its tensor cores"
    ]


def test_a_gpu_under_half_its_datasheet_warns():
    c = check_peak([gpu_fact(0, tflops=400.0)])
    assert c.status == "warn" and c.ok and c.fix == GPU_SLOW_FIX
    assert c.detail == (
        "bfloat16 400 TFLOP/s on NVIDIA H100 80GB HBM3 (rank 0), 40% of its datasheet's 989 "
        "TFLOP/s; rank 0 reaches 400 TFLOP/s, under 50% of its datasheet's 989 TFLOP/s"
    )
    assert check_peak([gpu_fact(0, tflops=500.0)]).status == "ok"  # 51%


def test_a_gpu_slower_than_its_peers_warns_once():
    facts = [gpu_fact(r, tflops=t) for r, t in enumerate([790.0, 785.0, 600.0, 300.0])]
    c = check_peak(facts)
    assert c.status == "warn" and c.detail.startswith(
        "bfloat16 300 TFLOP/s to 790 TFLOP/s on NVIDIA H100 80GB HBM3 (ranks 0-3), 30% to 80% of "
        "its datasheet's 989 TFLOP/s; rank 2"
    )
    assert c.detail.endswith(
        "; rank 2 reaches 600 TFLOP/s, under 80% of the fastest NVIDIA H100 80GB HBM3 (790 "
        "TFLOP/s); rank 3 reaches 300 TFLOP/s, under 50% of its datasheet's 989 TFLOP/s"
    )
    # a model without a datasheet number: only its peers compare
    l4 = {**H100, "name": "NVIDIA L4"}
    c = check_peak([gpu_fact(0, l4, 100.0), gpu_fact(1, l4, 70.0)])
    assert c.status == "warn" and c.detail == (
        "bfloat16 70 TFLOP/s to 100 TFLOP/s on NVIDIA L4 (ranks 0-1); rank 1 reaches 70 TFLOP/s, "
        "under 80% of the fastest NVIDIA L4 (100 TFLOP/s)"
    )


def test_cpu_ranks_sharing_cores_do_not_warn():
    facts = [fact(0, matmul=peak(0.04, "float32", 512)), fact(1, matmul=peak(0.01, "float32", 512))]
    c = check_peak(facts)
    assert (
        c.status == "ok"
        and c.detail == "float32 10 GFLOP/s to 40 GFLOP/s on AMD EPYC 7B13 (ranks 0-1)"
    )


def test_a_cpu_rank_with_cores_of_its_own_slower_than_its_peers_warns():
    # 3 ranks of 1 thread on 4 cores: each measures its own; rank 2 throttled to under 2/3
    own = {**CPU, "threads": 1, "cpus": [0, 1, 2, 3]}
    facts = [
        fact(r, hardware=own, matmul=peak(t, "float32", 512))
        for r, t in enumerate([0.040, 0.038, 0.012])
    ]
    c = check_peak(facts)
    assert c.status == "warn" and c.fix == CPU_SLOW_FIX
    assert c.detail == (
        "float32 12 GFLOP/s to 40 GFLOP/s on AMD EPYC 7B13 (ranks 0-2); rank 2 (host a, local rank "
        "2) reaches 12 GFLOP/s, under 67% of the other ranks' median (39 GFLOP/s)"
    )
    # within the margin: 30 against 40 is a busy host's noise
    near = [facts[0], fact(1, hardware=own, matmul=peak(0.030, "float32", 512))]
    assert check_peak(near).status == "ok"
    assert check_peak(facts[:2]).status == "ok"
    # 2 threads each on 2 cores: they measure each other, so they are not compared
    shared = {**CPU, "threads": 2, "cpus": [0, 1]}
    slow = [
        fact(r, hardware=shared, matmul=peak(t, "float32", 512)) for r, t in enumerate([0.04, 0.01])
    ]
    assert check_peak(slow).status == "ok"
    # on two hosts, one rank each: compared
    apart = [
        fact(r, host=h, local_rank=0, hardware=shared, matmul=peak(t, "float32", 512))
        for r, (h, t) in enumerate([("a", 0.04), ("b", 0.01)])
    ]
    assert check_peak(apart).status == "warn"


def _probe_peak_throttled(rt, groups: tuple[str, str], windows: int | None) -> dict:
    """This rank's hardware, matmul peak and count of windows; both ranks in a favoured cgroup,
    rank 1 in one with a CPU quota instead (`groups`: favoured, quota) for all its windows or
    (`windows`) for its first ones only, as a burst of another process on its core would slow it."""
    from throttle import join, leave

    import lockstep.doctor.device as device

    probe_peak, count, (favoured, quota) = device.probe_peak, [], groups
    join(favoured)

    def one_window(*args, **kwargs) -> dict:
        if rt.rank == 1 and len(count) in (0, windows):
            join(quota) if not count else leave(quota, to=favoured)
        count.append(1)
        return probe_peak(*args, **kwargs)

    device.probe_peak = one_window
    hw = probe_hardware(CPU_DEVICE)
    facts = {"rank": rt.rank, "local_rank": rt.local_rank, "host": rt.hostname, "device": "cpu"}
    facts["hardware"] = hw
    return {"hardware": hw, "peak": probe_peak_in_turn(rt, facts), "windows": len(count)}


def _throttled_pair(windows: int | None) -> tuple[list[dict], list[dict]]:
    """Two real ranks ahead of the host's other processes, rank 1 at a twentieth of one CPU (well
    under what a rank gets of a host busy with a test suite) for all its windows or its first
    `windows`: (what each probed, the facts)."""
    from conftest import run_ranks
    from throttle import Unavailable, cpu_favoured, cpu_quota

    try:
        with cpu_favoured() as favoured, cpu_quota(0.05) as quota:
            probed = run_ranks(_probe_peak_throttled, (str(favoured), str(quota)), windows)
    except Unavailable as e:
        pytest.skip(str(e))
    return probed, [fact(r, hardware=p["hardware"], matmul=p["peak"]) for r, p in enumerate(probed)]


def test_a_real_rank_throttled_by_a_cpu_quota_is_named():
    probed, facts = _throttled_pair(None)
    c = check_peak(facts)
    assert c.status == "warn" and c.fix == CPU_SLOW_FIX, c
    assert "; rank 1 (host a, local rank 1) reaches " in c.detail and "rank 0 (" not in c.detail
    # slow in every round: each rank measured all of them, then both at once
    assert [p["windows"] for p in probed] == [CPU_ROUNDS * CPU_WINDOWS + 1] * 2
    assert all(p["peak"]["together_flops"] > 0 for p in probed)


def test_a_rank_slow_in_its_first_round_only_is_measured_again_and_passes():
    probed, facts = _throttled_pair(CPU_WINDOWS)
    assert check_peak(facts).status == "ok", check_peak(facts)
    # a second round on both ranks (a third only if this host's load slowed one again)
    rounds = {(p["windows"] - 1) // CPU_WINDOWS for p in probed}  # and the window at once
    assert len(rounds) == 1 and rounds <= {2, CPU_ROUNDS}, probed


def test_one_rank_group_is_a_real_group_and_is_gone_after():
    with one_rank_group("gloo", CPU_DEVICE, timeout=10):
        assert (dist.get_world_size(), dist.get_rank(), dist.get_backend()) == (1, 0, "gloo")
        x = torch.arange(5.0)
        dist.all_reduce(x)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError):
        with one_rank_group("gloo", CPU_DEVICE, timeout=10):
            1 / 0
    assert not dist.is_initialized()  # destroyed on the way out of an error too
