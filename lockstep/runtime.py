"""The process's place in the job: the only module that reads the launcher's environment.

`read_launch_env` turns torchrun / torch elastic, SLURM (srun without torchrun) or
hand-set ranks (`--world-size N --rank R --master-addr A`) into one `LaunchEnv`.
`init_runtime` binds the device, picks the backend, starts the process group with
an explicit timeout and returns a `Runtime` that everything else takes.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from lockstep.config import ConfigError, DistributedConfig


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


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str | None  # None when world_size == 1 (no process group)
    launcher: str
    hostname: str
    # CPU (gloo) group for small control messages (stop flags, outcomes, RNG states); the default group
    # when that is gloo already. On nccl it keeps those messages off the GPU stream: no device sync per step.
    control_group: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


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
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "")),
            # every task derives the same port from the job id, so no file or broadcast is needed
            master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else 20000 + job % 20000,
        )
    if cfg.rank is not None:
        assert cfg.world_size is not None  # validate_config guarantees it
        local = int(env.get("LOCAL_RANK", cfg.rank))
        return LaunchEnv("manual", cfg.rank, local, cfg.world_size, int(env.get("LOCAL_WORLD_SIZE", cfg.world_size)),
                         0, cfg.master_addr, cfg.master_port or 29500)
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
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    m = re.match(r"([^\[,]+)(?:\[(\d+))?", nodelist)
    return (m.group(1) + (m.group(2) or "")) if m else None


def pick_device(cfg: DistributedConfig, local_rank: int, local_world_size: int) -> torch.device:
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
    if local_world_size > count:
        raise ConfigError(
            f"{local_world_size} processes on this node asked for cuda but it has {count} GPU(s); one process per "
            f"GPU: use --world-size {count} (or fewer), or --device cpu"
        )
    return torch.device("cuda", local_rank)


def default_local_processes(cfg: DistributedConfig) -> int:
    """One process per GPU where the config allows CUDA and the node has GPUs; otherwise one."""
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return torch.cuda.device_count() if cuda else 1


def check_local_launch(cfg: DistributedConfig, nproc: int, world_size: int) -> None:
    """Before any worker starts: more processes than GPUs, or a backend this torch lacks, fail here."""
    device = pick_device(cfg, 0, nproc)
    if world_size > 1:
        pick_backend(cfg, device)


def pick_backend(cfg: DistributedConfig, device: torch.device) -> str:
    if cfg.backend == "auto":
        return "nccl" if device.type == "cuda" and not cfg.no_nccl else "gloo"
    if cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend = 'nccl' needs CUDA devices; on CPU use --backend gloo")
    available = {"nccl": dist.is_nccl_available, "gloo": dist.is_gloo_available, "mpi": dist.is_mpi_available}
    if not available[cfg.backend]():
        raise ConfigError(f"distributed.backend = {cfg.backend!r} is not built into this torch ({torch.__version__}); "
                          "use --backend gloo (CPU) or nccl (CUDA), or a torch build with it")
    return cfg.backend


def check_port_free(addr: str, port: int) -> None:
    """Fail early and clearly when the rendezvous port is taken (otherwise: a hang, or a foreign server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("" if addr in ("127.0.0.1", "localhost", "0.0.0.0") else addr, port))
        except OSError as e:
            raise ConfigError(
                f"master port {port} on {addr} is already in use ({e.strerror}); choose another with --master-port, "
                "or omit it and lockstep picks a free one"
            ) from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_runtime(cfg: DistributedConfig, environ: Mapping[str, str] = os.environ) -> Runtime:
    """Join (or start) the process group this process belongs to and bind its device."""
    env = read_launch_env(cfg, environ)
    device = pick_device(cfg, env.local_rank, env.local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in environ:
        # N CPU processes on one node share its cores; more threads than cores makes every rank slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    backend = None
    if env.world_size > 1:
        backend = pick_backend(cfg, device)
        timeout = datetime.timedelta(seconds=cfg.timeout_seconds)
        store = None
        if env.launcher == "torchrun":
            init_method = "env://"
            if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                store = _attempt_store(env, timeout, environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                init_method = None
        else:
            if env.master_addr is None:
                raise ConfigError("no rendezvous host: set MASTER_ADDR or pass --master-addr")
            if env.rank == 0 and env.launcher == "manual":
                check_port_free(env.master_addr, env.master_port)
            init_method = f"tcp://{env.master_addr}:{env.master_port}"
        dist.init_process_group(
            backend=backend, init_method=init_method, store=store, rank=env.rank, world_size=env.world_size,
            timeout=timeout, device_id=device if device.type == "cuda" else None,
        )
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return Runtime(env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank, device, backend,
                   env.launcher, socket.gethostname(), control if env.world_size > 1 else None)


def _attempt_store(env: LaunchEnv, timeout: datetime.timedelta, attempt: str) -> dist.Store:
    """The agent's store, with this restart attempt's own key space.

    With the c10d rendezvous, torch elastic hands every attempt the same store (its rendezvous
    endpoint) and adds no prefix ("a new TCPStore for every retry" does not hold there). After
    `--max-restarts` restarts a group, gloo then read the dead workers' addresses from the first
    attempt and failed with "connectFullMesh ... Connection refused" (seen here 3 times in 5).
    """
    agent_store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"lockstep/attempt_{attempt}", agent_store)


def shutdown_runtime(rt: Runtime | None = None) -> None:
    """Tear the group down. Callers drop DDP models and optimizers first: gloo threads still
    referenced at exit sometimes abort the process ("terminate called without an active exception")."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
