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
or crash on fails here the same way. lockstep.plan.fake_step runs one optimizer step on it
(lockstep.train.step's train_step, or a stage's micro-batches as its schedule holds them), and
torch's own memory trackers (torch.distributed._tools.MemTracker, and FSDPMemTracker under FSDP)
sort every tensor it makes into parameters, gradients, optimizer state, activations and
temporaries, and keep the breakdown at the peak. The parallel code runs
outside the fake mode (DeviceMesh holds a real tensor of its ranks); the fake parameters carry
their mode with them.

Two things are counted by hand, as the trackers cannot see them: DDP's gradient buckets (lockstep
wraps the model in DDP with gradient_as_bucket_view: the gradients live in its buckets, one
gradient's worth, from its first backward on, zeroed in place between steps by
lockstep.train.step), and the runtime's own reserve (CUDA context,
NCCL buffers, the allocator's slack: lockstep.plan.profiles). A step that fake tensors cannot run
(a data-dependent shape in the model's forward, or no batch shape for its task) falls back to
lockstep.plan.formula's estimate from the same shards, and the RankSim says why (`estimated`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lockstep.config import Config
from lockstep.errors import ConfigError
from lockstep.parallel.apply import apply_parallelism
from lockstep.parallel.mesh import BatchPlan, Layout
from lockstep.plan.fake_step import autocast_for, local_tensor, step_memory
from lockstep.plan.models import FakeModel, ModelShape, NotSimulated, fake_gpt
from lockstep.runtime.group import Runtime


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
    """The default process group as `rank` of `world_size` on torch's fake backend. The process's
    excepthook is its own again afterwards: init_process_group wraps it to prefix "[rankN]: " to
    each line of a traceback, once per group, so a plan's simulated ranks piled up prefixes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is initialized already: plan in a process of its own")
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


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


def shard_facts(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {n: (tuple(p.shape), tuple(local_tensor(p).shape)) for n, p in model.named_parameters()}


def simulate_rank(
    cfg: Config,
    layout: Layout,
    plan: BatchPlan,
    rank: int,
    *,
    gpus_per_node: int = 8,
    step: bool = True,
    formula: bool = False,
) -> RankSim:
    """Rank `rank` of `layout`: its shards, and (with `step`) its memory over one optimizer step of
    `plan`'s micro-batches in cfg.train.mixed_precision ('no' or 'bf16'/'fp16' autocast); with
    `formula`, lockstep.plan.formula's estimate even where the step would run (bench/
    bench_plan_hf.py checks both against real runs)."""
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
        built.model.train()  # as lockstep.train.setup.build_trainee trains it
        full = sum(p.numel() for p in built.model.parameters())
        autocast = autocast_for(cfg.train.mixed_precision)
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
            params=sum(local_tensor(p).numel() for p in model.parameters()),
            trainable=sum(local_tensor(p).numel() for p in model.parameters() if p.requires_grad),
            full_params=full,
            shards=shard_facts(model),
            flops_per_token=built.flops_per_token,
            shape=built.shape,
            notes=list(built.notes),
        )
        if step:
            try:
                if formula:
                    raise NotSimulated("the formula, as asked")
                sim.memory = step_memory(cfg, layout, plan, rt, built, pipeline, fake)
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
                    accumulating=plan.grad_accum > 1,
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
