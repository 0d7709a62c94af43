"""Gradient all-reduce time per step against compute time, and the `parallel.grad_compression` that pays.

`estimate_comm` is pure (a test feeds it numbers); `lockstep doctor --config` (lockstep.doctor.comm_check) and the
trainer's start (`comm_notes`, with one `probe_bus_bandwidth`) call it. The model it uses, chosen here:

- ring all-reduce: each rank sends and receives 2(W-1)/W x the bytes, so at bus bandwidth B (nccl-tests' busbw,
  the doctor's table) it takes 2(W-1)/W x bytes / B, i.e. bytes / algbw;
- bandwidth depends on the message size: DDP all-reduces buckets of parallel.bucket_cap_mb (25 MiB), so busbw
  is read at one bucket's message (the whole gradient when smaller), interpolated linearly in log(size) between
  the measured sizes and held at the ends of the measured range; a compressed setting's message is its share of
  a bucket, read at that (smaller, slower) size;
- no overlap: DDP starts a bucket's all-reduce while backward goes on, so a real step hides part of this time;
  the share shown (comm / (comm + compute)) is an upper bound;
- bf16 / fp16: torch's hooks cast each bucket to 2-byte floats (half of fp32 gradients);
- powersgd rank r: torch's hook views each gradient as (shape[0], rest) = (n, m) and sends P (n x r) and Q
  (m x r) in the gradient's dtype when (n + m) x r x 2 < n x m (its min_compression_rate 2); everything else
  (biases, norms, small or thin matrices such as LoRA's) goes uncompressed. Its extra latency (three
  all-reduces per bucket) and its compute are left out.

Recommendation thresholds: keep `none` while the all-reduce takes under 20% of the compute time (KEEP_RATIO;
compression then saves at most a sixth of the step); `bf16` when it matters; `powersgd` when even bf16 leaves
the all-reduce longer than compute and powersgd sends under half of bf16's bytes. fp16 is never recommended:
same bytes as bf16 with a narrower range (only for GPUs without bf16, e.g. V100). Nothing to gain with one
process, or a gradient of at most 1 MiB (TINY_BYTES: a few latency-bound messages, which compression cannot cut)
whose all-reduce takes less than the compute.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lockstep.collectives import all_reduce_max
from lockstep.config import ParallelConfig
from lockstep.runtime import Runtime
from lockstep.runtime.cuda import synchronize

MiB = 1 << 20
SETTINGS = ("none", "bf16", "fp16", "powersgd")
KEEP_RATIO = 0.2  # comm / compute below this: compression is not worth its cost
TINY_BYTES = 1 * MiB
POWERSGD_MIN_COMPRESSION_RATE = 2  # torch's PowerSGDState default

# (shape, bytes per element) of each trainable parameter
GradLayout = list[tuple[tuple[int, ...], int]]


def gradient_layout(model: nn.Module) -> GradLayout:
    """What DDP all-reduces each step: every trainable parameter's shape and gradient element size (meta works)."""
    return [(tuple(p.shape), p.element_size()) for p in model.parameters() if p.requires_grad]


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    n = shape[0] if shape else 1
    return n, math.prod(shape) // n if n else 0


def sent_bytes(layout: GradLayout, setting: str, powersgd_rank: int = 4) -> int:
    """Bytes one rank's all-reduce input holds per step under `setting` (before the ring's 2(W-1)/W)."""
    match setting:
        case "none":
            return sum(math.prod(shape) * size for shape, size in layout)
        case "bf16" | "fp16":
            return sum(math.prod(shape) * min(size, 2) for shape, size in layout)
        case "powersgd":
            total = 0
            for shape, size in layout:
                n, m = _matrix(shape)
                r = min(n, m, powersgd_rank)
                compress = (n + m) * r * POWERSGD_MIN_COMPRESSION_RATE < n * m
                total += ((n + m) * r if compress else n * m) * size
            return total
        case _:
            raise ValueError(f"grad compression {setting!r} is not one of {', '.join(SETTINGS)}")


