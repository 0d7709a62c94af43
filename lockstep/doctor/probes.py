"""The doctor's probes: join the group, measure on every rank, gather, and build the `Report`.

At world size 1 on a GPU the doctor forms a 1-rank NCCL group for the all_reduce checks
(lockstep.doctor.device.one_rank_group): without it a single-GPU machine would first run NCCL in
training. On a CPU at world size 1 there is nothing a 1-rank gloo group would tell: those rows are
skipped with the reason."""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

import lockstep
from lockstep.collectives import all_reduce_max, broadcast_object, gather_objects
from lockstep.config import Config, DistributedConfig
from lockstep.doctor.checks import build_checks
from lockstep.doctor.comm_check import build_comm_check, probe_comm_facts
from lockstep.doctor.device import one_rank_group, probe_hardware, probe_peak_in_turn
from lockstep.doctor.filesystem import probe_filesystem
from lockstep.doctor.report import (
    CORRECTNESS_DTYPES,
    CORRECTNESS_NUMEL,
    DEFAULT_OUTPUT_DIR,
    ENV_PREFIXES,
    ENV_VARS,
    HANG_FIX,
    DoctorError,
    MiB,
    Report,
    bandwidth_sizes,
    bus_bandwidth,
    format_size,
)
from lockstep.errors import ConfigError
from lockstep.runtime import Runtime, init_runtime, pick_device, read_launch_env, shutdown_runtime
from lockstep.runtime.cuda import synchronize
from lockstep.train.links import probe_ring


@contextmanager
def _deadline(seconds: float, message: str):
    """Last resort against a hang the timeouts below miss: report, then end the process."""

    def fire():
        sys.stderr.write(
            f"lockstep doctor: error: {message} (no progress for {seconds:g} s)\n  fix: {HANG_FIX}\n"
        )
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def join_group(
    timeout: float, environ: Mapping[str, str] = os.environ
) -> tuple[Runtime, str | None]:
    """Join the launcher's group (or stay one process) with `timeout` on rendezvous and every collective.
    A device the rank cannot have (more processes than GPUs) becomes a failed check on CPU, not a crash."""
    env = read_launch_env(DistributedConfig(), environ)
    cfg = DistributedConfig(timeout_seconds=timeout)
    device_error = None
    try:
        pick_device(cfg, env.local_rank, env.local_world_size, environ)
    except ConfigError as e:
        device_error, cfg = str(e), replace(cfg, device="cpu")
    if env.world_size == 1:
        return init_runtime(cfg, environ), device_error
    where = f"{env.master_addr}:{env.master_port}"
    with _deadline(timeout + 20, f"rank {env.rank} hung joining the process group at {where}"):
        try:
            return init_runtime(cfg, environ), device_error
        except (RuntimeError, TimeoutError, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            what = (
                f"rank 0 waited for the other {env.world_size - 1} rank(s) at {where}"
                if env.rank == 0
                else f"rank {env.rank} of {env.world_size} could not reach the rendezvous store at {where}"
            )
            fix = (
                f"start the other ranks with MASTER_ADDR / MASTER_PORT naming an address of this host and port "
                f"{env.master_port}, and WORLD_SIZE={env.world_size}"
                if env.rank == 0
                else f"start every rank with the same MASTER_ADDR / MASTER_PORT and make sure rank 0 runs there (from "
                f"this host: `nc -zv {env.master_addr} {env.master_port}`)"
            )
            raise DoctorError(
                f"{what} (--timeout {timeout:g} s): {reason}",
                f"{fix}; open port {env.master_port} in the firewall, or raise --timeout if the ranks "
                "start far apart",
            ) from None


def _versions() -> dict[str, str]:
    nccl = "-"
    if torch.cuda.is_available() and dist.is_nccl_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lockstep": lockstep.__version__,
        "cuda": torch.version.cuda or "-",
        "nccl": nccl,
    }


