"""Each rank's device in the doctor: what it is, how fast it multiplies matrices, NCCL on one GPU.

    probe_hardware  a GPU's name, memory, capability, SMs, bf16, CUDA and NCCL
                    (lockstep.runtime.cuda.cuda_facts); a CPU's name, RAM, threads, ISA and bf16
    probe_peak      the matmul FLOP/s this rank reaches in the dtype its training computes in
                    (lockstep.peak_flops.measure_peak_flops)
    one_rank_group  a process group of this process alone: at world size 1 nothing else forms
                    one, so a single-GPU machine would run its first NCCL collective in training
    check_hardware, check_peak  the rows, from every rank's facts (pure: tests feed them any
                    cluster)

The peak's dtype: bf16 on a GPU that has it, else fp16 (its tensor cores' other dtype); on a CPU
what train.mixed_precision = 'auto' picks (bf16 only where oneDNN has bf16 kernels: on an
AVX2-only EPYC a bf16 matmul ran ~50x slower than fp32, a number no training run would see).
Sizes: on a GPU the one `lockstep train` divides by for MFU (lockstep.peak_flops.probe_size:
8192, as 1024 would time kernel launches), for 0.5 s. On a CPU 512 x 512 for 0.25 s, the best of
CPU_WINDOWS windows (another process on the host takes a window, not the number): well under a
second on a busy core, where training's 1024 probe runs at least eleven 2-GFLOP products (over a
second at the ~20 GFLOP/s of one busy core here). With several threads a 512 product can read
lower than a 1024 one (16-21 vs 29-35 GFLOP/s on 2 busy threads here): on a CPU the doctor's
number is a floor.

Reference numbers: NVIDIA's datasheet dense BF16 tensor-core TFLOP/s for the models in
DATASHEET_BF16 (the datasheets print the 2:4-sparse figure, twice these). Dense bf16 matmuls
reach about 80% of them (an H100 80GB HBM3 measured 769-798 TFLOP/s in this project), so a GPU
under PEAK_WARN = 50% is power-capped, throttled or shared with another process. A MIG slice has
a fraction of the SMs by design: no reference for it. GPUs of one model that measure under
SPREAD_WARN = 80% of the fastest of them warn too, since every step waits for the slowest rank.
CPU ranks measure one local rank at a time (probe_peak_in_turn), and compare only where each has
cores of its own (on every host, its ranks' threads fit in the cores they may run on); ranks sharing
cores measure each other; then all at once (`together_flops`: what each gets while its host's ranks
all compute, as in training; lockstep.plan.profiles plans with it). A CPU rank more than CPU_MARGIN
= 0.5 below the other ranks' median warns (a cgroup's CPU quota, or taskset putting it on a busy
core): the straggler margin measured on these shared machines, where ranks of one run read up to
1.3x apart (BENCHMARKS.md, "Straggler margin: fault-free runs"). It warns after CPU_ROUNDS rounds of
windows, not one: a rank under the margin makes every rank measure another round, so a burst of
another process passes (CI's 2-core EPYC, three test workers busy beside the doctor, once read 106
against 195 GFLOP/s in one round) where a quota stays.
"""

from __future__ import annotations

import datetime
import os
import statistics
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from lockstep.collectives import all_reduce_max, gather_objects
from lockstep.doctor.report import Check, by_value, span, where
from lockstep.peak_flops import cpu_model, measure_peak_flops, probe_size
from lockstep.runtime import Runtime
from lockstep.runtime.cuda import cuda_facts
from lockstep.train.step import resolve_mixed_precision