def busbw_at(bandwidth: Sequence[tuple[int, float]], nbytes: float) -> float:
    """Bus bandwidth (GB/s) at message size `nbytes` from measured (bytes, busbw GB/s) points: linear in
    log(size) between them, the nearest measured value outside their range."""
    points = sorted((b, g) for b, g in bandwidth if b > 0 and g > 0)
    if not points:
        raise ValueError(f"no measured bandwidth to read ({list(bandwidth)!r})")
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, g0), (b1, g1) in zip(points, points[1:]):
        if nbytes <= b1:
            t = math.log(nbytes / b0) / math.log(b1 / b0)
            return g0 + t * (g1 - g0)
    return points[-1][1]


@dataclass
class CommEstimate:
    world_size: int
    grad_bytes: int  # all trainable gradients, as DDP all-reduces them uncompressed
    compute_s: float  # per optimizer step
    rows: list[dict]  # per setting: setting, bytes, message_bytes, busbw_gbps, comm_s, share
    recommend: str  # a setting of SETTINGS
    reason: str  # why, with the numbers
    dominated: bool  # the recommended setting differs from none because the link takes a real share

    def row(self, setting: str) -> dict:
        return next(r for r in self.rows if r["setting"] == setting)

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "grad_bytes": self.grad_bytes,
            "compute_s": self.compute_s,
            "settings": self.rows,
            "recommend": self.recommend,
            "reason": self.reason,
        }


def comm_rows(
    layout: GradLayout,
    world_size: int,
    bandwidth: Sequence[tuple[int, float]],
    bucket_bytes: int = 25 * MiB,
    powersgd_rank: int = 4,
) -> list[dict]:
    """Per setting: bytes sent per step, the message size busbw is read at, that busbw, and seconds per step."""
    full = sent_bytes(layout, "none")
    rows = []
    for setting in SETTINGS:
        nbytes = sent_bytes(layout, setting, powersgd_rank)
        message = min(bucket_bytes, full) * (nbytes / full) if full else 0
        if world_size == 1 or nbytes == 0:
            busbw, seconds = 0.0, 0.0
        else:
            busbw = busbw_at(bandwidth, message)
            seconds = 2 * (world_size - 1) / world_size * nbytes / (busbw * 1e9)
        rows.append(
            {
                "setting": setting,
                "bytes": nbytes,
                "message_bytes": int(message),
                "busbw_gbps": busbw,
                "comm_s": seconds,
            }
        )
    return rows


def estimate_comm(
    layout: GradLayout,
    world_size: int,
    bandwidth: Sequence[tuple[int, float]],
    compute_s: float,
    bucket_bytes: int = 25 * MiB,
    powersgd_rank: int = 4,
) -> CommEstimate:
    """Comm time per step for each setting against `compute_s`, and the setting to use (module docstring)."""
    rows = comm_rows(layout, world_size, bandwidth, bucket_bytes, powersgd_rank)
    for r in rows:
        r["share"] = r["comm_s"] / (r["comm_s"] + compute_s) if r["comm_s"] > 0 else 0.0
    est = CommEstimate(
        world_size, rows[0]["bytes"], compute_s, rows, recommend="none", reason="", dominated=False
    )
    est.recommend, est.reason, est.dominated = recommend(est, powersgd_rank)
    return est


def _of_compute(comm_s: float, compute_s: float) -> str:
    """'38% of the compute time', '1,525x the compute time'."""
    x = comm_s / compute_s if compute_s > 0 else math.inf
    # the estimate left no compute in the measured step: give the time itself
    if not math.isfinite(x):
        return f"{comm_s:.3g} s a step"
    return f"{100 * x:.0f}% of the compute time" if x < 10 else f"{x:,.0f}x the compute time"


