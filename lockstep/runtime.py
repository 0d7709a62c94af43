"""The process's place in the job: the only module that reads the launcher's environment.

`read_launch_env` turns torchrun / torch elastic, SLURM (srun without torchrun) or
hand-set ranks (`--world-size N --rank R --master-addr A`) into one `LaunchEnv`.
`init_runtime` binds the device, picks the backend, starts the process group with
an explicit timeout and returns a `Runtime` that everything else takes.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from lockstep.errors import ConfigError
from lockstep.config import DistributedConfig


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


def check_local_launch(cfg: DistributedConfig, nproc: int, world_size: int, mixed_precision: str) -> None:
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
        why = "; this machine has no GPU (torch.cuda.is_available() is False)" if not torch.cuda.is_available() else ""
        raise ConfigError(f"train.mixed_precision = 'fp16' needs a CUDA device (GradScaler), but this process trains "
                          f"on {device.type}{why}; on CPU use --mixed-precision bf16 or no, or run on a GPU node")


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
    else:
        init_cpu_host(env.local_world_size, environ)
    backend = None
    if env.world_size > 1:
        backend = pick_backend(cfg, device)
        timeout = datetime.timedelta(seconds=cfg.timeout_seconds)
        store = None
        if env.launcher == "torchrun":
            init_method = "env://"
            if sys.platform == "linux":  # die with the agent (a lost node), not train on as a stray rank
                ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                store = _attempt_store(env, timeout, environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                init_method = None
        else:
            if env.master_addr is None:
                raise ConfigError("no rendezvous host: set MASTER_ADDR or pass --master-addr")
            if env.rank == 0 and env.launcher == "manual":
                check_port_free(env.master_addr, env.master_port)
            elif env.rank > 0:
                wait_for_rendezvous(env, cfg.timeout_seconds)
            init_method = f"tcp://{env.master_addr}:{env.master_port}"
        try:
            dist.init_process_group(
                backend=backend, init_method=init_method, store=store, rank=env.rank, world_size=env.world_size,
                timeout=timeout, device_id=device if device.type == "cuda" else None,
            )
        except dist.DistError as e:
            if env.launcher == "torchrun":  # torchrun's agent owns that rendezvous and reports it
                raise
            raise ConfigError(_join_failed(env, cfg.timeout_seconds, e)) from None
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return Runtime(env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank, device, backend,
                   env.launcher, socket.gethostname(), control if env.world_size > 1 else None)


def init_cpu_host(local_world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    """Threads and the allocator of a process that trains on CPU cores (what the user set in the environment wins)."""
    if "OMP_NUM_THREADS" not in environ:  # N processes share the node's cores; more threads than cores slow every rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    if sys.platform == "linux" and "MALLOC_MMAP_THRESHOLD_" not in environ:
        # glibc mmaps blocks above a threshold that it moves as blocks come and go, so a step's large temporaries
        # could be mapped, page-faulted in and unmapped again every step: 1 process, bf16, 15-20% of the step
        # (BENCHMARKS.md, "Op table"). A fixed 32 MiB (its largest) keeps them on the heap; trim above 256 MiB.
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD


def _rendezvous_flags(env: LaunchEnv) -> str:
    if env.launcher == "manual":
        return "--master-addr and --master-port"
    return "MASTER_ADDR and MASTER_PORT (lockstep derives the port from SLURM_JOB_ID when MASTER_PORT is unset)"


def _first_line(e: BaseException) -> str:  # c10d messages can carry C++ frames after the first line
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def wait_for_rendezvous(env: LaunchEnv, timeout_s: float) -> None:
    """Rank > 0, before it joins: wait until rank 0's store answers at MASTER_ADDR:MASTER_PORT, or raise a
    ConfigError that says what is there instead. Left to torch, nothing listening ends in retries that log C++
    frames, and a program that accepts but never answers keeps the client waiting past any timeout (seen: 300 s)."""
    addr, port, flags = env.master_addr, env.master_port, _rendezvous_flags(env)
    deadline = (start := time.monotonic()) + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(1.0, deadline - time.monotonic())).close()
            break
        except socket.gaierror as e:
            raise ConfigError(f"rank {env.rank}: rendezvous host {addr!r} does not resolve ({e.strerror}); "
                              f"{flags} must name rank 0's host, the same on every rank") from None
        except OSError as e:  # refused (rank 0 not up yet), unreachable, timed out: retried until the deadline
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"rank {env.rank} found nothing listening at {addr}:{port} ({e.strerror or e}) after waiting "
                    f"{time.monotonic() - start:.0f} s (distributed.timeout_seconds = {timeout_s:g}); start rank 0 "
                    f"first (it listens there), give every rank the same {flags}, or raise "
                    "distributed.timeout_seconds") from None
            time.sleep(0.5)
    # A torch store answers in milliseconds once connected; 30 s leaves room for a loaded node.
    problem = _probe_store(addr, port, min(30.0, timeout_s))
    if problem is not None:
        raise ConfigError(
            f"rank {env.rank} reached {addr}:{port}, but what answers there is not rank 0's torch.distributed "
            f"store ({problem}); is another program using port {port}? Pick a free port and pass the same "
            f"{flags} to every rank (rank 0 checks the port is free)")


def _probe_store(addr: str, port: int, wait_s: float) -> str | None:
    """None when a torch.distributed store answers at addr:port within wait_s, else what happened instead.

    The client runs in a forked child that is killed when it does not answer: a peer that never answers
    holds torch's client in C++ past its timeout, and a thread left there aborted the whole process at exit
    when torch's late exception met interpreter shutdown ("terminate called without an active exception").
    """
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_store_answers, args=(addr, port, wait_s, sender), name="lockstep-store-probe",
                        daemon=True)
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        with _fd2_to(log):  # c10d logs each failed try with C++ frames (the child inherits fd 2); the verdict replaces them
            child.start()
            sender.close()
            try:
                outcome = receiver.recv() if receiver.poll(wait_s + 2) else "timeout"
            except EOFError:  # the child died before it could say
                outcome = f"the probe ended with exit code {child.exitcode}"
            child.kill()
            child.join()
        if outcome is None:  # nothing went wrong: whatever was logged may matter, pass it on
            log.seek(0)
            os.write(2, log.read())
    if outcome == "timeout":
        return f"it accepted the connection but did not answer in {time.monotonic() - start:.0f} s"
    return outcome


def _store_answers(addr: str, port: int, wait_s: float, sender) -> None:
    try:
        dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=wait_s), wait_for_workers=False)
        sender.send(None)
    except Exception as e:  # DistNetworkError: the peer broke the store protocol ("Ping failed, ...")
        sender.send(f"torch: {_first_line(e)}")
    sender.close()
    os._exit(0)  # no atexit handlers of the parent's in the child


@contextlib.contextmanager
def _fd2_to(file):
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _join_failed(env: LaunchEnv, timeout_s: float, e: BaseException) -> str:
    where, flags = f"{env.master_addr}:{env.master_port}", _rendezvous_flags(env)
    if env.rank == 0:
        others = "rank 1" if env.world_size == 2 else f"ranks 1..{env.world_size - 1}"
        return (f"rank 0 waited {timeout_s:g} s (distributed.timeout_seconds) at {where} for the other ranks of "
                f"world_size {env.world_size} ({_first_line(e)}); start {others} with the same {flags} and world "
                "size, or raise distributed.timeout_seconds")
    return (f"rank {env.rank} reached rank 0's store at {where} but could not join the group within {timeout_s:g} s "
            f"(distributed.timeout_seconds; {_first_line(e)}); give every rank the same {flags} and world size "
            f"({env.world_size}), and check that rank 0 is still running")


def _attempt_store(env: LaunchEnv, timeout: datetime.timedelta, attempt: str) -> dist.Store:
    """The agent's store, with this restart attempt's own key space: torch elastic hands every attempt of a c10d
    rendezvous the same store, and a restarted gloo group read the dead workers' addresses from it ("connectFullMesh
    ... Connection refused", seen here 3 times in 5)."""
    agent_store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"lockstep/attempt_{attempt}", agent_store)


def shutdown_runtime(rt: Runtime | None = None) -> None:
    """Tear the group down. Once DDP has used it, torch keeps the group's gloo threads until the process ends:
    the process leaves through lockstep.cli.process_end, never plain finalization, which those threads can abort."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