PEAK_WARN, SPREAD_WARN, CPU_MARGIN = 0.5, 0.8, 0.5
CPU_SIZE, CPU_SECONDS, GPU_SECONDS = 512, 0.25, 0.5  # the probe's length (module docstring)
CPU_WINDOWS, CPU_ROUNDS = 5, 3
# (words in torch.cuda.get_device_name, all present; dense BF16 TFLOP/s from NVIDIA's datasheet);
# the first match wins, so the NVL and PCIe boards come before the SXM ones of the same GPU
DATASHEET_BF16 = (
    (("A100",), 312.0),
    (("H100", "NVL"), 835.0),
    (("H100", "PCIe"), 756.0),
    (("H100", "HBM3"), 989.0),  # the SXM5 board: "NVIDIA H100 80GB HBM3"
    (("H100", "SXM"), 989.0),
    (("H200", "NVL"), 835.0),
    (("H200",), 989.0),  # "NVIDIA H200" is the SXM board
)
GPU_SLOW_FIX = (
    "a GPU under its expected speed is power-capped, throttled or shared: `nvidia-smi -q -d "
    "PERFORMANCE` names its clocks' throttle reasons (power, thermal), `nvidia-smi -q -d POWER` "
    "its power limit, and `nvidia-smi` other processes on it; every training step waits for the "
    "slowest rank"
)
CPU_SLOW_FIX = (
    "a CPU rank slower than its peers is throttled or shares its cores: its cgroup's CPU quota "
    "(`cat /sys/fs/cgroup/cpu.max`), its affinity (`taskset -cp PID`) and other processes on its "
    "cores (`top`) say which; every training step waits for the slowest rank"
)


def datasheet_tflops(name: str) -> float | None:
    """The datasheet's dense BF16 TFLOP/s of the GPU called `name`; None: not listed, or MIG."""
    words = name.lower()
    if "mig" in words.split():
        return None
    for needed, tflops in DATASHEET_BF16:
        if all(w.lower() in words for w in needed):
            return tflops
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # no sysconf names (not Linux)
        return 0.0


