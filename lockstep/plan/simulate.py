"""One rank of a world that need not exist: the real model under lockstep's real parallel code, on
torch's fake process group, one optimizer step on fake tensors, its memory tracked.

    fake_world(world, rank)          torch's "fake" backend: any rank of any world size in this
                                     process, collectives that move nothing and return at once
    simulate_rank(cfg, layout, ...)  -> RankSim: this rank's shards, its memory at the step's peak
    build_fake_model(cfg)            the model of cfg's kind (lockstep.plan.models: the GPT;
                                     lockstep.plan.hf_models: Hugging Face models)

The model is built under torch's FakeTensorMode (tensors with shapes, dtypes and devices, no
storage), then lockstep.parallel.apply.apply_parallelism shards it as `lockstep train` does (TP's
DTensors, the pipeline stage's cut, FSDP2's sharded parameters), so a layout that train would refuse
or crash on fails here the same way. lockstep.train.step runs the step itself (train_step, or
pipeline_step for a stage), and torch's own memory trackers (torch.distributed._tools.MemTracker,
and FSDPMemTracker under FSDP) sort every tensor it makes into parameters, gradients, optimizer
state, activations and temporaries, and keep the breakdown at the peak. The parallel code runs
outside the fake mode (DeviceMesh holds a real tensor of its ranks); the fake parameters carry
their mode with them.

Two things are counted by hand, as the trackers cannot see them: DDP's gradient buckets (lockstep
wraps the model in DDP with gradient_as_bucket_view: the gradients live in buckets allocated at
construction, one gradient's worth, for the whole run), and the runtime's own reserve (CUDA context,
NCCL buffers, the allocator's slack: lockstep.plan.profiles). A step that fake tensors cannot run
(a data-dependent shape in the model's forward, or no batch shape for its task) falls back to
lockstep.plan.formula's estimate from the same shards, and the RankSim says why (`estimated`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lockstep.config import Config
from lockstep.errors import ConfigError
from lockstep.optim import build_optimizer
from lockstep.parallel.apply import apply_parallelism
from lockstep.parallel.mesh import BatchPlan, Layout
from lockstep.plan.models import FakeModel, ModelShape, NotSimulated, fake_gpt
from lockstep.runtime.group import Runtime

# the trackers' categories (MemTracker's and FSDPMemTracker's names) -> the plan's parts
PARTS = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Buffer": "buffers",
    "Unsharded Param": "gathered parameters",
    "All Gather": "gathered parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporary",
    "Other": "temporary",
}
ORDER = (
    "parameters",
    "buffers",
    "gradients",
    "ddp buckets",
    "optimizer",
    "gathered parameters",
    "activations",
    "temporary",
)


@dataclass
class RankSim:
    """What one rank holds: its parameters' shards, and its memory at an optimizer step's peak."""

    rank: int
    coords: tuple[int, int, int]  # (pp stage, dp rank, tp rank)
    params: int  # elements of this rank's parameter shards
    trainable: int
    full_params: int  # the whole model's elements
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # name -> (full shape, local shape)
    flops_per_token: float  # the whole model's training FLOPs per token
    shape: ModelShape
    memory: dict[str, int] = field(default_factory=dict)  # part -> bytes at the peak
    estimated: str = ""  # why memory is lockstep.plan.formula's estimate, not a simulated step
    notes: list[str] = field(default_factory=list)  # what the plan assumed about the model

    @property
    def peak(self) -> int:
        return sum(self.memory.values())


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """The default process group as `rank` of `world_size` on torch's fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is initialized already: plan in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch's warnings about a step it runs on fake tensors, off: ModTracker's about a recomputed
    block's module, FSDP2's about a view its root returns, DTensor's about a 2-D gradient norm's two
    all-reduces. A plan prints its own findings; `train` still shows these where they apply."""
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        redistribute.setLevel(level)


def fake_runtime(layout: Layout, rank: int, gpus_per_node: int) -> Runtime:
    local = min(gpus_per_node, layout.world_size)
    return Runtime(
        rank=rank,
        local_rank=rank % local,
        world_size=layout.world_size,
        local_world_size=local,
        node_rank=rank // local,
        device=torch.device("cpu"),  # fake tensors' device; the profile says what the real one is
        backend="fake",
        launcher="plan",
        hostname=f"node{rank // local}",
    )


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def shard_facts(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {n: (tuple(p.shape), tuple(_local(p).shape)) for n, p in model.named_parameters()}


def simulate_rank(
    cfg: Config, layout: Layout, plan: BatchPlan, rank: int, *, gpus_per_node: int = 8, step=True
) -> RankSim:
    """Rank `rank` of `layout`: its shards, and (with `step`) its memory over one optimizer step of
    `plan`'s micro-batches in cfg.train.mixed_precision ('no' or 'bf16'/'fp16' autocast)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lockstep.plan.formula import formula_memory
    from lockstep.plan.hf_models import nf4_saving

    with fake_world(layout.world_size, rank), _quiet():
        rt = fake_runtime(layout, rank, gpus_per_node)
        # shards alone need no step: the meta device is ~10x cheaper per op than fake tensors (FSDP2
        # cuts each parameter into dp chunks: ~7 s at dp 1024 fake, under 1 s on meta)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake if step else torch.device("meta"):
            built = build_fake_model(cfg)
        full = sum(p.numel() for p in built.model.parameters())
        autocast = _autocast(cfg.train.mixed_precision)
        pipeline = apply_parallelism(
            built.model,
            layout,
            rt,
            cfg.parallel,
            mixed_precision=cfg.train.mixed_precision,
            autocast=autocast,
            grad_accum=plan.grad_accum,
            uses_all_parameters=built.uses_all_parameters,
        )
        model = built.model
        sim = RankSim(
            rank=rank,
            coords=layout.coords(rank),
            params=sum(_local(p).numel() for p in model.parameters()),
            trainable=sum(_local(p).numel() for p in model.parameters() if p.requires_grad),
            full_params=full,
            shards=shard_facts(model),
            flops_per_token=built.flops_per_token,
            shape=built.shape,
            notes=list(built.notes),
        )
        if step:
            try:
                sim.memory = _step_memory(cfg, layout, plan, rt, built, pipeline, fake)
            except _not_on_fake_tensors() as e:
                sim.estimated = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                sim.memory = formula_memory(
                    model,
                    built.shape,
                    plan.micro_batch,
                    act_bytes=_compute_bytes(cfg, built),
                    checkpointing=cfg.model.gradient_checkpointing,
                    data_parallel=layout.data_parallel,
                    dp=layout.dp,
                )
            if built.base_4bit:
                sim.memory["parameters"] -= nf4_saving(model)
                sim.notes.append("4-bit base: frozen Linear weights counted at NF4's 4.127 bits")
        return sim


