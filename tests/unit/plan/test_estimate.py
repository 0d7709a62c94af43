"""lockstep.plan.estimate: a step's compute, bytes per collective and exposed time, by hand."""

from __future__ import annotations

import dataclasses

import pytest

from lockstep.parallel.mesh import BatchPlan, Layout
from lockstep.plan.estimate import ModelFacts, estimate_step
from lockstep.plan.profiles import DeviceProfile

# round numbers: 1e12 FLOP/s at efficiency 1, links of 1 GB/s at efficiency 1
DEVICE = DeviceProfile("test", 80, 1.0, 100.0, 1.0, compute_efficiency=1.0, link_efficiency=1.0)
MODEL = ModelFacts(
    flops_per_token=6e6,
    seq=100,
    hidden=10,
    layers=4,
    trainable_local=1_000_000,
    params_tp_local=1_000_000,
    trainable_tp_local=1_000_000,
    tied_embedding=1000,
)


def est(layout: Layout, accum: int = 1, gpus: int = 8, **settings):
    plan = BatchPlan(layout.dp * 2 * accum, layout.dp, 2, accum)
    return estimate_step(
        MODEL, layout, plan, DEVICE, gpus_per_node=gpus, compute_bytes=2, settings=settings
    )


def test_ddp_sends_its_gradients_twice_over_a_ring_and_hides_them_behind_the_backward():
    e = est(Layout(8, 8, 1, 1), accum=1)
    # 16 samples x 100 tokens x 6e6 FLOPs over 8 ranks at 1e12 FLOP/s
    assert e.compute_s == pytest.approx(16 * 100 * 6e6 / 8 / 1e12)
    (ar,) = e.collectives
    assert ar.name == "all_reduce (gradients)" and ar.group == "8 ranks in a node"
    assert ar.bytes == pytest.approx(2 * 7 / 8 * 4e6)
    assert ar.seconds == pytest.approx(ar.bytes / 100e9)  # 100 GB/s in a node
    assert ar.exposed == 0.0  # 70 us of link under 0.8 ms of backward
    slow = est(Layout(16, 16, 1, 1), gpus=8)  # two nodes: the NIC's 1 GB/s
    assert slow.collectives[0].group == "16 ranks across nodes"
    assert slow.collectives[0].exposed == pytest.approx(
        slow.collectives[0].seconds - 2 / 3 * slow.compute_s
    )
    assert slow.step_s == pytest.approx(slow.compute_s + slow.collectives[0].exposed)
    assert est(Layout(8, 8, 1, 1), grad_compression="bf16").collectives[0].bytes == ar.bytes / 2


def test_fsdp_gathers_parameters_per_micro_batch_and_scatters_gradients_once():
    e = est(Layout(8, 8, 1, 1, "fsdp"), accum=3)
    gather, scatter = e.collectives
    assert gather.bytes == pytest.approx(7 / 8 * 2e6 * 2 * 3)  # bf16, forward + backward, 3 micro
    assert scatter.bytes == pytest.approx(7 / 8 * 4e6)  # float32 gradients, once
    kept = est(Layout(8, 8, 1, 1, "fsdp"), accum=3, fsdp_reshard_after_forward=False)
    assert kept.collectives[0].bytes == pytest.approx(gather.bytes / 2)
    # parallel.fsdp_reduce_every_micro_batch: a reduce-scatter per micro-batch, each hidden by its
    # own micro-batch's backward
    every = est(Layout(8, 8, 1, 1, "fsdp"), accum=3, fsdp_reduce_every_micro_batch=True)
    assert every.collectives[1].bytes == pytest.approx(3 * scatter.bytes)
    assert every.collectives[1].launches == 3 * scatter.launches == 3 * (4 + 1)  # blocks, root
    assert every.collectives[1].exposed == 0.0
    # LoRA: the whole (frozen) base gathered, the adapters' gradients alone scattered
    lora = dataclasses.replace(MODEL, trainable_local=1_000, trainable_tp_local=8_000)
    plan = BatchPlan(8 * 2 * 3, 8, 2, 3)
    gather, scatter = estimate_step(
        lora, Layout(8, 8, 1, 1, "fsdp"), plan, DEVICE, gpus_per_node=8, compute_bytes=2,
        settings={},
    ).collectives  # fmt: skip
    assert gather.bytes == pytest.approx(7 / 8 * 2e6 * 2 * 3)
    assert scatter.bytes == pytest.approx(7 / 8 * 8_000 * 4)