def recommend(est: CommEstimate, powersgd_rank: int = 4) -> tuple[str, str, bool]:
    """(setting, why, whether the link takes a share worth compressing)."""
    if est.world_size == 1:
        return "none", "one process: there is no gradient all-reduce, nothing to gain", False
    if est.grad_bytes <= TINY_BYTES and est.row("none")["comm_s"] <= est.compute_s:
        # on a slow enough link even a small gradient dominates: then the rules below decide
        return (
            "none",
            (
                f"the gradient is {format_bytes(est.grad_bytes)} (LoRA-sized): a few latency-bound "
                "messages that compression cannot shorten, nothing to gain"
            ),
            False,
        )
    none, bf16, psgd = est.row("none"), est.row("bf16"), est.row("powersgd")
    if none["comm_s"] < KEEP_RATIO * est.compute_s:
        return (
            "none",
            (
                f"the uncompressed all-reduce takes {_of_compute(none['comm_s'], est.compute_s)}, under "
                f"{100 * KEEP_RATIO:.0f}%: compression would save at most {100 * none['share']:.0f}% of a "
                "step"
            ),
            False,
        )
    said = f"the all-reduce takes {_of_compute(none['comm_s'], est.compute_s)}"
    # not when the gradients are 16-bit already (model.dtype bfloat16)
    halves = bf16["bytes"] < none["bytes"]
    if halves and bf16["comm_s"] <= est.compute_s:
        return (
            "bf16",
            f"{said}; bf16 halves it to {_of_compute(bf16['comm_s'], est.compute_s)}",
            True,
        )
    if psgd["bytes"] * 2 <= bf16["bytes"]:
        still = (
            f" and with bf16 still {_of_compute(bf16['comm_s'], est.compute_s)}" if halves else ""
        )
        return (
            "powersgd",
            (
                f"{said}{still}; powersgd rank {powersgd_rank} sends "
                f"{100 * psgd['bytes'] / none['bytes']:.1f}% of the bytes "
                f"({_of_compute(psgd['comm_s'], est.compute_s)})"
            ),
            True,
        )
    shapes = (
        f"powersgd rank {powersgd_rank} would send {100 * psgd['bytes'] / bf16['bytes']:.0f}% of bf16's bytes "
        "on these shapes (small or thin matrices stay uncompressed)"
    )
    if halves:
        return (
            "bf16",
            f"{said}; bf16 halves it to {_of_compute(bf16['comm_s'], est.compute_s)}, and {shapes}",
            True,
        )
    return (
        "none",
        (
            f"{said}, but the gradients are 16-bit already and {shapes}: no setting pays; more tokens per "
            "step (train.grad_accum) spread the all-reduce over more compute"
        ),
        False,
    )


def format_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def max_powersgd_rank(layout: GradLayout) -> int:
    """The largest parallel.powersgd_rank lockstep accepts for these gradients: the smallest side of any trainable
    matrix, as torch views it (lockstep.parallel.compression refuses a larger one); 0 when there is no matrix."""
    sides = [min(_matrix(shape)) for shape, _ in layout if len(shape) >= 2 and math.prod(shape)]
    return min(sides, default=0)


def fix_text(setting: str, powersgd_rank: int = 4, max_rank: int | None = None) -> str:
    """What to add to `lockstep train` / `lockstep launch` for `setting`."""
    if setting != "powersgd":
        return f"--set parallel.grad_compression={setting}"
    if max_rank is not None and powersgd_rank > max_rank:
        return f"--set parallel.grad_compression=powersgd --set parallel.powersgd_rank={max_rank}"
    return "--set parallel.grad_compression=powersgd (and parallel.powersgd_rank to trade bytes for accuracy)"


# ---- at the start of a run: one probe all-reduce, then a line for the log ----