def probe_hardware(device: torch.device) -> dict:
    """This rank's device facts; {"kind", "error"} when they cannot be read (a row, not a crash: the
    other ranks would wait for this one's facts until the timeout)."""
    try:
        if device.type == "cuda":
            return {"kind": "cuda", **cuda_facts(device)}
        bf16 = resolve_mixed_precision("auto", device)[0] == "bf16"
        return {
            "kind": device.type,
            "name": cpu_model(),
            "memory_gib": _ram_gib(),
            "threads": torch.get_num_threads(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "isa": torch.backends.cpu.get_cpu_capability(),
            "bf16": bf16,
        }
    except Exception as e:  # reported in the device row
        return {"kind": device.type, "error": _first_line(e)}


def peak_dtype(hardware: dict) -> torch.dtype:
    if hardware["kind"] == "cuda":
        return torch.bfloat16 if hardware.get("bf16") else torch.float16
    return torch.bfloat16 if hardware.get("bf16") else torch.float32


def probe_peak(device: torch.device, hardware: dict, windows: int = CPU_WINDOWS) -> dict:
    """Matmul FLOP/s on this rank's device in its training dtype, or the error a matmul raised. On a
    CPU the best of `windows` short windows: a busy host's other processes take a window, not the
    number."""
    dtype = peak_dtype(hardware)
    size = probe_size(device) if device.type == "cuda" else CPU_SIZE
    out = {"dtype": str(dtype).removeprefix("torch."), "size": size}
    try:
        if device.type == "cuda":
            return {**out, "flops": measure_peak_flops(device, dtype, size, GPU_SECONDS)}
        seconds = CPU_SECONDS / CPU_WINDOWS
        best = max(measure_peak_flops(device, dtype, size, seconds) for _ in range(windows))
        return {**out, "flops": best}
    except Exception as e:  # e.g. CUDA out of memory: another process holds the GPU
        return {**out, "error": _first_line(e)}


def _round_in_turn(rt: Runtime, hardware: dict, turns: int, best: dict) -> dict:
    """CPU_WINDOWS windows on each local rank in turn; this rank's best so far, or its first error."""
    for _ in range(CPU_WINDOWS):
        for turn in range(turns):
            dist.barrier()
            if rt.local_rank == turn:
                one = probe_peak(rt.device, hardware, windows=1)
                if "error" not in best and ("error" in one or one["flops"] > best.get("flops", 0)):
                    best = one
    return best


def probe_peak_in_turn(rt: Runtime, facts: dict) -> dict:
    """probe_peak of this rank (`facts`: its host, ranks and hardware); on CPUs one local rank at a
    time, the others waiting at a barrier, window by window in turn: ranks of one host share its
    memory bandwidth and, on SMT or AMX cores, the cores' units, so measured at once they measure
    each other (a 2-rank run here read 379 against 920 GFLOP/s bf16, no fault); and windows in turn
    see the host's other load alike (measured one rank after the other, a busy suite read 610
    against 953). While a rank reads slow (cpu_stragglers), every rank measures another round, up
    to CPU_ROUNDS: a quota or a core it shares stays slow, another process's burst passes."""
    if rt.device.type == "cuda" or not rt.distributed:
        return probe_peak(rt.device, facts["hardware"])
    turns, best = int(all_reduce_max(rt, float(rt.local_world_size))), {}
    for _ in range(CPU_ROUNDS):
        best = _round_in_turn(rt, facts["hardware"], turns, best)
        everyone = gather_objects(rt, {**facts, "peak": best})
        if any("error" in f["peak"] for f in everyone) or not cpu_stragglers(everyone):
            break
    if turns > 1:  # what each rank gets while its host's ranks all compute, as in training
        dist.barrier()
        together = probe_peak(rt.device, facts["hardware"])
        if "error" not in best and "error" not in together:
            best = {**best, "together_flops": together["flops"]}
    return best


@contextmanager
def one_rank_group(backend: str, device: torch.device, timeout: float) -> Iterator[None]:
    """The default process group with this process alone in it (its store in memory); destroyed
    on the way out."""
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---- the rows: pure functions of every rank's facts["hardware"] and facts["peak"] ----


def _together(fact: dict) -> bool:
    return "together_flops" in fact["peak"]


def describe(hw: dict) -> str:
    """'NVIDIA H100 80GB HBM3, 79.1 GiB, capability 9.0, 132 SMs, bf16, CUDA 13.0, NCCL 2.27.5'."""
    if hw["kind"] == "cuda":
        bf16 = "bf16" if hw["bf16"] else "no bf16"
        return (
            f"{hw['name']}, {hw['memory_gib']:.1f} GiB, capability {hw['capability']}, "
            f"{hw['multiprocessors']} SMs, {bf16}, CUDA {hw['cuda']}, NCCL {hw['nccl']}"
        )
    bf16 = "bf16 kernels" if hw["bf16"] else "no bf16 kernels"
    return (
        f"CPU {hw['name']}, {hw['memory_gib']:.1f} GiB RAM, {hw['threads']} thread(s), "
        f"{hw['isa']}, {bf16}"
    )


def check_hardware(facts: list[dict]) -> Check:
    errs = [f["rank"] for f in facts if "error" in f["hardware"]]
    if errs:
        return Check(
            "device",
            "fail",
            f"{where(facts, errs)}: the device's facts could not be read: "
            f"{facts[errs[0]]['hardware']['error']}",
            "`nvidia-smi` on that host shows whether the driver still sees the GPU; one in an "
            "error state (an Xid line in `dmesg`) needs a reset, or the node drained",
        )
    groups = by_value(facts, lambda f: describe(f["hardware"]))
    detail = "; ".join(f"{text} ({where(facts, ranks)})" for text, ranks in groups.items())
    gpus = {f["hardware"]["name"] for f in facts if f["hardware"]["kind"] == "cuda"}
    tips = [
        f"{f['hardware']['name']} has no bf16: train.mixed_precision=auto trains it in fp32; "
        "train.mixed_precision=fp16 (with a GradScaler) uses its tensor cores"
        for f in facts
        if f["hardware"]["kind"] == "cuda" and not f["hardware"]["bf16"]
    ][:1]
    if len(gpus) > 1:
        return Check(
            "device",
            "warn",
            detail,
            f"{len(gpus)} GPU models in one job: every step waits for the slowest; run it on one "
            "model (SLURM: --constraint or --gres=gpu:TYPE:N; Kubernetes: a nodeSelector on "
            "nvidia.com/gpu.product)",
            tips,
        )
    return Check("device", "ok", detail, advice=tips)


def format_flops(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


def _model(f: dict) -> tuple[str, str, str]:
    """(kind, name, dtype) of a rank's peak; a device whose facts could not be read (its own failed
    row) goes by its torch name."""
    return f["hardware"]["kind"], f["hardware"].get("name", f["device"]), f["peak"]["dtype"]


def _own_cores(facts: list[dict], ranks: list[int]) -> bool:
    """Whether, on every host, these ranks' threads fit in the cores they may run on (their
    affinities' union): only then does each measure its own cores."""
    hosts: dict[str, list[dict]] = {}
    for r in ranks:
        hosts.setdefault(facts[r]["host"], []).append(facts[r]["hardware"])
    return all(
        all("cpus" in hw for hw in hws)
        and sum(hw["threads"] for hw in hws) <= len({c for hw in hws for c in hw["cpus"]})
        for hws in hosts.values()
    )


def cpu_stragglers(facts: list[dict]) -> dict[int, str]:
    """{rank: why} for the CPU ranks more than CPU_MARGIN below the median of the other ranks of
    their CPU model, where each rank has cores of its own (module docstring)."""
    slow = {}
    for (kind, _, _), ranks in by_value(facts, _model).items():
        if kind != "cpu" or len(ranks) < 2 or not _own_cores(facts, ranks):
            continue
        flops = {r: facts[r]["peak"]["flops"] for r in ranks}
        for r in ranks:
            others = statistics.median(flops[o] for o in ranks if o != r)
            if flops[r] * (1 + CPU_MARGIN) < others:
                slow[r] = (
                    f"rank {r} (host {facts[r]['host']}, local rank {facts[r]['local_rank']}) "
                    f"reaches {format_flops(flops[r])}, under {1 / (1 + CPU_MARGIN):.0%} of "
                    f"the other ranks' median ({format_flops(others)})"
                )
    return slow


def check_peak(facts: list[dict]) -> Check:
    errs = [f["rank"] for f in facts if "error" in f["peak"]]
    if errs:
        p = facts[errs[0]]["peak"]
        return Check(
            "matmul peak",
            "fail",
            f"{where(facts, errs)}: a {p['size']} x {p['size']} {p['dtype']} matmul failed: "
            f"{p['error']}",
            "that device cannot run a matmul: `nvidia-smi` shows whether another process holds "
            "its memory; an Xid line in `dmesg` means the GPU needs a reset",
        )
    parts, slow = [], {}  # slow: {rank: why}, the first reason found per rank
    groups = by_value(facts, _model)
    for (kind, name, dtype), ranks in groups.items():
        flops = {r: facts[r]["peak"]["flops"] for r in ranks}
        low, high = min(flops.values()), max(flops.values())
        text = (
            format_flops(low) if len(ranks) == 1 else f"{format_flops(low)} to {format_flops(high)}"
        )
        parts.append(f"{dtype} {text} on {name} ({span(ranks)})")
        together = [facts[r]["peak"]["together_flops"] for r in ranks if _together(facts[r])]
        if together:
            parts[-1] += f", {format_flops(min(together))} each with a host's ranks at once"
        ref = datasheet_tflops(name) if kind == "cuda" and dtype == "bfloat16" else None
        if ref is not None:
            share = f"{low / 1e12 / ref:.0%}"
            share += f" to {high / 1e12 / ref:.0%}" if len(ranks) > 1 else ""
            parts[-1] += f", {share} of its datasheet's {ref:g} TFLOP/s"
            for r in (r for r in ranks if flops[r] < PEAK_WARN * ref * 1e12):
                slow.setdefault(
                    r,
                    f"rank {r} reaches {format_flops(flops[r])}, under {PEAK_WARN:.0%} of its "
                    f"datasheet's {ref:g} TFLOP/s",
                )
        for r in (r for r in ranks if kind == "cuda" and flops[r] < SPREAD_WARN * high):
            slow.setdefault(
                r,
                f"rank {r} reaches {format_flops(flops[r])}, under {SPREAD_WARN:.0%} of the "
                f"fastest {name} ({format_flops(high)})",
            )
    slow.update(cpu_stragglers(facts))
    detail = "; ".join(parts)
    if slow:
        fixes = {
            GPU_SLOW_FIX if facts[r]["hardware"]["kind"] == "cuda" else CPU_SLOW_FIX for r in slow
        }
        return Check(
            "matmul peak",
            "warn",
            f"{detail}; {'; '.join(slow[r] for r in sorted(slow))}",
            "; ".join(sorted(fixes, reverse=True)),
        )
    return Check("matmul peak", "ok", detail)
