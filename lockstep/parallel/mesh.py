"""How the world splits into data, tensor and pipeline parallel groups, checked before anything starts.

    world_size = pipeline_parallel x data_parallel x tensor_parallel

Ranks are laid out pp-outermost, tp-innermost (torchtitan's order): tensor-parallel peers, which
talk every layer, get neighbouring ranks (the same node); pipeline stages, which pass one
activation per micro-batch, are the furthest apart.

    world 4, tp 2:  dp 0 = ranks [0 1]   dp 1 = ranks [2 3]   (each pair splits every layer)
    world 4, pp 2:  stage 0 = ranks [0 1]   stage 1 = ranks [2 3]   (dp replicas 0, 1 in each stage)

The data sampler splits each global batch by *data-parallel* rank: tensor and pipeline peers
read the same samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lockstep.config import Config, ModelConfig, ParallelConfig, TrainConfig
from lockstep.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp: int  # data-parallel replicas (each holds the model once, sharded or not)
    tp: int  # tensor-parallel degree
    pp: int  # pipeline stages
    data_parallel: str = "ddp"  # ddp | fsdp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp stage, dp rank, tp rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    @property
    def sharded_checkpoints(self) -> bool:
        """Checkpoints are written by every rank (torch.distributed.checkpoint) when no rank holds all weights."""
        return self.data_parallel == "fsdp" or self.tp > 1 or self.pp > 1

    def describe(self) -> str:
        return f"dp {self.dp} ({self.data_parallel}) x tp {self.tp} x pp {self.pp} = world {self.world_size}"


def resolve_layout(parallel: ParallelConfig, model: ModelConfig, world_size: int) -> Layout:
    """The layout for `world_size` ranks, or a ConfigError that shows the arithmetic and the fix."""
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    if world_size % (tp * pp):
        raise ConfigError(
            f"world_size({world_size}) is not divisible by tensor_parallel({tp}) x pipeline_parallel({pp}) = "
            f"{tp * pp}; use a world size that is a multiple of {tp * pp}, or lower the degrees"
        )
    if (tp > 1 or pp > 1) and model.kind != "gpt":
        raise ConfigError(
            f"parallel.tensor_parallel = {tp}, pipeline_parallel = {pp}: tensor and pipeline parallelism are "
            f"implemented for the built-in GPT, not model.kind = {model.kind!r}; for large Hugging Face models "
            "use parallel.data_parallel: fsdp"
        )
    if tp > 1 and model.attention_heads % tp:
        raise ConfigError(
            f"model.attention_heads ({model.attention_heads}) is not divisible by parallel.tensor_parallel ({tp}): "
            f"each rank must hold whole heads; pick a degree that divides {model.attention_heads}"
        )
    if pp > model.layers:
        raise ConfigError(
            f"parallel.pipeline_parallel ({pp}) exceeds model.layers ({model.layers}): each stage needs at least "
            f"one block; use at most {model.layers} stages"
        )
    dp = world_size // (tp * pp)
    if pp > 1 and dp > 1 and parallel.data_parallel == "fsdp":
        raise ConfigError(
            f"pipeline_parallel({pp}) on world_size({world_size}) leaves dp = {dp} replicas per "
            "stage, and parallel.data_parallel: fsdp does not shard pipeline stages yet; use "
            "parallel.data_parallel: ddp (each stage replicated, its gradients averaged once a "
            "step)"
        )
    if tp > 1 and dp > 1 and pp == 1 and parallel.data_parallel != "fsdp":
        raise ConfigError(
            f"tensor_parallel({tp}) on world_size({world_size}) leaves dp = {dp} replicas; combining them needs "
            "parallel.data_parallel: fsdp (DDP does not take tensor-parallel parameters)"
        )
    # with one data-parallel replica there is nothing to shard across: fsdp would only add overhead
    return Layout(world_size, dp, tp, pp, parallel.data_parallel if dp > 1 else "ddp")


def build_mesh(layout: Layout, device_type: str):
    """The (pp, dp, tp) DeviceMesh, or None when plain DDP (or one process) needs none."""
    if layout.tp == 1 and layout.pp == 1 and layout.data_parallel == "ddp":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp")
    )


def check_layout(cfg: Config, world_size: int) -> Layout:
    """Every layout and batch rule for `world_size` ranks, before any process starts (launchers call this)."""
    layout = resolve_layout(cfg.parallel, cfg.model, world_size)
    plan = resolve_batch(cfg.train, layout.dp)
    if layout.pp > 1 and cfg.parallel.pipeline_schedule == "1f1b" and plan.grad_accum < layout.pp:
        raise ConfigError(
            f"the 1f1b schedule needs at least as many micro-batches as stages: grad_accum({plan.grad_accum}) < "
            f"pipeline_parallel({layout.pp}) (global batch {plan.global_batch} = dp {layout.dp} x micro_batch "
            f"{plan.micro_batch} x grad_accum {plan.grad_accum}); set train.grad_accum to >= {layout.pp} or use "
            "parallel.pipeline_schedule: gpipe"
        )
    if layout.dp > 1 and layout.data_parallel == "ddp":
        from lockstep.parallel.ddp_check import check_static_graph

        check_static_graph(cfg.parallel, plan.grad_accum)
    if cfg.parallel.grad_compression != "none":
        # imported here: compression pulls in torch.distributed's DDP hooks, which a launcher
        # does not need
        from lockstep.parallel.compression import check_compression

        lay = layout
        check_compression(cfg.parallel, lay.describe(), lay.data_parallel, lay.tp, lay.pp)
    return layout


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch splits: global = world_size x micro_batch x grad_accum."""

    global_batch: int
    world_size: int
    micro_batch: int
    grad_accum: int