def build_fake_model(cfg: Config) -> FakeModel:
    """Under an active FakeTensorMode (or the meta device): cfg's model, its loss and batches."""
    if cfg.model.kind == "hf":
        from lockstep.plan.hf_models import fake_hf_model

        return fake_hf_model(cfg)
    if cfg.model.kind != "gpt":
        raise ConfigError(
            f"lockstep plan builds model.kind = 'gpt' and 'hf' models, not {cfg.model.kind!r}: a "
            "custom factory's model and batch come from your code, which a plan cannot run without "
            "your data"
        )
    return fake_gpt(cfg)


def _not_on_fake_tensors() -> tuple[type[Exception], ...]:
    """What a step raises when fake tensors cannot run it (a layout's errors are not caught)."""
    from torch._subclasses import fake_tensor as ft

    return (
        NotSimulated,
        ft.DataDependentOutputException,
        ft.DynamicOutputShapeException,
        ft.UnsupportedOperatorException,
        ft.UnsupportedFakeTensorException,
    )


def _compute_bytes(cfg: Config, built) -> int:
    if cfg.train.mixed_precision in ("bf16", "fp16"):
        return 2
    return built.dtype.itemsize


def _autocast(mixed_precision: str) -> contextlib.AbstractContextManager:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()


def _step_memory(cfg, layout, plan, rt, built, pipeline, fake) -> dict[str, int]:
    """Bytes per part at the peak of an optimizer step, AdamW's state made first.

    AdamW is fused as the run's (lockstep.optim), but on DTensor parameters (FSDP, TP), where it
    runs one tensor at a time (_adamw). The tracker is the inner mode: it sees each op before the
    fake mode computes it."""
    from lockstep.plan.trackers import step_tracker

    model = built.model
    with fake:
        if layout.tp > 1:
            _warm_sharding_cache(cfg, plan, rt, built, pipeline)
        optimizer = _adamw(cfg, model)
        tracker = step_tracker(model, optimizer, fsdp=layout.data_parallel == "fsdp")
        with tracker:
            _first_adamw_step(model, optimizer)
            if pipeline is not None:
                _stage_step(cfg, plan, built, pipeline, optimizer, tracker)
            else:
                _data_parallel_step(cfg, plan, rt, built, optimizer, tracker)
        peak = tracker.get_tracker_snapshot("peak")
    parts = dict.fromkeys(ORDER, 0)
    for snap in peak.values():
        for kind, size in snap.items():
            if kind != "Total":
                parts[PARTS[str(getattr(kind, "value", kind))]] += size
    grads = sum(_local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if layout.dp > 1 and layout.pp > 1:
        # a stage's replicas average their gradients through one flat copy of them after the
        # backward (lockstep.parallel.pp): a moment of its own, counted where it is the peak
        after = sum(parts[k] for k in ("parameters", "buffers", "optimizer")) + 2 * grads
        parts["temporary"] += max(0, after - sum(parts.values()))
    elif layout.dp > 1 and layout.data_parallel == "ddp":
        # gradient_as_bucket_view: the gradients are views of buckets DDP holds from its start
        parts["ddp buckets"] = grads
        parts["gradients"] = 0
    return parts


def _warm_sharding_cache(cfg, plan, rt, built, pipeline) -> None:
    """The tracked step's ops once before it, untracked, with a spare AdamW. DTensor's sharding
    propagation runs each op once on fake tensors of its global shape and then reads a cache:
    tracked, that first time counts as memory no real step holds (GPT-2 124M on TP 2, micro 2:
    1,831 MiB in a process's first simulation, 1,720 in every later one; the real ranks 1,758)."""
    model = built.model
    spare = _adamw(cfg, model)
    _first_adamw_step(model, spare)
    if pipeline is not None:
        _stage_step(cfg, plan, built, pipeline, spare, _Untracked())
    else:
        _data_parallel_step(cfg, plan, rt, built, spare, _Untracked())
    spare.zero_grad(set_to_none=True)


class _Untracked:
    def reset_mod_stats(self) -> None:
        pass


def _adamw(cfg, model: nn.Module):
    """The run's AdamW: fused, as lockstep.optim makes it (it updates each element in place: no
    temporaries). On DTensor parameters one tensor at a time instead (a denominator of the
    tensor's size at a time: up to twice its largest shard over fused), as the fused CPU kernel on
    fake DTensors was tracked at 1.9 GiB of state for a GPT-2 124M shard of 15 MiB (fake tensors
    only: on real ones fused and foreach both held 59 MiB, FSDP over 16 ranks)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return build_optimizer(model, cfg.optim, 1e-4, "cpu")
    optimizer = build_optimizer(model, cfg.optim, 1e-4, "fake")
    for group in optimizer.param_groups:
        group["foreach"] = False
    return optimizer


def _first_adamw_step(model: nn.Module, optimizer) -> None:
    """AdamW's state as a first step makes it (and a step's moment of gradients, state and
    parameters together), without that step's forward and backward."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _data_parallel_step(cfg, plan, rt, built, optimizer, tracker) -> None:
    """lockstep.train.step.train_step as the trainer runs it, with two micro-batches where the run
    accumulates: the second's backward runs beside the first's whole gradients (FSDP's unsharded
    ones too), which is the peak of an accumulating step (one micro-batch alone read GPT-2 124M's
    real peak 13% low, bench/bench_plan.py). The trackers take one forward of a module per step:
    each micro-batch starts their module stats afresh (the peak stays)."""
    from lockstep.parallel.ddp import LossModule
    from lockstep.train.step import train_step

    loss_module = LossModule(built.model, built.loss)

    # a function, so no no_sync: train_step uses FSDP's, as for a LossModule
    def each_micro_batch(batch, divisor=None):
        tracker.reset_mod_stats()
        return loss_module(batch, divisor)

    micro = min(plan.grad_accum, 2)
    train_step(
        each_micro_batch,
        built.model,
        optimizer,
        [built.batch(plan.micro_batch) for _ in range(micro)],
        rt,
        grad_accum=micro,
        autocast=_autocast(cfg.train.mixed_precision),
        clip_norm=cfg.optim.gradient_clip_norm,
        loss=built.loss,
    )