def test_tensor_parallel_all_reduces_activations_on_the_critical_path():
    e = est(Layout(2, 1, 2, 1), accum=2)
    (ar,) = e.collectives
    # 2 ranks: 2 x 1/2 x (2 x 100 x 10 activations x 2 bytes) x 4 per block x 4 blocks x 2 micro
    assert ar.bytes == pytest.approx(2 * 0.5 * 4000 * 4 * 4 * 2)
    assert ar.exposed == ar.seconds and e.compute_s == pytest.approx(2 * 2 * 100 * 6e6 / 2 / 1e12)


def test_a_pipeline_s_bubble_is_stages_minus_one_micro_batches():
    e = est(Layout(4, 1, 1, 4), accum=8)
    assert e.bubble_s == pytest.approx(e.compute_s * 3 / 8)
    assert e.collectives[0].name == "send/recv (stage boundary)"
    assert e.tokens_per_s == pytest.approx(e.tokens_per_step / e.step_s)
    assert e.mfu == pytest.approx(6e6 * e.tokens_per_step / (e.step_s * 4 * 1e12))
    assert e.mfu < 1.0
    # 2 stages of 2 replicas: their gradients' average comes after the schedule, all of it exposed
    replicas = est(Layout(4, 2, 1, 2), accum=8)
    ar = next(c for c in replicas.collectives if c.name == "all_reduce (gradients)")
    assert ar.seconds > 0 and ar.exposed == ar.seconds


def test_checkpointing_recomputes_the_forward_and_fp32_runs_at_half_the_peak():
    base = est(Layout(8, 8, 1, 1))
    assert est(Layout(8, 8, 1, 1), gradient_checkpointing=True).compute_s == pytest.approx(
        base.compute_s * 8 / 6
    )
    plan = BatchPlan(16, 8, 2, 1)
    fp32 = estimate_step(
        MODEL, Layout(8, 8, 1, 1), plan, DEVICE, gpus_per_node=8, compute_bytes=4, settings={}
    )
    assert fp32.compute_s == pytest.approx(2 * base.compute_s)


def test_each_collective_launched_costs_the_profile_s_latency():
    slow = dataclasses.replace(DEVICE, collective_latency_us=100.0)
    plan = BatchPlan(8, 2, 2, 2)

    def on(layout: Layout, **settings):
        return estimate_step(
            MODEL, layout, plan, slow, gpus_per_node=8, compute_bytes=2, settings=settings
        ).collectives

    (ar,) = on(Layout(2, 1, 2, 1))  # TP: 4 all-reduces a block, 4 blocks, 2 micro-batches
    assert ar.launches == 32
    assert ar.seconds == pytest.approx(ar.bytes / 100e9 + 32 * 100e-6) and ar.exposed == ar.seconds
    gather, scatter = on(Layout(2, 2, 1, 1, "fsdp"))  # 4 blocks and the root, gathered twice
    assert (gather.launches, scatter.launches) == (5 * 2 * 2, 5)
    # DDP: one all-reduce per bucket; 4 MB of gradients in 1 MiB buckets
    (buckets,) = on(Layout(2, 2, 1, 1), bucket_cap_mb=1.0)
    assert buckets.launches == 4
    assert buckets.seconds == pytest.approx(buckets.bytes / 100e9 + 4 * 100e-6)
    send = next(c for c in on(Layout(2, 1, 1, 2)) if c.name.startswith("send"))
    assert send.launches == 4  # each micro-batch's activations forward and gradient back
