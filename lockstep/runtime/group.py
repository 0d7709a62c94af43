"""Joining the job: bind the device, start the process group with an explicit timeout, return a `Runtime`.

`init_runtime` is what every worker calls first; `shutdown_runtime` what it calls last. Rank > 0 waits for
rank 0's store and says what is there instead when it is not (a wrong port, another program).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import gc
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from lockstep.config import DistributedConfig
from lockstep.errors import ConfigError
from lockstep.runtime.cuda import bind_cuda
from lockstep.runtime.device import init_cpu_host, pick_backend, pick_device
from lockstep.runtime.launch_env import LaunchEnv, read_launch_env


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
    max_restarts: int = 0  # times the launcher may start the workers again (torch elastic's)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


MASTER_PORT_FIX = "choose another with --master-port, or omit it and lockstep picks a free one"


def check_port_free(
    addr: str, port: int, fix: str = MASTER_PORT_FIX, what: str = "master port"
) -> None:
    """Fail early and clearly when a program listens on the rendezvous port (else: a hang, or a
    foreign server).

    `what` and `fix` name the port and the flag that changes it as the printing command knows them
    (`lockstep train`: --master-port; `lockstep launch`: --rdzv-endpoint). The test bind sets
    SO_REUSEADDR, as torch's TCPStore does: a port held only by a dead process's closing
    connections (TIME_WAIT for about a minute after a launcher was killed) is one torch binds, so
    it passes; a port with a live listener is refused.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if addr in ("127.0.0.1", "localhost", "0.0.0.0") else addr, port))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"{addr} is not an address of this host ({e.strerror}), and {what} {port} "
                    "is opened on the host that runs the rendezvous; start rank 0 (node rank 0) "
                    f"on {addr}'s host, or name an address of this one"
                ) from None
            if e.errno != errno.EADDRINUSE:  # e.g. a port below 1024 without the right to bind it
                raise ConfigError(
                    f"{what} {port} on {addr} cannot be opened ({e.strerror}); {fix}"
                ) from None
            raise ConfigError(
                f"{what} {port} on {addr} is already in use ({e.strerror}): a program listens "
                f"there; {fix}"
            ) from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_runtime(
    cfg: DistributedConfig, environ: Mapping[str, str] = os.environ, trace_dir: Path | None = None
) -> Runtime:
    """Join (or start) the process group this process belongs to and bind its device.

    On CUDA, `trace_dir` (the run's hang/ folder) receives NCCL's flight-recorder dumps when a collective
    times out (lockstep.runtime.cuda.cuda_environment).
    """
    env = read_launch_env(cfg, environ)
    device = pick_device(cfg, env.local_rank, env.local_world_size, environ)
    if device.type == "cuda":
        bind_cuda(device, os.environ, trace_dir)
    else:
        init_cpu_host(env.local_world_size, environ)
    backend = None
    if env.world_size > 1:
        backend = pick_backend(cfg, device)
        timeout = datetime.timedelta(seconds=cfg.timeout_seconds)
        store = None
        if env.launcher == "torchrun":
            init_method = "env://"
            # die with the agent (a lost node), not train on as a stray rank
            if sys.platform == "linux":
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
                backend=backend,
                init_method=init_method,
                store=store,
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
        except dist.DistError as e:
            if env.launcher == "torchrun":  # torchrun's agent owns that rendezvous and reports it
                raise
            raise ConfigError(_join_failed(env, cfg.timeout_seconds, e)) from None
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return Runtime(
        env.rank,
        env.local_rank,
        env.world_size,
        env.local_world_size,
        env.node_rank,
        device,
        backend,
        env.launcher,
        socket.gethostname(),
        control if env.world_size > 1 else None,
        env.max_restarts,
    )


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
            socket.create_connection(
                (addr, port), timeout=max(1.0, deadline - time.monotonic())
            ).close()
            break
        except socket.gaierror as e:
            raise ConfigError(
                f"rank {env.rank}: rendezvous host {addr!r} does not resolve ({e.strerror}); "
                f"{flags} must name rank 0's host, the same on every rank"
            ) from None
        # refused (rank 0 not up yet), unreachable, timed out: retried until the deadline
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"rank {env.rank} found nothing listening at {addr}:{port} ({e.strerror or e}) after waiting "
                    f"{time.monotonic() - start:.0f} s (distributed.timeout_seconds = {timeout_s:g}); start rank 0 "
                    f"first (it listens there), give every rank the same {flags}, or raise "
                    "distributed.timeout_seconds"
                ) from None
            time.sleep(0.5)
    # A torch store answers in milliseconds once connected; 30 s leaves room for a loaded node.
    problem = _probe_store(addr, port, min(30.0, timeout_s))
    if problem is not None:
        raise ConfigError(
            f"rank {env.rank} reached {addr}:{port}, but what answers there is not rank 0's torch.distributed "
            f"store ({problem}); is another program using port {port}? Pick a free port and pass the same "
            f"{flags} to every rank (rank 0 checks the port is free)"
        )


