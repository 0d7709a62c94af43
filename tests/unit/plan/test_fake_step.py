"""lockstep.plan.fake_step: one optimizer step on fake tensors, its memory by part at the peak:
an accumulating step's second micro-batch beside the first's gradients, a TP step the same every
time, a pipeline stage's micro-batches in flight, a stage's replicas' gradient copy."""

from __future__ import annotations

from lockstep.parallel.mesh import check_layout, resolve_batch
from lockstep.plan.simulate import simulate_rank

from .test_simulate import config


def test_an_accumulating_step_s_peak_holds_every_gradient_and_tp_s_is_the_same_every_time():
    """A second micro-batch's backward runs beside the first's whole gradients (one micro-batch
    alone read GPT-2 124M's real peak 13% low, bench/bench_plan.py); and a TP rank's plan does not
    depend on what the process simulated before (DTensor's sharding cache, warmed first)."""
    one, two = (config("ddp", 1, 1, micro=4, accum=a) for a in (1, 2))
    one.model.layers = two.model.layers = 2
    layout = check_layout(one, 1)
    alone = simulate_rank(one, layout, resolve_batch(one.train, 1), 0)
    accumulating = simulate_rank(two, layout, resolve_batch(two.train, 1), 0)
    assert accumulating.memory["gradients"] == accumulating.full_params * 4  # float32, all of them
    assert accumulating.memory["gradients"] > alone.memory["gradients"]
    # a shape no other test simulates: its first simulation in this process, then a second
    cfg = config("ddp", 2, 1, micro=2, accum=2)
    cfg.model.hidden_size, cfg.model.attention_heads, cfg.model.layers = 72, 6, 2
    layout = check_layout(cfg, 2)
    first, again = (simulate_rank(cfg, layout, resolve_batch(cfg.train, 1), 0) for _ in range(2))
    assert first.memory == again.memory and first.peak > 0


def test_a_pipeline_stage_holds_its_micro_batches_in_flight():
    """1F1B's first stage keeps `stages` micro-batches of activations, its last one; GPipe every
    micro-batch of the step on each stage. The peak comes in the first backward, once its
    gradients exist: the held micro-batches' activations, less part of the first one's."""

    def activations(schedule: str, rank: int) -> int:
        cfg = config("ddp", 1, 4, micro=2, accum=8)
        cfg.parallel.pipeline_schedule = schedule
        layout = check_layout(cfg, 4)
        return simulate_rank(cfg, layout, resolve_batch(cfg.train, 1), rank).memory["activations"]

    first, last = activations("1f1b", 0), activations("1f1b", 3)
    gpipe_middle, one_f1b_middle = activations("gpipe", 1), activations("1f1b", 1)
    assert 8 / 3 <= gpipe_middle / one_f1b_middle <= 7 / 2  # 8 held against 3
    assert first > 2 * one_f1b_middle / 3 > 0 and last > 0


def test_a_stage_with_replicas_holds_its_gradients_and_their_average_s_copy():
    """2 stages x 4 replicas: no DDP buckets (the replicas average their gradients through one flat
    copy after the backward, lockstep.parallel.pp), and the peak has room for that moment."""
    cfg = config("ddp", 1, 2, micro=2, accum=2)
    layout = check_layout(cfg, 8)
    sim = simulate_rank(cfg, layout, resolve_batch(cfg.train, layout.dp), 0)
    m = sim.memory
    grads = sim.params * 4  # float32, every parameter trainable
    assert m["ddp buckets"] == 0
    # parameters, AdamW's state, the gradients and their copy: more than the backward's peak here
    assert sim.peak == m["parameters"] + m["buffers"] + m["optimizer"] + 2 * grads > 0