def probe_local(
    rt: Runtime, device_error: str | None, environ: Mapping[str, str] = os.environ
) -> dict:
    device_id = "cpu"
    # CUDA_VISIBLE_DEVICES renumbers GPUs per rank: compare physical ids
    if rt.device.type == "cuda":
        uuid_ = getattr(torch.cuda.get_device_properties(rt.device), "uuid", None)
        device_id = (
            str(uuid_)
            if uuid_ is not None
            else f"{environ.get('CUDA_VISIBLE_DEVICES', '')}/{rt.device}"
        )
    env = {k: v for k, v in environ.items() if k in ENV_VARS or k.startswith(ENV_PREFIXES)}
    return {
        "rank": rt.rank,
        "local_rank": rt.local_rank,
        "local_world_size": rt.local_world_size,
        "host": rt.hostname,
        "device": str(rt.device),
        "device_id": device_id,
        "device_error": device_error,
        "pid": os.getpid(),
        "versions": _versions(),
        "env": env,
        "hardware": probe_hardware(rt.device),
    }


def probe_all_reduce(rt: Runtime) -> dict[str, str]:
    """Sum rank- and position-dependent integers in each dtype; compare with the exact sum."""
    n, out = rt.world_size, {}
    for name in CORRECTNESS_DTYPES:
        dtype = getattr(torch, name)
        # values 1..k; bfloat16 holds integers exactly only up to 256, so keep its sums below that
        k = max(1, min(7, 256 // n)) if name == "bfloat16" else 7
        for numel in CORRECTNESS_NUMEL:
            i = torch.arange(numel, dtype=torch.int64)
            x = ((i + rt.rank) % k + 1).to(dtype=dtype, device=rt.device)
            q, m = divmod(n, k)  # closed form of sum over ranks r of ((i + r) % k + 1)
            expected = n + q * (k * (k - 1) // 2) + sum((i + j) % k for j in range(m))
            key = f"{name} x {numel}"
            try:
                dist.all_reduce(x)
            except dist.DistError:
                raise
            except RuntimeError as e:  # e.g. a dtype the backend does not implement
                out[key] = f"skip: {str(e).strip().splitlines()[0][:120]}"
                continue
            got = x.cpu().to(torch.float64 if dtype.is_floating_point else torch.int64)
            exact = name != "bfloat16" or k * n <= 256
            good = (
                torch.equal(got, expected.to(got.dtype))
                if exact
                else torch.allclose(got, expected.to(got.dtype), rtol=1 / 64)
            )
            if good:
                out[key] = "ok"
            else:
                bad = int((got != expected.to(got.dtype)).nonzero()[0])
                out[key] = (
                    f"wrong: element {bad} is {got[bad].item()}, expected {expected[bad].item()}"
                )
    return out


def probe_bandwidth(rt: Runtime, max_bytes: int) -> list[dict]:
    """float32 all_reduce per size; time per op is the slowest rank's mean over a few iterations."""
    rows = []
    for size in bandwidth_sizes(max_bytes):
        x = torch.zeros(size // 4, dtype=torch.float32, device=rt.device)
        iters = max(3, min(20, 256 * MiB // size))  # ~1 s for the big sizes on 2 CPU processes
        for _ in range(2 if size <= 4 * MiB else 1):
            dist.all_reduce(x)
        synchronize(rt.device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        synchronize(rt.device)
        seconds = all_reduce_max(rt, (time.perf_counter() - t0) / iters)
        algbw = size / seconds / 1e9  # GB/s, decimal as in nccl-tests
        rows.append(
            {
                "bytes": size,
                "size": format_size(size),
                "iterations": iters,
                "time_us": seconds * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": bus_bandwidth(algbw, rt.world_size),
            }
        )
    return rows


def probe_one_rank(
    rt: Runtime, facts: dict, max_bytes: int, timeout: float, backend: str = "nccl"
) -> list[dict]:
    """World size 1: the all_reduce checks and bandwidth table (probe_bandwidth's rows, returned)
    on a 1-rank `backend` group. A group that fails goes into facts["group_error"]: a failed
    row, not a crash."""
    try:
        with one_rank_group(backend, rt.device, timeout):
            facts["all_reduce"] = probe_all_reduce(rt)
            return probe_bandwidth(rt, max_bytes)
    except (RuntimeError, ValueError) as e:  # DistError is one, so is "torch built without NCCL"
        text = str(e).strip()
        facts["group_error"] = f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"
        return []


def probe_barrier(rt: Runtime, rounds: int = 20) -> list[float]:
    times = []
    for _ in range(rounds + 2):
        t0 = time.perf_counter()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times[2:]  # the first barriers set up connections


def probe_clock(rt: Runtime, rounds: int = 3) -> list[float]:
    samples = []
    for _ in range(rounds):
        if rt.distributed:
            dist.barrier()
        samples.append(time.time())
    return samples


def run_doctor(
    output_dir: str | os.PathLike = DEFAULT_OUTPUT_DIR,
    max_bytes: int = 64 * MiB,
    timeout: float = 30.0,
    environ: Mapping[str, str] = os.environ,
    config: Config | None = None,
) -> Report:
    """Join the group, run every probe on this rank, gather, and build the report (on every rank).
    With `config`, also the check of its gradient all-reduce against its compute (lockstep.doctor.comm_check)."""
    rt, device_error = join_group(timeout, environ)
    out = Path(output_dir).absolute()
    phase = "the first collective"
    one_rank = not rt.distributed and rt.device.type == "cuda"
    backend = "nccl" if one_rank else rt.backend  # the group the all_reduce rows ran on
    try:
        with _deadline(
            max(120.0, 4 * timeout),
            f"rank {rt.rank} stopped making progress in the doctor's checks",
        ):
            nonce = broadcast_object(rt, uuid.uuid4().hex[:12])
            facts = probe_local(rt, device_error, environ)
            if config is not None:
                facts["comm"] = probe_comm_facts(rt, config)
            phase = "the matmul peak"
            facts["peak"] = probe_peak_in_turn(rt, facts)
            bandwidth: list[dict] = []
            if one_rank:
                phase = f"the 1-rank {backend} group"
                bandwidth = probe_one_rank(rt, facts, max_bytes, timeout, backend)
            if rt.distributed:
                phase = "all_reduce correctness"
                facts["all_reduce"] = probe_all_reduce(rt)
                phase = "all_reduce bandwidth"
                bandwidth = probe_bandwidth(rt, max_bytes)
                phase = "the point-to-point ring"
                facts["ring"] = probe_ring(rt)
                phase = "barrier"
                facts["barrier"] = probe_barrier(rt)
            phase = "the clock probe"
            facts["clock"] = probe_clock(rt)
            phase = "the filesystem probe"
            facts["fs"] = probe_filesystem(rt, out, nonce)
            phase = "gathering results"
            gathered = gather_objects(rt, facts)
    except dist.DistError as e:
        raise DoctorError(
            f"rank {rt.rank}: {phase} failed after up to {timeout:g} s: "
            f"{str(e).strip().splitlines()[0]}",
            HANG_FIX,
        ) from None
    finally:
        shutdown_runtime(rt)
    hosts = sorted({f["host"] for f in gathered})
    launcher = f"launcher {rt.launcher}" if rt.launcher != "none" else "standalone"
    group = rt.backend or (f"a 1-rank {backend} group" if one_rank else "no process group")
    summary = (
        f"{rt.world_size} rank{'s' if rt.world_size > 1 else ''} on {len(hosts)} host"
        f"{'s' if len(hosts) > 1 else ''} ({group}, {launcher}); output dir {out}"
    )
    ranks = [
        {
            "rank": f["rank"],
            "local_rank": f["local_rank"],
            "host": f["host"],
            "device": f["device"],
            **f["versions"],
            "hardware": f["hardware"],
            "peak": f["peak"],
        }
        for f in gathered
    ]
    checks, comm = build_checks(gathered, bandwidth, str(out), backend), None
    if config is not None:
        check, comm = build_comm_check(gathered, bandwidth, config)
        checks.append(check)
    return Report(summary, checks, ranks, bandwidth, rt.rank, rt.local_rank, comm)
