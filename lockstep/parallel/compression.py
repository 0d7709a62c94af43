"""Gradient compression for DDP's all-reduce (parallel.grad_compression), through torch's own communication hooks.

    none       DDP's own all-reduce of each gradient bucket
    bf16/fp16  each bucket cast to 16 bits, all-reduced, cast back (torch's default_hooks): half the bytes
    powersgd   each gradient matrix sent as a rank-r product P Q^T, with error feedback (torch's powerSGD_hook)

A hook replaces the all-reduce of one bucket; under no_sync() DDP calls none, so accumulation still makes exactly
one (compressed) all-reduce per optimizer step. Every rank ends with the same decompressed gradients, so
parallel.check_grads compares them as it compares plain ones. The DDP check (lockstep.parallel.ddp_check) looks at
the bare model before DDP and its hook exist, and its choice applies unchanged: with find_unused_parameters a
bucket's unused gradients reach the hook as zeros, and the usage guard still runs before the reducing backward.
Only DDP has hooks: FSDP reduce-scatters shards inside
its own hooks, tensor-parallel gradients are DTensor shards, and a pipeline stage's data-parallel reduce is FSDP's;
check_compression refuses those layouts.

PowerSGD keeps state between steps: per bucket, the local error of the last compression (different on every rank)
and the warm-started Q matrices (the same on every rank). torch keys it by DDP bucket index, and DDP's buckets change:
it rebuilds them after its first step, in a new process too. `PowerSGD` therefore keeps the state per parameter
whenever the buckets it was made for are gone (after a resume or a rebuild) and lays it out again for the buckets that
come, and draws the first Qs per parameter, so a checkpoint's state (per parameter, by name) resumes exactly.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    _should_compress,
    powerSGD_hook,
)

from lockstep.collectives import all_reduce_max, gather_to_main
from lockstep.config import ParallelConfig
from lockstep.errors import ConfigError, GradientOverflow
from lockstep.runtime import Runtime

FP16_MAX = torch.finfo(torch.float16).max  # 65504: a larger gradient cast to fp16 becomes inf
FORMAT = 1  # of PowerSGD.state_dict()
# torch's default: a matrix is compressed when that sends under half its numbers
MIN_COMPRESSION_RATE = 2


def check_compression(
    parallel: ParallelConfig, layout: str, data_parallel: str, tp: int, pp: int
) -> None:
    """Refuse a compression setting with a layout that has no DDP all-reduce to compress."""
    if parallel.grad_compression == "none":
        return
    why = None
    if data_parallel == "fsdp":
        why = "FSDP reduce-scatters gradient shards inside its own hooks, which DDP's communication hooks cannot reach"
    elif tp > 1:
        why = "tensor-parallel gradients are sharded DTensors reduced by FSDP, not DDP's bucketed all-reduce"
    elif pp > 1:
        why = "pipeline stages reduce their gradients through FSDP, not DDP's bucketed all-reduce"
    if why:
        raise ConfigError(
            f"parallel.grad_compression = {parallel.grad_compression!r} compresses DDP's gradient "
            f"all-reduce, and this run's layout is {layout}: {why}. Use data_parallel: ddp with "
            "tensor_parallel 1 and pipeline_parallel 1, or set parallel.grad_compression: none"
        )


def check_powersgd_rank(model: nn.Module, rank: int) -> None:
    """PowerSGD's rank must fit every gradient matrix it compresses (rows = dim 0, columns = the rest, as torch views
    it): a larger rank sends more than the matrix itself, so the hook would send that matrix uncompressed. Matrices
    that no rank makes worth compressing (a 2-class head: 2 x hidden) are sent whole anyway and do not count."""
    matrices = []
    for name, p in model.named_parameters():
        if p.requires_grad and p.dim() >= 2 and p.numel():
            n, m = p.shape[0], p.numel() // p.shape[0]
            if _should_compress(n, m, 1, MIN_COMPRESSION_RATE)[0]:
                matrices.append((min(n, m), name, tuple(p.shape)))
    if not matrices:
        raise ConfigError(
            "parallel.grad_compression = 'powersgd' compresses gradient matrices, and this model has no "
            "trainable matrix PowerSGD would compress; use bf16 or none"
        )
    smallest, name, shape = min(matrices)
    if rank > smallest:
        raise ConfigError(
            f"parallel.powersgd_rank = {rank} is larger than the smallest gradient matrix dimension, "
            f"{smallest} ({name}, shape {shape}); PowerSGD's rank must be at most the smaller side of "
            f"every matrix it compresses: set parallel.powersgd_rank to {smallest} or less (1-8 is "
            "typical)"
        )


def apply_compression(
    ddp: nn.Module, model: nn.Module, parallel: ParallelConfig, log: logging.Logger | None = None
) -> Compression | None:
    """Register the hook parallel.grad_compression names on `ddp` (DDP over a module whose `.model` is `model`);
    return what the loop and the checkpoint need from it (None for none)."""
    match parallel.grad_compression:
        case "none":
            return None
        case "bf16":
            comp = Compression("bf16")
            ddp.register_comm_hook(None, bf16_hook)
        case "fp16":
            comp = Compression("fp16")
            ddp.register_comm_hook(comp, fp16_hook)
        case "powersgd":
            check_powersgd_rank(model, parallel.powersgd_rank)
            names = {id(p): f"model.{name}" for name, p in model.named_parameters()}
            comp = PowerSGD(names, parallel.powersgd_rank, parallel.powersgd_start_step)
            ddp.register_comm_hook(comp, powersgd_hook)
        case other:
            raise ConfigError(
                f"parallel.grad_compression = {other!r} is not one of none, bf16, fp16, powersgd"
            )
    if log is not None:
        log.info("grad compression: %s", comp.describe(parallel))
    return comp


class Compression:
    """A hook's bookkeeping between steps: fp16's overflow watch. PowerSGD adds its state (below)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        # fp16: this rank's largest |gradient| before the cast, this step
        self.amax: torch.Tensor | None = None

    def describe(self, parallel: ParallelConfig) -> str:
        return {
            "bf16": "bf16 (torch's bf16_compress_hook: buckets all-reduced in bfloat16, half the bytes)",
            "fp16": "fp16 (torch's fp16_compress_hook: buckets all-reduced in float16, half the bytes; a "
            f"gradient above {FP16_MAX:g} overflows and stops the run)",
        }[self.kind]

    def check_step(self, step: int, rt: Runtime) -> None:
        """Every rank, after the step's backward: fp16 gradients that overflowed stop the run here, naming the step.
        A gradient above fp16's largest value becomes inf in the cast, and the all-reduce spreads it to every rank;
        one small all-reduce of the ranks' largest |gradient| lets them all decide alike."""
        amax, self.amax = self.amax, None
        if self.kind != "fp16" or amax is None:
            return
        largest = all_reduce_max(rt, float(amax))
        if not FP16_MAX < largest < math.inf:
            return  # fits fp16; or the gradients were not finite before the cast: not compression's doing
        raise GradientOverflow(
            f"step {step}: fp16 gradient compression overflowed: the largest gradient before compression was "
            f"{largest:.4g}, above fp16's largest value {FP16_MAX:g}, so the all-reduced gradients came back inf. "
            "Use parallel.grad_compression: bf16 (half the bytes too, with fp32's range), or lower the loss's scale"
        )

    def state_dict(self) -> dict | None:
        return None


