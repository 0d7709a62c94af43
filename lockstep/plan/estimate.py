"""A step's time on a device profile: compute, each collective's bytes and time, what compute does
not hide, tokens/s and MFU. Pure arithmetic on the plan's facts (a test feeds it numbers).

The model of it, chosen here:

- compute: the model's training FLOPs per token (lockstep.models.gpt.GPT.flops_per_token: 6N plus
  attention) x the step's tokens, split over dp x tp x pp ranks, at the profile's dense peak x its
  compute_efficiency (without autocast, half that peak: TF32's dense rate); activation
  checkpointing runs each forward twice (8/6 of the FLOPs). A
  pipeline's bubble stretches it by (m + p - 1) / m for m micro-batches on p stages (GPipe and 1F1B
  alike; Narayanan et al. 2021).
- bytes per rank, ring algorithms: an all-reduce of B bytes sends 2(W-1)/W x B from each rank, an
  all-gather or reduce-scatter of a whole of B bytes (W-1)/W x B.
  DDP: one all-reduce of the gradients per step (grad_compression bf16/fp16: half; powersgd is
  not modelled). FSDP: an all-gather of the parameters in the compute dtype per micro-batch's
  forward and again in its backward when parameters are resharded after forward, one
  reduce-scatter of the trainable parameters' float32 gradients per step (per micro-batch with
  parallel.fsdp_reduce_every_micro_batch). TP: two all-reduces of
  (micro, seq, hidden) activations per block in forward and two in backward, per micro-batch.
  PP: each micro-batch's hidden states forward and their gradient back across each stage boundary.
- latency: each collective launched costs the profile's collective_latency_us besides its bytes
  (DDP: one per 25 MiB bucket, parallel.bucket_cap_mb; FSDP: one all-gather per unit, a block or
  the root, per gather, one reduce-scatter per unit; TP: each all-reduce; PP: each send).
- links: TP's ranks are neighbours (lockstep.parallel.mesh), inside a node while tp <= the node's
  devices; a data-parallel group spans nodes once dp x tp does, a pipeline once the world does.
  Inside a node the profile's intra_node_gbs, across nodes its inter_node_gbs (one NIC per
  device: a ring across nodes runs at a NIC's rate), each x link_efficiency.
- overlap: DDP's all-reduce and FSDP's reduce-scatter run during the last micro-batch's backward
  (two thirds of its compute; each micro-batch's, where each reduce-scatters); FSDP's all-gathers
  are prefetched under each micro-batch's compute;
  TP's all-reduces sit on the critical path (no async TP here); PP's sends are counted whole, and
  so is the all-reduce of a pipeline stage's replicas (after the schedule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lockstep.parallel.mesh import BatchPlan, Layout
from lockstep.plan.profiles import DeviceProfile


@dataclass
class Collective:
    name: str  # "all_reduce (gradients)", ...
    group: str  # "dp 8 across nodes", ...
    bytes: float  # sent by each rank per optimizer step
    seconds: float
    exposed: float  # what compute does not hide
    launches: int = 1  # collectives of this kind a step starts (each costs the profile's latency)


@dataclass
class StepEstimate:
    compute_s: float
    bubble_s: float
    collectives: list[Collective] = field(default_factory=list)
    tokens_per_step: int = 0
    model_flops_per_step: float = 0.0
    world_size: int = 1
    peak_flops: float = 1.0

    @property
    def exposed_s(self) -> float:
        return sum(c.exposed for c in self.collectives)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / (self.step_s * self.world_size * self.peak_flops)


@dataclass(frozen=True)
class ModelFacts:
    flops_per_token: float
    seq: int
    hidden: int
    layers: int
    trainable_local: int  # elements of this rank's trainable shards
    params_tp_local: int  # elements of one tp rank's (or the whole) model, before FSDP shards it
    trainable_tp_local: int  # of them trainable (all but a frozen base's, under LoRA)
    tied_embedding: int  # elements of the embedding a pipeline's first and last stage share


def estimate_step(
    model: ModelFacts,
    layout: Layout,
    plan: BatchPlan,
    profile: DeviceProfile,
    *,
    gpus_per_node: int,
    compute_bytes: int,  # 2 under bf16/fp16 autocast, else 4
    settings: dict,  # parallel.* and model.gradient_checkpointing values that change the step
) -> StepEstimate:
    m, mb = plan.grad_accum, plan.micro_batch
    tokens = plan.global_batch * model.seq
    peak = profile.bf16_tflops * 1e12 if compute_bytes == 2 else profile.bf16_tflops * 1e12 / 2
    recompute = 8 / 6 if settings.get("gradient_checkpointing") else 1.0
    per_rank = model.flops_per_token * tokens / (layout.dp * layout.tp * layout.pp)
    compute = per_rank * recompute / (peak * profile.compute_efficiency)
    bubble = compute * (layout.pp - 1) / m if layout.pp > 1 else 0.0
    per_micro = compute / m
    est = StepEstimate(
        compute_s=compute,
        bubble_s=bubble,
        tokens_per_step=tokens,
        model_flops_per_step=model.flops_per_token * tokens,
        world_size=layout.world_size,
        peak_flops=peak,
    )

    def link(span: int) -> tuple[float, str]:
        inside = span <= gpus_per_node
        gbs = profile.intra_node_gbs if inside else profile.inter_node_gbs
        return gbs * 1e9 * profile.link_efficiency, "in a node" if inside else "across nodes"

    def add(name: str, ranks: int, span: int, sent: float, hidden_by: float, launches: int) -> None:
        bw, where = link(span)
        seconds = sent / bw + launches * profile.collective_latency_us * 1e-6
        exposed = max(0.0, seconds - hidden_by)
        est.collectives.append(
            Collective(name, f"{ranks} ranks {where}", sent, seconds, exposed, launches)
        )

    dp, tp, pp = layout.dp, layout.tp, layout.pp
    activation = mb * model.seq * model.hidden
    if dp > 1 and layout.data_parallel == "ddp":
        grad = model.trainable_local * (
            2 if settings.get("grad_compression") in ("bf16", "fp16") else 4
        )
        # DDP overlaps its buckets with the last backward; a pipeline stage's replicas average
        # their gradients after the schedule (lockstep.parallel.pp): nothing hides it
        hidden = 0.0 if pp > 1 else 2 / 3 * per_micro
        buckets = 1 if pp > 1 else math.ceil(grad / (settings.get("bucket_cap_mb", 25.0) * 2**20))
        add("all_reduce (gradients)", dp, dp * tp, 2 * (dp - 1) / dp * grad, hidden, buckets)
    if dp > 1 and layout.data_parallel == "fsdp":
        gathers = 2 if settings.get("fsdp_reshard_after_forward", True) else 1
        whole = model.params_tp_local * compute_bytes
        sent = (dp - 1) / dp * whole * gathers * m
        units = model.layers // pp + 1  # lockstep.parallel.fsdp: each block, and the root
        add("all_gather (parameters)", dp, dp * tp, sent, compute, units * gathers * m)
        grads = model.trainable_tp_local * 4
        reduces = m if settings.get("fsdp_reduce_every_micro_batch") else 1
        scatter = (dp - 1) / dp * grads * reduces
        hidden = reduces * 2 / 3 * per_micro
        add("reduce_scatter (gradients)", dp, dp * tp, scatter, hidden, units * reduces)
    if tp > 1:
        launches = 4 * model.layers // pp * m
        sent = 2 * (tp - 1) / tp * activation * compute_bytes * launches
        add("all_reduce (activations)", tp, tp, sent, 0.0, launches)
    if pp > 1:
        sent = 2 * activation * 4 * m + model.tied_embedding * 4 * 2 / pp
        add("send/recv (stage boundary)", pp, layout.world_size, sent, 0.0, 2 * m)
    return est
