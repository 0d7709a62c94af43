"""Where a process trains and how it talks: its device, its backend, the checks made before a worker starts.

The CUDA half of each choice is in lockstep.runtime.cuda; a CPU process's threads and allocator are set here.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Mapping

import torch
import torch.distributed as dist

from lockstep.config import DistributedConfig
from lockstep.errors import ConfigError
from lockstep.runtime.cuda import cuda_device_index


def pick_device(
    cfg: DistributedConfig,
    local_rank: int,
    local_world_size: int,
    environ: Mapping[str, str] = os.environ,
) -> torch.device:
    want = cfg.device
    has_cuda = torch.cuda.is_available()
    if want == "auto":
        want = "cuda" if has_cuda else "cpu"
    if want == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if has_cuda else 0
    if count == 0:
        raise ConfigError(
            f"{local_world_size} process(es) asked for cuda but this machine has no GPU (torch.cuda.is_available() "
            "is False); use --device cpu, or install a CUDA build of torch"
        )
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", cuda_device_index(local_rank, local_world_size, count, visible))


def default_local_processes(cfg: DistributedConfig) -> int:
    """One process per GPU where the config allows CUDA and the node has GPUs; otherwise one."""
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return torch.cuda.device_count() if cuda else 1


def check_local_launch(
    cfg: DistributedConfig, nproc: int, world_size: int, mixed_precision: str
) -> None:
    """Before any worker starts: more processes than GPUs, a backend this torch lacks, or a precision the
    device cannot train in, fail here."""
    device = pick_device(cfg, 0, nproc)
    check_mixed_precision(mixed_precision, device)
    if world_size > 1:
        pick_backend(cfg, device)


def check_mixed_precision(mixed_precision: str, device: torch.device) -> None:
    """fp16 trains only with loss scaling (GradScaler), which lockstep runs on CUDA; elsewhere fp16 gradients
    would underflow unscaled. Checked once the device is known, never in the config: a login node without
    GPUs renders jobs for GPU nodes."""
    if mixed_precision == "fp16" and device.type != "cuda":
        why = (
            "; this machine has no GPU (torch.cuda.is_available() is False)"
            if not torch.cuda.is_available()
            else ""
        )
        raise ConfigError(
            f"train.mixed_precision = 'fp16' needs a CUDA device (GradScaler), but this process trains "
            f"on {device.type}{why}; on CPU use --mixed-precision bf16 or no, or run on a GPU node"
        )


def pick_backend(cfg: DistributedConfig, device: torch.device) -> str:
    if cfg.backend == "auto":
        return "nccl" if device.type == "cuda" and not cfg.no_nccl else "gloo"
    if cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "distributed.backend = 'nccl' needs CUDA devices; on CPU use --backend gloo"
        )
    available = {
        "nccl": dist.is_nccl_available,
        "gloo": dist.is_gloo_available,
        "mpi": dist.is_mpi_available,
    }
    if not available[cfg.backend]():
        raise ConfigError(
            f"distributed.backend = {cfg.backend!r} is not built into this torch ({torch.__version__}); "
            "use --backend gloo (CPU) or nccl (CUDA), or a torch build with it"
        )
    return cfg.backend


def init_cpu_host(local_world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    """Threads and the allocator of a process that trains on CPU cores (what the user set in the environment wins)."""
    # N processes share the node's cores; more threads than cores slow every rank
    if "OMP_NUM_THREADS" not in environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    if sys.platform == "linux" and "MALLOC_MMAP_THRESHOLD_" not in environ:
        # glibc mmaps blocks above a threshold that it moves as blocks come and go, so a step's large temporaries
        # could be mapped, page-faulted in and unmapped again every step: 1 process, bf16, 15-20% of the step
        # (BENCHMARKS.md, "Op table"). A fixed 32 MiB (its largest) keeps them on the heap; trim above 256 MiB.
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
