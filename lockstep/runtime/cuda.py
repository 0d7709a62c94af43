"""The lines only a CUDA device runs, one function per concern, each decision testable on a CPU.

A machine without a GPU never executes what is below, so a change that keeps the CPU suite green
could break it unseen. Keeping those lines here, few and apart, lets the CPU tests check every
choice they make (tests/unit/runtime/test_cuda.py) and leaves the calls themselves to the GPU tier
(bench/gpu/run.sh).

    cuda_device_index   which GPU a rank binds: its LOCAL_RANK, or the one its launcher left it
    cuda_environment    the allocator and NCCL settings a process starts with; the user's own win
    bind_cuda           those settings, then torch.cuda.set_device: where lockstep binds a GPU
    cuda_facts          name, capability, memory, bf16, CUDA and NCCL versions (log, doctor)
    describe_device     the device as the rank's first log line names it
    synchronize         wait for the device before reading a clock; nothing on a CPU
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, MutableMapping

import torch

from lockstep.errors import ConfigError

# PyTorch reads the allocator settings once, at the first CUDA allocation. It reads both names (the
# second is the newer, device-neutral one); either one set by the user means lockstep sets neither.
ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# NCCL's flight recorder: each rank's last collectives, dumped into the run directory when one times
# out (beside the watchdog's Python stacks in RUN/hang/), so a hang says which collective each rank
# was in. The dump prefix has two names: torch renamed TORCH_NCCL_DEBUG_INFO_TEMP_FILE.
TRACE_ENTRIES = 2000  # collectives kept per rank; a few hundred bytes each
DUMP_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def cuda_device_index(
    local_rank: int, local_world_size: int, count: int, visible: str | None
) -> int:
    """The GPU index this rank binds, of the `count` it sees.

    One process per GPU: local rank r takes GPU r. A launcher that binds each task to its own GPU
    (Slurm's --gpus-per-task=1, a Kubernetes device plugin) leaves every process one visible GPU,
    index 0, whatever its local rank. `visible` is CUDA_VISIBLE_DEVICES as the process got it (None
    when unset).
    """
    if local_rank < count and local_world_size <= count:
        return local_rank
    bound = visible is not None and len([d for d in visible.split(",") if d.strip()]) == 1
    if count == 1 and bound:
        return 0
    seen = "CUDA_VISIBLE_DEVICES unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible}"
    raise ConfigError(
        f"{local_world_size} processes on this node asked for cuda but local rank {local_rank} "
        f"sees {count} GPU(s) ({seen}); one process per GPU: use --world-size {count} (or fewer), "
        "give each task its own GPU (srun --gpus-per-task=1), or --device cpu"
    )


def cuda_environment(environ: Mapping[str, str], trace_dir: Path | None = None) -> dict[str, str]:
    """The settings a CUDA training process adds to its environment; what the user set stays.

    expandable_segments: the caching allocator grows segments instead of carving fixed blocks, so
    batches of changing shape (audio, chat) fragment it less and run out of memory later (PyTorch
    docs, "CUDA memory management"). With `trace_dir`, NCCL's flight recorder keeps each rank's last
    TRACE_ENTRIES collectives and dumps them there when a collective times out.
    """
    out: dict[str, str] = {}
    if not any(v in environ for v in ALLOC_VARS):
        out["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if trace_dir is not None and not any(v in environ for v in DUMP_VARS):
        entries = environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", str(TRACE_ENTRIES))
        out["TORCH_NCCL_TRACE_BUFFER_SIZE"] = entries
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        prefix = str(Path(trace_dir) / "nccl_trace_rank_")  # torch appends the rank
        out.update({v: prefix for v in DUMP_VARS})
    return out


def bind_cuda(
    device: torch.device,
    environ: MutableMapping[str, str] = os.environ,
    trace_dir: Path | None = None,
) -> dict[str, str]:
    """cuda_environment into `environ`, then `device` as this process's GPU; returns what it set."""
    settings = cuda_environment(environ, trace_dir)
    environ.update(settings)
    if trace_dir is not None and "TORCH_FR_DUMP_TEMP_FILE" in settings:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    torch.cuda.set_device(device)
    return settings


def cuda_facts(device: torch.device) -> dict[str, Any]:
    """What a report says of a GPU: name, capability, memory, SMs, bf16, CUDA and NCCL versions."""
    props = torch.cuda.get_device_properties(device)
    nccl = "-"
    if torch.distributed.is_nccl_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):  # a torch built without NCCL's version symbol
            pass
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": props.total_memory / 2**30,
        "multiprocessors": props.multi_processor_count,
        # native bf16 only: a V100 emulates it (is_bf16_supported() says yes), slower than fp32
        "bf16": torch.cuda.is_bf16_supported(including_emulation=False),
        "cuda": torch.version.cuda or "-",
        "nccl": nccl,
    }


def describe_device(device: torch.device) -> str:
    """`cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB, compute capability 9.0)`, or the device's name"""
    if device.type != "cuda":
        return str(device)
    gpu = cuda_facts(device)
    memory, capability = f"{gpu['memory_gib']:.1f} GiB", f"compute capability {gpu['capability']}"
    return f"{device} ({gpu['name']}, {memory}, {capability})"


def synchronize(device: torch.device) -> None:
    """Wait until `device` has run what was queued (before reading a clock); a CPU has already."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