def probe_bus_bandwidth(rt: Runtime, nbytes: int = 25 * MiB, iters: int = 2) -> float:
    """Bus bandwidth (GB/s) of an fp32 all_reduce of `nbytes` on rt's group: the slowest rank's mean over `iters`
    after one warm-up. Every rank must call it. Zeros, not random values: the training RNG is not touched."""
    if rt.world_size == 1:
        return math.inf
    x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=rt.device)
    dist.all_reduce(x)  # the first one sets up connections
    synchronize(rt.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    synchronize(rt.device)
    seconds = all_reduce_max(rt, (time.perf_counter() - start) / iters)
    return x.numel() * 4 / seconds / 1e9 * 2 * (rt.world_size - 1) / rt.world_size


def comm_notes(
    model: nn.Module,
    world_size: int,
    busbw_gbps: float,
    probe_bytes: int,
    step_seconds: float,
    parallel: ParallelConfig,
) -> list[str] | None:
    """Log lines at the start of a run: the estimated all-reduce per step against compute, and the setting to use;
    None when there is nothing to say (one process, a tiny gradient, or the setting in force is the right one
    and no compression is needed).

    model: the unwrapped model; busbw_gbps: `probe_bus_bandwidth(rt, probe_bytes)`; step_seconds: a measured
    optimizer step under the setting in force (parallel.grad_compression), all-reduce included. Compute is taken
    as step_seconds minus that setting's estimated all-reduce (no overlap: the smallest compute, so the largest
    share), and never below zero.
    """
    if world_size == 1:
        return None
    layout = gradient_layout(model)
    bandwidth = [(probe_bytes, busbw_gbps)]
    bucket = int(parallel.bucket_cap_mb * MiB)
    rows = comm_rows(layout, world_size, bandwidth, bucket, parallel.powersgd_rank)
    current = parallel.grad_compression
    now = next(r for r in rows if r["setting"] == current)["comm_s"]
    est = estimate_comm(
        layout,
        world_size,
        bandwidth,
        max(step_seconds - now, 0.0),
        bucket_bytes=bucket,
        powersgd_rank=parallel.powersgd_rank,
    )
    if est.recommend == current == "none":
        return None
    cells = ", ".join(
        f"{r['setting']} {r['comm_s']:.3g} s" for r in est.rows if r["setting"] != "fp16"
    )
    lines = [
        f"gradient all-reduce: {format_bytes(est.grad_bytes)} per step over {world_size} ranks at busbw "
        f"{busbw_gbps:.3g} GB/s (one {format_bytes(probe_bytes)} probe) would take {cells} per step (no overlap "
        f"with backward: an upper bound), against ~{est.compute_s:.3g} s of compute (step {step_seconds:.3g} s "
        f"less the {current} all-reduce)"
    ]
    if est.recommend == current or (
        est.recommend != "none" and now <= 1.1 * est.row(est.recommend)["comm_s"]
    ):
        # fp16 where bf16 is advised too
        lines.append(f"parallel.grad_compression = {current} fits: {est.reason}")
    elif est.recommend == "none":
        lines.append(
            f"parallel.grad_compression = {current} buys little here: {est.reason}; "
            f"{fix_text('none')} keeps the gradients exact"
        )
    else:
        fix = fix_text(est.recommend, parallel.powersgd_rank, max_powersgd_rank(layout))
        lines.append(f"the link dominates: {est.reason}; consider {fix}")
    return lines


def note_link(
    rt: Runtime, model: nn.Module, parallel: ParallelConfig, step_seconds: float, log
) -> None:
    """Once, early in a DDP run that spans nodes (every rank calls it: the probe is a collective): the link's share
    of a step, measured by one probe all-reduce of a bucket, and the compression setting that pays, logged by rank 0.
    Within one node the ranks talk over shared memory or loopback, and the probe would only cost time."""
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    probe = max(MiB, min(int(parallel.bucket_cap_mb * MiB), grad_bytes))
    busbw = probe_bus_bandwidth(rt, probe, iters=1)
    lines = comm_notes(
        model, rt.world_size, busbw, probe, step_seconds=step_seconds, parallel=parallel
    )
    if rt.is_main:
        for line in lines or [
            f"gradient all-reduce: busbw {busbw:.3g} GB/s between nodes (one "
            f"{format_bytes(probe)} probe); parallel.grad_compression = {parallel.grad_compression} "
            f"fits this link"
        ]:
            log.info("%s", line)
