"""A plan: a config's layout at a world size, checked as `train` checks it, each kind of rank
simulated (lockstep.plan.simulate), and its step estimated on a device profile.

    make_plan(cfg, world_size, gpus_per_node, profile) -> Plan   (each config simulated once a
                                                                 process: --choose, fixes)

The ranks simulated: the first of each pipeline stage (data-parallel rank 0, tensor-parallel rank
0), which holds the largest FSDP shards (torch cuts dim 0 in equal chunks, the last ones shorter or
empty); every other rank of a stage holds as much or less.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from lockstep.config import Config, dump_config
from lockstep.parallel.mesh import BatchPlan, Layout, check_layout, resolve_batch
from lockstep.plan.estimate import ModelFacts, StepEstimate, estimate_step
from lockstep.plan.profiles import DeviceProfile
from lockstep.plan.simulate import RankSim, simulate_rank


@dataclass
class Plan:
    cfg: Config
    layout: Layout
    batch: BatchPlan
    profile: DeviceProfile
    gpus_per_node: int
    ranks: list[RankSim]  # one per pipeline stage
    other_checkpointing: list[RankSim]  # the same ranks with model.gradient_checkpointing flipped
    estimate: StepEstimate

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def fits(self) -> bool:
        return self.peak <= self.profile.usable_bytes

    def settings(self) -> str:
        """The config values that make this layout, as --set flags."""
        c = self.cfg
        sets = [
            f"parallel.data_parallel={self.layout.data_parallel}",
            f"parallel.tensor_parallel={self.layout.tp}",
            f"parallel.pipeline_parallel={self.layout.pp}",
            f"train.micro_batch_size={self.batch.micro_batch}",
            f"model.gradient_checkpointing={str(c.model.gradient_checkpointing).lower()}",
        ]
        if self.layout.data_parallel == "fsdp":
            sets.append(
                f"parallel.fsdp_reshard_after_forward="
                f"{str(c.parallel.fsdp_reshard_after_forward).lower()}"
            )
            if c.parallel.fsdp_reduce_every_micro_batch:
                sets.append("parallel.fsdp_reduce_every_micro_batch=true")
        return " ".join(f"--set {s}" for s in sets)


def make_plan(
    cfg: Config, world_size: int, gpus_per_node: int, profile: DeviceProfile, other: bool = True
) -> Plan:
    """cfg's layout at `world_size` (a ConfigError as `train` raises it when it cannot work);
    `other`: also with activation checkpointing flipped."""
    layout = check_layout(cfg, world_size)
    batch = resolve_batch(cfg.train, layout.dp)
    stages = [s * layout.dp * layout.tp for s in range(layout.pp)]
    ranks = [_simulated(cfg, layout, batch, r, gpus_per_node) for r in stages]
    flips = []
    if other:
        flipped = copy.deepcopy(cfg)
        flipped.model.gradient_checkpointing = not cfg.model.gradient_checkpointing
        flips = [_simulated(flipped, layout, batch, r, gpus_per_node) for r in stages]
    return Plan(
        cfg=cfg,
        layout=layout,
        batch=batch,
        profile=profile,
        gpus_per_node=gpus_per_node,
        ranks=ranks,
        other_checkpointing=flips,
        estimate=_estimate(cfg, layout, batch, profile, gpus_per_node, ranks[0]),
    )


# this process's simulations, by config: --choose and the fixes of a plan that does not fit plan
# configs the first plan (or its checkpointing twin) simulated already
_SIMULATED: dict[tuple, RankSim] = {}


def _simulated(cfg: Config, layout: Layout, batch: BatchPlan, rank: int, gpus: int) -> RankSim:
    # whether the length was set too: a Higgs model's context is its own unless it was
    own_length = "model.max_seq_length" in cfg.set_keys
    key = (dump_config(cfg), own_length, layout.world_size, rank, gpus)
    if key not in _SIMULATED:
        if len(_SIMULATED) >= 256:
            _SIMULATED.clear()
        _SIMULATED[key] = simulate_rank(cfg, layout, batch, rank, gpus_per_node=gpus)
    return _SIMULATED[key]


def _estimate(cfg, layout, batch, profile, gpus_per_node, first: RankSim) -> StepEstimate:
    shape = first.shape
    fsdp_dp = layout.dp if layout.data_parallel == "fsdp" else 1
    facts = ModelFacts(
        flops_per_token=first.flops_per_token,
        seq=shape.tokens_per_sample,
        hidden=shape.hidden,
        layers=shape.layers,
        trainable_local=first.trainable,
        params_tp_local=first.params * fsdp_dp,
        trainable_tp_local=first.trainable * fsdp_dp,
        tied_embedding=shape.tied_embedding,
    )
    settings = {
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "grad_compression": cfg.parallel.grad_compression,
        "fsdp_reshard_after_forward": cfg.parallel.fsdp_reshard_after_forward,
        "fsdp_reduce_every_micro_batch": cfg.parallel.fsdp_reduce_every_micro_batch,
        "bucket_cap_mb": cfg.parallel.bucket_cap_mb,
    }
    compute_bytes = 2 if cfg.train.mixed_precision in ("bf16", "fp16") else 4
    return estimate_step(
        facts,
        layout,
        batch,
        profile,
        gpus_per_node=gpus_per_node,
        compute_bytes=compute_bytes,
        settings=settings,
    )