def _stage_step(cfg, plan, built, pipeline, optimizer, tracker) -> None:
    """A pipeline stage's step as its schedule holds memory: GPipe runs every micro-batch's forward
    before the backwards, 1F1B at most (stages - stage index) at once (torch's Schedule1F1B
    warm-up). Run by hand on the stage torch.distributed.pipelining would run: the schedule's
    P2P shape exchange would receive a fake group's garbage. One micro-batch at a time, as the
    schedule runs them (one forward of all of them held each op's temporaries for all: GPT-2 124M's
    stages read 7-11% over the real ones, bench/bench_plan.py); each starts the trackers' module
    stats afresh (they take one forward of a module per step; the peak stays)."""
    from lockstep.models.gpt import lm_loss

    stage, module = pipeline.stage, pipeline.stage.submod
    if cfg.parallel.pipeline_schedule == "gpipe":
        in_flight = plan.grad_accum
    else:
        in_flight = min(plan.grad_accum, stage.num_stages - stage.stage_index)
    held = []
    for _ in range(in_flight):
        tracker.reset_mod_stats()
        x, y = built.batch(plan.micro_batch)
        if not stage.is_first:
            x = torch.empty((*x.shape, cfg.model.hidden_size), requires_grad=True)
        held.append((module(x), y))
    while held:  # each micro-batch's output let go after its backward, as the schedule does
        out, y = held.pop(0)
        if stage.is_last:
            lm_loss(out, y).backward()
        else:
            out.backward(torch.empty_like(out))
        del out, y
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
