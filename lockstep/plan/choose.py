"""The layouts a plan compares (--choose), and the fixes a plan that does not fit names.

    candidates(cfg, world, gpus_per_node)   the settings lockstep can train this model with at this
                                            world size: DDP, FSDP2 (resharding after forward or
                                            not); for the built-in GPT, TP degrees within a
                                            node (FSDP beside), PP stages (DDP replicas
                                            beside, or TP within a node inside); each with and
                                            without activation checkpointing; the global batch
                                            kept
    choose(...)                             every candidate planned; those that fit, fastest first
    fixes(...)                              for a plan that does not fit: what would, with its peak

A candidate's micro-batch is the config's, halved (accumulating more) until it fits or reaches 1.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from lockstep.config import Config
from lockstep.errors import ConfigError
from lockstep.parallel.mesh import check_layout, resolve_batch
from lockstep.plan.build import Plan, make_plan
from lockstep.plan.profiles import DeviceProfile


def _with(cfg: Config, **sets) -> Config:
    out = copy.deepcopy(cfg)
    for key, value in sets.items():
        section, name = key.split("__")
        setattr(getattr(out, section), name, value)
    return out


def candidates(cfg: Config, world: int, gpus_per_node: int) -> Iterator[Config]:
    heads, layers = cfg.model.attention_heads, cfg.model.layers
    shapes = [("ddp", 1, 1, True), ("fsdp", 1, 1, True), ("fsdp", 1, 1, False)]
    if cfg.model.kind == "gpt":  # lockstep's TP and PP shard the built-in GPT only
        tps = [t for t in (2, 4, 8) if heads % t == 0 and world % t == 0 and t <= gpus_per_node]
        shapes += [("fsdp", t, 1, True) for t in tps]
        pps = sorted({p for p in (2, 4, 8, 16, world) if 1 < p <= layers and world % p == 0})
        shapes += [("ddp", 1, p, True) for p in pps]  # replicas of each stage where world > p
        shapes += [("ddp", t, world // t, True) for t in tps if world // t in pps]
    for dp_mode, tp, pp, reshard in shapes:
        for ac in (False, True):
            yield _with(
                cfg,
                parallel__data_parallel=dp_mode,
                parallel__tensor_parallel=tp,
                parallel__pipeline_parallel=pp,
                parallel__fsdp_reshard_after_forward=reshard,
                model__gradient_checkpointing=ac,
            )


def _fitting(cfg: Config, world, gpus_per_node, profile) -> Plan:
    """cfg's plan, its micro-batch halved (global batch kept) until it fits or is 1."""
    plan = make_plan(cfg, world, gpus_per_node, profile, other=False)
    while not plan.fits and plan.batch.micro_batch > 1:
        smaller = _with(
            cfg,
            train__batch_size=plan.batch.global_batch,
            train__micro_batch_size=plan.batch.micro_batch // 2,
            train__grad_accum=None,
        )
        try:
            check_layout(smaller, world)
            resolve_batch(smaller.train, plan.layout.dp)
        except ConfigError:
            break
        cfg, plan = smaller, make_plan(smaller, world, gpus_per_node, profile, other=False)
    return plan


def choose(
    cfg: Config, world: int, gpus_per_node: int, profile: DeviceProfile
) -> tuple[list[Plan], list[str]]:
    """Every candidate's plan, and why lockstep refuses the others (its layout checks' words)."""
    plans, refused = [], []
    for c in candidates(cfg, world, gpus_per_node):
        try:
            plans.append(_fitting(c, world, gpus_per_node, profile))
        except ConfigError as e:
            refused.append(str(e))
    return plans, sorted(set(refused))


def fixes(plan: Plan) -> list[str]:
    """Settings that bring a plan that does not fit under its device's memory, with its peak."""
    cfg, world, gpn, profile = plan.cfg, plan.layout.world_size, plan.gpus_per_node, plan.profile
    tries = []
    if plan.layout.dp > 1 and plan.layout.data_parallel == "ddp":
        tries.append(("parallel.data_parallel=fsdp", _with(cfg, parallel__data_parallel="fsdp")))
    fsdp = plan.layout.dp > 1 and plan.layout.data_parallel == "fsdp"
    if fsdp and plan.batch.grad_accum > 1 and not cfg.parallel.fsdp_reduce_every_micro_batch:
        every = _with(cfg, parallel__fsdp_reduce_every_micro_batch=True)
        tries.append(("parallel.fsdp_reduce_every_micro_batch=true", every))
    if not cfg.model.gradient_checkpointing:
        tries.append(
            (
                "model.gradient_checkpointing=true",
                _with(cfg, model__gradient_checkpointing=True),
            )
        )
    if plan.batch.micro_batch > 1:
        half = plan.batch.micro_batch // 2
        tries.append(
            (
                f"train.micro_batch_size={half} (the global batch kept)",
                _with(
                    cfg,
                    train__batch_size=plan.batch.global_batch,
                    train__micro_batch_size=half,
                    train__grad_accum=None,
                ),
            )
        )
    out = []
    for what, c in tries:
        try:
            p = make_plan(c, world, gpn, profile, other=False)
        except ConfigError:
            continue
        out.append(
            f"{what}: peak {p.peak / 2**30:.2f} GiB{' (fits)' if p.fits else ' (still too much)'}"
        )
    return out