def _probe_store(addr: str, port: int, wait_s: float) -> str | None:
    """None when a torch.distributed store answers at addr:port within wait_s, else what happened instead.

    The client runs in a forked child that is killed when it does not answer: a peer that never answers
    holds torch's client in C++ past its timeout, and a thread left there aborted the whole process at exit
    when torch's late exception met interpreter shutdown ("terminate called without an active exception").
    """
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(
        target=_store_answers,
        args=(addr, port, wait_s, sender),
        name="lockstep-store-probe",
        daemon=True,
    )
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        # c10d logs each failed try with C++ frames (the child inherits fd 2); the verdict replaces them
        with _fd2_to(log):
            child.start()
            sender.close()
            try:
                # torch retries until its own timeout and then raises its last error ("Ping failed"):
                # 10 s past it leaves room for a loaded node (2 s was measured short at 5.0 s under load)
                outcome = receiver.recv() if receiver.poll(wait_s + 10) else "timeout"
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
        dist.TCPStore(
            addr,
            port,
            None,
            False,
            timeout=datetime.timedelta(seconds=wait_s),
            wait_for_workers=False,
        )
        sender.send(None)
    # DistNetworkError: the peer broke the store protocol ("Ping failed, ...")
    except Exception as e:
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
        return (
            f"rank 0 waited {timeout_s:g} s (distributed.timeout_seconds) at {where} for the other ranks of "
            f"world_size {env.world_size} ({_first_line(e)}); start {others} with the same {flags} and world "
            "size, or raise distributed.timeout_seconds"
        )
    return (
        f"rank {env.rank} reached rank 0's store at {where} but could not join the group within {timeout_s:g} s "
        f"(distributed.timeout_seconds; {_first_line(e)}); give every rank the same {flags} and world size "
        f"({env.world_size}), and check that rank 0 is still running"
    )


def _attempt_store(env: LaunchEnv, timeout: datetime.timedelta, attempt: str) -> dist.Store:
    """The agent's store, with this restart attempt's own key space: torch elastic hands every attempt of a c10d
    rendezvous the same store, and a restarted gloo group read the dead workers' addresses from it ("connectFullMesh
    ... Connection refused", seen here 3 times in 5)."""
    agent_store = dist.TCPStore(
        env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"lockstep/attempt_{attempt}", agent_store)


def shutdown_runtime(rt: Runtime | None = None) -> None:
    """Tear the group down. Once DDP has used it, torch keeps the group's gloo threads until the process ends:
    the process leaves through lockstep.runtime.process_end, never plain finalization, which those threads can abort."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def side_group(rt: Runtime, timeout_seconds: float) -> object | None:
    """A gloo group of every rank for collectives a background thread runs (a save or a memory
    snapshot written while training goes on): on the training thread's group the two threads'
    collectives would interleave. Every rank calls it, once per run; None on one process."""
    if not rt.distributed:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