# The hooks carry no annotations: DDP compares them with the classes themselves, and this module's annotations are
# strings (from __future__ import annotations). Each takes (state, bucket: dist.GradBucket) -> Future[Tensor].


def bf16_hook(state, bucket):
    """torch's bf16_compress_hook under another name: DDP refuses that name unless NCCL is present, yet gloo sums
    bfloat16 as well (lockstep's tests run it on CPU)."""
    return default_hooks.bf16_compress_hook(None, bucket)


def fp16_hook(state, bucket):
    """torch's fp16_compress_hook, watching for overflow: the largest |gradient| before the cast (on the device, read
    once per step by Compression.check_step). aminmax reads the bucket once; abs().max() cost 20x more on a CPU."""
    low, high = torch.aminmax(bucket.buffer().detach())
    amax = torch.maximum(-low, high)
    state.amax = amax if state.amax is None else torch.maximum(state.amax, amax)
    return default_hooks.fp16_compress_hook(None, bucket)


def powersgd_hook(state, bucket):
    """torch's powerSGD_hook, its state first laid out for this bucket (PowerSGD.place), once the bucket before it is
    done. torch's hook issues its second and third all-reduce from the first one's completion callback; gloo runs
    those callbacks on its own threads, so with several buckets in flight the ranks could issue the buckets'
    all-reduces in different orders ("collective mismatch", seen with 3 buckets on 2 ranks). Waiting here, on the
    autograd thread (never on gloo's), keeps one order on every rank; backward overlaps the bucket before."""
    if state.in_flight is not None:
        state.in_flight.wait()
    state.place(bucket)
    fut = powerSGD_hook(state.torch_state, bucket)
    # DDP itself waits for the step's last bucket
    state.in_flight = None if bucket.is_last() else fut
    return fut


