"""Facts dicts as the doctor's probes gather them (one per rank), for its pure checks: clusters and
devices this machine does not have. The values are those the probes report on such hardware."""

from __future__ import annotations

# lockstep.runtime.cuda.cuda_facts on an H100 SXM (total_memory 85,029,158,912 bytes), torch 2.11
# + CUDA 13
H100 = {
    "kind": "cuda",
    "name": "NVIDIA H100 80GB HBM3",
    "capability": "9.0",
    "memory_gib": 79.19,
    "multiprocessors": 132,
    "bf16": True,
    "cuda": "13.0",
    "nccl": "2.27.5",
}
A100 = {**H100, "name": "NVIDIA A100-SXM4-80GB", "capability": "8.0", "multiprocessors": 108}
V100 = {
    **H100,
    "name": "Tesla V100-SXM2-16GB",
    "capability": "7.0",
    "memory_gib": 15.77,
    "multiprocessors": 80,
    "bf16": False,
}
CPU = {
    "kind": "cpu",
    "name": "AMD EPYC 7B13",
    "memory_gib": 23.5,
    "threads": 2,
    "isa": "AVX2",
    "bf16": False,
}


def peak(tflops: float, dtype: str = "bfloat16", size: int = 8192) -> dict:
    return {"dtype": dtype, "size": size, "flops": tflops * 1e12}


CPU_PEAK = peak(0.04, "float32", 512)


def fact(
    rank,
    host="a",
    local_rank=None,
    device="cpu",
    device_id=None,
    torch_version="2.13.0",
    seen=None,
    hardware=None,
    matmul=None,
):
    local_rank = rank if local_rank is None else local_rank
    return {
        "rank": rank,
        "local_rank": local_rank,
        "local_world_size": 2,
        "host": host,
        "device": device,
        "device_id": device_id or device,
        "device_error": None,
        "pid": 1,
        "versions": {
            "python": "3.11.7",
            "torch": torch_version,
            "lockstep": "0.1.0",
            "cuda": "12.4",
            "nccl": "2.21.5",
        },
        "env": {"OMP_NUM_THREADS": "4"},
        "all_reduce": {"float32 x 257": "ok"},
        "ring": {"ok": True, "from": 0, "seconds": 0.001},
        "barrier": [0.001] * 20,
        "clock": [100.0 + rank * 1e-4],
        "fs": {
            "error": None,
            "errno": None,
            "seen": seen if seen is not None else [0, 1],
            "free_bytes": 100 << 30,
            "disk_path": "/runs",
        },
        "hardware": dict(hardware or CPU),
        "peak": dict(matmul or CPU_PEAK),
    }


def gpu_fact(rank, hardware=H100, tflops=780.0, host="a", local_rank=None):
    """A rank on its own GPU (cuda:LOCAL_RANK) with the bf16 matmul peak it measured."""
    local = rank if local_rank is None else local_rank
    return fact(
        rank,
        host,
        local,
        device=f"cuda:{local}",
        device_id=f"GPU-{host}-{local}",
        hardware=hardware,
        matmul=peak(tflops),
    )


def one_rank(f: dict, **extra) -> dict:
    """A rank alone: no all_reduce, ring or barrier facts (at world size 1 the doctor gathers none,
    but a 1-rank NCCL group's all_reduce results on a GPU: pass them as all_reduce=...)."""
    f = {**f, "local_world_size": 1, "fs": {**f["fs"], "seen": [0]}}
    for key in ("all_reduce", "ring", "barrier"):
        f.pop(key)
    f.update(extra)
    return f