def resolve_batch(train: TrainConfig, world_size: int) -> BatchPlan:
    """Derive micro-batch and accumulation from the global batch; explain any arithmetic that fails."""
    g, mb, acc = train.batch_size, train.micro_batch_size, train.grad_accum
    # per-device batch given (the TTS team's way): the global batch follows the world size
    if g is None:
        if mb is None:
            raise ConfigError("train.batch_size and train.micro_batch_size are both unset; set one")
        return BatchPlan(world_size * mb * (acc or 1), world_size, mb, acc or 1)
    if mb is not None and acc is not None:
        if world_size * mb * acc != g:
            raise ConfigError(
                f"train.batch_size {g} != world_size({world_size}) x micro_batch_size({mb}) x grad_accum({acc}) "
                f"= {world_size * mb * acc}; set train.batch_size to {world_size * mb * acc} or drop one of the two"
            )
        return BatchPlan(g, world_size, mb, acc)
    if mb is None and acc is None:
        acc = 1
    per = world_size * (mb if mb is not None else acc)
    label = f"micro_batch_size({mb})" if mb is not None else f"grad_accum({acc})"
    if g % per:
        raise ConfigError(
            f"global batch {g} is not divisible by world_size({world_size}) x {label} = {per}; "
            f"set train.batch_size to a multiple of {per}"
        )
    if mb is not None:
        return BatchPlan(g, world_size, mb, g // per)
    return BatchPlan(g, world_size, g // per, acc)


def plan_world_sizes(
    cfg: Config, world_sizes: list[int]
) -> tuple[dict[str, int | None], dict[int, BatchPlan]]:
    """The batch settings that hold at every world size an elastic job may run at, and the plan at each.

    The global batch (samples per optimizer step) and the micro-batch (what fits on a device) are fixed at
    the largest world's; a smaller world makes up the difference with more accumulation steps, so a run
    that loses a node trains on the same samples per step. Returns (config overrides for the workers:
    train.batch_size, micro_batch_size, grad_accum) and {world size: BatchPlan}; a ConfigError names the
    world sizes the batch cannot be split over and a global batch that every one of them divides.
    """
    largest = max(world_sizes)
    try:
        top = resolve_batch(cfg.train, check_layout(cfg, largest).dp)
    except ConfigError as e:
        raise ConfigError(
            f"at {largest} ranks, the largest world size this job may run at: {e}"
        ) from None
    overrides: dict[str, int | None] = {
        "train.batch_size": top.global_batch,
        "train.micro_batch_size": top.micro_batch,
        "train.grad_accum": None,
    }
    fixed = replace(
        cfg,
        train=replace(
            cfg.train,
            batch_size=top.global_batch,
            micro_batch_size=top.micro_batch,
            grad_accum=None,
        ),
    )
    plans, failed = {}, []
    for world in sorted(world_sizes, reverse=True):
        try:
            plans[world] = resolve_batch(fixed.train, check_layout(fixed, world).dp)
        except ConfigError as e:
            failed.append((world, str(e)))
    if failed:
        units = [
            top.micro_batch * resolve_layout(cfg.parallel, cfg.model, w).dp
            for w in world_sizes
            if w % (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel) == 0
        ]
        fits = math.lcm(*units) if units else None
        lines = [f"at {world} ranks: {why}" for world, why in failed]
        raise ConfigError(
            f"global batch {top.global_batch} (micro-batch {top.micro_batch}, fixed at the largest world size, "
            f"{largest}) cannot be kept at every world size this job may run at ({', '.join(map(str, world_sizes))}):\n"
            + "\n".join(lines)
            + "\n"
            + (f"set train.batch_size to a multiple of {fits}, " if fits else "")
            + "or narrow --nnodes MIN:MAX to the world sizes that work: "
            + (", ".join(str(w) for w in sorted(plans)) or "none of them")
        )
    return overrides, plans


def describe_plans(plans: dict[int, BatchPlan]) -> list[str]:
    """One line per world size: `16 ranks: global batch 64 = 16 x micro-batch 4 x 1 accumulation step`."""
    return [
        f"{w} rank{'s' if w > 1 else ''}: global batch {p.global_batch} = {p.world_size} replica"
        f"{'s' if p.world_size > 1 else ''} x micro-batch "
        f"{p.micro_batch} x {p.grad_accum} accumulation step{'s' if p.grad_accum > 1 else ''}"
        for w, p in sorted(plans.items(), reverse=True)
    ]