class PowerSGD(Compression):
    """torch's PowerSGDState, with its per-bucket state kept per parameter across bucket changes and checkpoints."""

    def __init__(self, names: dict[int, str], rank: int, start_step: int) -> None:
        super().__init__("powersgd")
        # process_group None: the default group, the one DDP reduces over
        self.torch_state = PowerSGDState(
            None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_step,
            min_compression_rate=MIN_COMPRESSION_RATE,
            use_error_feedback=True,
            warm_start=True,
        )
        self.names = names  # id(parameter) -> its name in the module DDP wraps
        self.layouts: dict[
            int, tuple[tuple[str, torch.Size], ...]
        ] = {}  # bucket index -> (name, shape) its state is for
        self.loose: dict[str, dict[str, torch.Tensor]] = {
            "error": {},
            "q": {},
        }  # per parameter, in no bucket yet
        # buckets this step has placed (their futures may still be running)
        self.placed: set[int] = set()
        # this step's last bucket so far (powersgd_hook)
        self.in_flight: torch.futures.Future | None = None

    def describe(self, parallel: ParallelConfig) -> str:
        return (
            f"powersgd (torch's powerSGD_hook: rank {parallel.powersgd_rank} with error feedback and warm start, "
            f"plain all-reduce for the first {parallel.powersgd_start_step} steps)"
        )

    def place(self, bucket: dist.GradBucket) -> None:
        """Before torch's hook runs on `bucket`: its state, laid out for this bucket's parameters."""
        b = bucket.index()
        layout = tuple((self.names[id(p)], p.shape) for p in bucket.parameters())
        st = self.torch_state
        if self.layouts.get(b) != layout:
            # new buckets (DDP's rebuild, or the first step of a resumed run): every bucket this step has not yet
            # reached goes back to per-parameter state, so none is read under a layout it was not made for
            for k in [k for k in self.layouts if k not in self.placed]:
                self._unplace(k)
            self._lay_out(b, layout, bucket.buffer())
        elif st.iter >= st.start_powerSGD_iter and b not in st.p_memory_dict:
            # the first compressed step: Q drawn per parameter
            self._lay_out(b, layout, bucket.buffer())
        self.placed.add(b)
        if bucket.is_last():
            self.placed.clear()

    def _unplace(self, b: int) -> None:
        st = self.torch_state
        errors, qs = self._split(b)
        self.loose["error"].update(errors)
        self.loose["q"].update(qs)
        for d in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
            d.pop(b, None)
        del self.layouts[b]

    def _split(self, b: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Bucket b's error (one flat slice per parameter) and Q memory (one slice per compressed matrix), by name."""
        st, layout = self.torch_state, self.layouts[b]
        errors, qs = {}, {}
        if b in st.error_dict:
            sizes = [shape.numel() for _, shape in layout]
            errors = {
                name: t.clone() for (name, _), t in zip(layout, st.error_dict[b].split(sizes))
            }
        if b in st.q_memory_dict:
            compressed = self._compressed(layout)
            sizes = [m * r for _, _, m, r in compressed]
            qs = {
                name: t.clone()
                for (name, _, _, _), t in zip(compressed, st.q_memory_dict[b].split(sizes))
            }
        return errors, qs

    def _lay_out(self, b: int, layout: tuple, buffer: torch.Tensor) -> None:
        st, names = self.torch_state, [name for name, _ in layout]
        self.layouts[b] = layout
        if any(name in self.loose["error"] for name in names):
            st.error_dict[b] = torch.cat([self.loose["error"].pop(name) for name in names]).to(
                buffer
            )
        compressed = self._compressed(layout)
        if st.iter >= st.start_powerSGD_iter:
            # torch draws the first Qs bucket by bucket from one generator, so they would depend on how DDP happened
            # to bucket the parameters; drawn per parameter from its name, they are the same in any bucket layout
            for name, _, m, r in compressed:
                if name not in self.loose["q"]:
                    self.loose["q"][name] = torch.randn(
                        m * r, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))
                    )
        if compressed and all(name in self.loose["q"] for name, *_ in compressed):
            st.q_memory_dict[b] = torch.cat(
                [self.loose["q"].pop(name) for name, *_ in compressed]
            ).to(buffer)
            # its presence says "warm start": P is recomputed from Q before it is read
            st.p_memory_dict[b] = buffer.new_zeros(sum(n * r for _, n, _, r in compressed))

    def _compressed(self, layout: Iterable) -> list[tuple[str, int, int, int]]:
        """(name, rows, columns, rank) of the matrices torch's hook compresses in a bucket of `layout`, in the order
        its P and Q memory holds them: grouped by shape, shapes in order of first appearance."""
        st, groups = self.torch_state, {}
        for name, shape in layout:
            n = shape[0] if len(shape) else 1
            m = shape.numel() // n if n else 0
            r = min(n, m, st.matrix_approximation_rank)
            if _should_compress(n, m, r, st.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n, m, r))
        return [entry for group in groups.values() for entry in group]

    def state_dict(self) -> dict:
        """Between steps: this rank's state by parameter name (error feedback differs per rank; Q does not)."""
        errors, qs = dict(self.loose["error"]), dict(self.loose["q"])
        for b in self.layouts:
            e, q = self._split(b)
            errors.update(e)
            qs.update(q)
        return {"format": FORMAT, "iter": self.torch_state.iter, "error": errors, "q": qs}

    def load_state_dict(self, saved: dict, same_ranks: bool) -> None:
        """A checkpoint's state (this rank's); `same_ranks`: saved by as many ranks, so the error feedback is ours.
        The state is placed into buckets as DDP's buckets come (place)."""
        st = self.torch_state
        st.iter = saved["iter"]
        self.layouts.clear()
        for d in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
            d.clear()
        self.loose = {"error": dict(saved["error"]) if same_ranks else {}, "q": dict(saved["q"])}


