"""The plan's memory check before `lockstep train` starts its workers (train.plan_check): the
config's layout simulated on the device this machine has, and a run whose step would not fit it
refused with the numbers and what one setting changed would need, before a worker loads a weight.

    check_before_launch(cfg, world, local, device) -> a warning to print, or None; raises
                                                      ConfigError when refused
    check_on_rank0(cfg, env)   the same under a launcher lockstep did not start (the user's own
                               torchrun or srun): global rank 0 checks, every rank says its verdict

train.plan_check: auto (the default) checks on CUDA devices and refuses there, and skips CPU runs
(a CPU's memory is the machine's, shared with everything else on it); warn checks and warns;
refuse checks on any device (on a CPU, against the memory available now, shared by the local
processes); off skips it. The device: its total memory as nvidia-smi reports it (not torch, which
would hold a CUDA context in the launching process for the whole run), less
lockstep.plan.profiles' reserve; a step's time is not checked (docs/plan.md).
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lockstep.config import Config
from lockstep.errors import ConfigError
from lockstep.plan.profiles import PROFILES, DeviceProfile
from lockstep.runtime import LaunchEnv, pick_device

if TYPE_CHECKING:
    from lockstep.train.run import Preflight


def profile_here(device: torch.device, local_processes: int, gpu=None) -> DeviceProfile:
    """What one of this machine's devices holds; compute and links as the nearest built-in
    profile's (a memory check does not read them). `gpu`: _nvidia_smi's answer, if asked already."""
    if device.type == "cuda":
        name, mib, _ = gpu or _nvidia_smi(device.index or 0)
        near = next((p for key, p in _BY_NAME if key in name), PROFILES["h100-80gb"])
        return dataclasses.replace(near, name=name, memory_gib=mib / 1024, source="nvidia-smi")
    available = _available_bytes() / local_processes
    return dataclasses.replace(
        PROFILES["h100-80gb"],
        name=f"this CPU's available memory over {local_processes} process(es)",
        memory_gib=available / 2**30,
        reserve_gib=0.0,
        source="/proc/meminfo MemAvailable",
    )


_BY_NAME = (
    ("H200", PROFILES["h200"]),
    ("H100", PROFILES["h100-80gb"]),
    ("A100", PROFILES["a100-80gb"]),
)


def _nvidia_smi(index: int) -> tuple[str, float, float]:
    """(name, total MiB, compute capability) of GPU `index`, asked of nvidia-smi: torch would create
    a CUDA context in the launching process, ~0.5 GB of that GPU held for the whole run."""
    out = subprocess.run(
        [
            "nvidia-smi",
            f"--id={index}",
            "--query-gpu=name,memory.total,compute_cap",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    name, mib, capability = out.strip().splitlines()[0].rsplit(",", 2)
    return name.strip(), float(mib), float(capability)


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def _precision(mixed_precision: str, device: torch.device, gpu=None) -> str:
    """What train.mixed_precision = 'auto' will be on `device` (lockstep.train.step's rule: bf16
    where the GPU computes it natively, compute capability 8.0 and up), without touching CUDA."""
    if device.type != "cuda" or mixed_precision != "auto":
        from lockstep.train.step import resolve_mixed_precision

        return resolve_mixed_precision(mixed_precision, device)[0]
    return "bf16" if (gpu or _nvidia_smi(device.index or 0))[2] >= 8.0 else "no"


def check_before_launch(
    cfg: Config, world_size: int, local_processes: int, device: torch.device
) -> str | None:
    mode = cfg.train.plan_check
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    from lockstep.plan.build import make_plan
    from lockstep.plan.choose import fixes

    if cfg.model.kind == "custom":
        return None  # a factory's model and batch come from the user's code: nothing to simulate
    planned = copy.deepcopy(cfg)
    try:
        gpu = _nvidia_smi(device.index or 0) if device.type == "cuda" else None  # asked once
        planned.train.mixed_precision = _precision(cfg.train.mixed_precision, device, gpu)
        profile = profile_here(device, local_processes, gpu)
        plan = make_plan(planned, world_size, local_processes, profile, other=False)
    except ConfigError:
        raise  # what train would refuse too, said before a worker starts
    except Exception as e:  # the check's own failure must not stop a run that may work
        return f"lockstep plan's memory check could not run ({type(e).__name__}: {e}); not checked"
    if plan.fits:
        return None
    parts = ", ".join(
        f"{part} {size / 2**30:.2f}" for part, size in plan.ranks[0].memory.items() if size
    )
    would = "; ".join(fixes(plan)) or "none of FSDP, checkpointing, a smaller micro-batch alone"
    message = (
        f"lockstep plan: a step of this run needs {plan.peak / 2**30:.2f} GiB per device ({parts}) "
        f"of {profile.usable_bytes / 2**30:.2f} GiB usable on {profile.name}; one setting "
        f"changed: {would}. `lockstep plan` with the same flags shows the whole plan"
    )
    if mode == "warn":
        return message
    raise ConfigError(f"{message}; to start anyway: --set train.plan_check=warn (or off)")


def check_on_rank0(cfg: Config, env: LaunchEnv) -> Preflight:
    """check_before_launch on global rank 0 of a job whose launcher is not lockstep's, before the
    process group exists (the simulation's fake group cannot live beside a real one); the other
    ranks wait for it at the rendezvous, and run_training says its verdict on every rank."""
    from lockstep.train.run import Preflight

    if env.rank != 0:
        return Preflight()
    device = pick_device(cfg.distributed, env.local_rank, env.local_world_size)
    try:
        return Preflight(check_before_launch(cfg, env.world_size, env.local_world_size, device))
    except ConfigError as e:
        return Preflight(refusal=str(e))
