"""What the launcher says about this process: the one place lockstep reads torchrun's, SLURM's or hand-set ranks.

`read_launch_env` turns torchrun / torch elastic, SLURM (srun without torchrun) or hand-set ranks
(`--world-size N --rank R --master-addr A`) into one `LaunchEnv`, before any process group exists.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Mapping

from lockstep.config import DistributedConfig
from lockstep.errors import ConfigError


@dataclass(frozen=True)
class LaunchEnv:
    """What the environment says about this process before any process group exists."""

    launcher: str  # "torchrun" | "slurm" | "manual" | "none"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    # times torch's elastic agent may start the workers again after a failure (torchrun --max-restarts)
    max_restarts: int = 0


def under_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """True when a launcher (torchrun, srun with several tasks) already started this process as one of many."""
    return read_launch_env(DistributedConfig(), environ).launcher in ("torchrun", "slurm")


def read_launch_env(cfg: DistributedConfig, environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    env = environ
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        world = int(env["WORLD_SIZE"])
        if cfg.world_size is not None and cfg.world_size != world:
            raise ConfigError(
                f"distributed.world_size = {cfg.world_size} but the launcher started WORLD_SIZE={world} processes; "
                "drop --world-size under torchrun, or make them agree"
            )
        return LaunchEnv(
            launcher="torchrun",
            rank=int(env["RANK"]),
            local_rank=int(env["LOCAL_RANK"]),
            world_size=world,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        # srun started one task per device itself (no torchrun): SLURM's variables are the ranks.
        world = int(env["SLURM_NTASKS"])
        if cfg.world_size is not None and cfg.world_size != world:
            raise ConfigError(
                f"distributed.world_size = {cfg.world_size} but srun started SLURM_NTASKS={world} tasks; "
                "drop --world-size under srun, or make them agree"
            )
        job = int(env.get("SLURM_JOB_ID", "0"))
        return LaunchEnv(
            launcher="slurm",
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=world,
            local_world_size=_slurm_tasks_on_this_node(env, world),
            node_rank=int(env.get("SLURM_NODEID", 0)),
            master_addr=env.get("MASTER_ADDR")
            or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "")),
            # every task derives the same port from the job id, so no file or broadcast is needed
            master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else 20000 + job % 20000,
        )
    if cfg.rank is not None:
        assert cfg.world_size is not None  # validate_config guarantees it
        local = int(env.get("LOCAL_RANK", cfg.rank))
        return LaunchEnv(
            "manual",
            cfg.rank,
            local,
            cfg.world_size,
            int(env.get("LOCAL_WORLD_SIZE", cfg.world_size)),
            0,
            cfg.master_addr,
            cfg.master_port or 29500,
        )
    return LaunchEnv("none", 0, 0, 1, 1, 0, None, None)


def _slurm_tasks_on_this_node(env: Mapping[str, str], world: int) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "4" or "4(x2)" or "3,2"; this node's entry is SLURM_NODEID's
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return world
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else world


def _first_slurm_host(nodelist: str) -> str | None:
    if not nodelist:
        return None
    try:  # scontrol knows every hostlist syntax; the regex below covers the common "node[01-04,07]" form
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    m = re.match(r"([^\[,]+)(?:\[(\d+))?", nodelist)
    return (m.group(1) + (m.group(2) or "")) if m else None