def load_compression_state(
    comp: Compression, saved: dict, rt: Runtime, log: logging.Logger
) -> None:
    """A checkpoint's grad_compression.pt into this run's hook: PowerSGD's step count and Q matrices always, its error
    feedback (each rank's own) only at the world size that saved it."""
    if saved.get("kind") != comp.kind:
        if rt.is_main:
            log.info(
                "grad compression: the checkpoint's %s state does not apply to %s; starting it afresh",
                saved.get("kind"),
                comp.kind,
            )
        return
    same_ranks = saved["world_size"] == rt.world_size
    if not same_ranks and rt.is_main:
        log.warning(
            "grad compression: the checkpoint's PowerSGD error feedback is per rank, saved by %d ranks; with "
            "%d it starts from zero (its Q matrices and step count carry over), so this resume is not exact",
            saved["world_size"],
            rt.world_size,
        )
    comp.load_state_dict(
        {
            "iter": saved["iter"],
            "q": saved["q"],
            "error": saved["errors"][rt.rank] if same_ranks else {},
        },
        same_ranks,
    )


def save_compression_state(comp: Compression | None, rt: Runtime) -> dict | None:
    """Every rank together: the hook's state for grad_compression.pt, gathered on rank 0 (None elsewhere, and when the
    hook keeps none). Error feedback is per rank, Q and the step count the same on all; rank 0's are kept."""
    local = comp.state_dict() if comp is not None else None
    if local is None:
        return None
    every = gather_to_main(rt, local["error"])
    if every is None:
        return None
    return {
        "format": local["format"],
        "kind": comp.kind,
        "world_size": rt.world_size,
        "iter": local["iter"],
        "q": local["q"],
        "errors": every,
    }
