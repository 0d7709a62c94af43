"""lockstep.plan.build: a plan simulates the first rank of every pipeline stage, with activation
checkpointing flipped beside it, and estimates its step."""

from __future__ import annotations

from lockstep.config import load_config
from lockstep.plan.build import make_plan
from lockstep.plan.profiles import load_profile

H100 = load_profile("h100-80gb")


def config(**sets):
    base = {
        "model.hidden_size": 64,
        "model.attention_heads": 4,
        "model.layers": 4,
        "model.max_seq_length": 32,
        "train.batch_size": 16,
        "train.micro_batch_size": 2,
        "train.mixed_precision": "bf16",
    }
    return load_config(None, {**base, **sets})


def test_each_stage_s_first_rank_is_planned_with_and_without_checkpointing():
    plan = make_plan(config(**{"parallel.pipeline_parallel": 2, "model.layers": 8}), 2, 8, H100)
    assert [r.rank for r in plan.ranks] == [0, 1]
    assert [r.coords[0] for r in plan.ranks] == [0, 1]
    assert [r.rank for r in plan.other_checkpointing] == [0, 1]
    # recomputing the blocks keeps their inputs, and one block's activations at a time in backward
    # (4 blocks a stage here; with one block a stage it would save nothing)
    ac = plan.other_checkpointing
    assert all(a.memory["activations"] < r.memory["activations"] for a, r in zip(ac, plan.ranks))
    assert plan.peak == max(r.peak for r in plan.ranks) and plan.fits
    assert plan.estimate.bubble_s > 0 and plan.estimate.world_size == 2
    assert "--set parallel.pipeline_parallel=2" in plan.settings()


def test_without_the_flipped_run_and_with_fsdp_s_settings():
    plan = make_plan(config(**{"parallel.data_parallel": "fsdp"}), 8, 4, H100, other=False)
    assert plan.other_checkpointing == [] and len(plan.ranks) == 1
    assert [c.name for c in plan.estimate.collectives] == [
        "all_gather (parameters)",
        "reduce_scatter (gradients)",
    ]
    assert plan.estimate.collectives[0].group == "8 ranks across nodes"  # 4 devices a node
    assert plan.settings().endswith("--set parallel.fsdp_reshard_after_forward=true")
    assert plan.estimate.tokens_per_step == 16 * 32


def test_fsdp_reducing_every_micro_batch_holds_a_shard_of_the_gradients():
    """Two micro-batches over 4 ranks: no reduce-scatter before the last holds the whole model's
    gradients between them; reduce-scattering each (parallel.fsdp_reduce_every_micro_batch) holds
    a quarter."""
    once = make_plan(config(**{"parallel.data_parallel": "fsdp"}), 4, 4, H100, other=False)
    sets = {"parallel.data_parallel": "fsdp", "parallel.fsdp_reduce_every_micro_batch": True}
    every = make_plan(config(**sets), 4, 4, H100, other=False)
    assert once.batch.grad_accum == every.batch.grad_accum == 2
    shard, whole = every.ranks[0].trainable * 4, every.ranks[0].full_params * 4
    assert every.ranks[0].memory["gradients"] == shard
    # the peak falls by the whole model's float32 gradients less this rank's shard of them
    assert once.peak - every.peak == whole - shard > 0
    assert every.settings().endswith("--set parallel.fsdp_reduce_every_micro_batch=true")
    scatters = [c.launches for c in (once, every) for c in c.estimate.collectives][1::2]
    assert scatters == [5, 10]  # 4 blocks and the root, once a step / each micro-batch


def test_a_config_is_simulated_once_per_process():
    """--choose and a refused plan's fixes plan configs the first plan simulated already: the same
    config is the same simulation; another value, or a length set where it was not, is not."""
    cfg = config(**{"parallel.data_parallel": "fsdp"})
    first = make_plan(cfg, 4, 4, H100)
    again = make_plan(config(**{"parallel.data_parallel": "fsdp"}), 4, 4, H100, other=False)
    assert again.ranks[0] is first.ranks[0]
    flipped = config(**{"parallel.data_parallel": "fsdp", "model.gradient_checkpointing": True})
    assert make_plan(flipped, 4, 4, H100, other=False).ranks[0] is first.other_checkpointing[0]
    other = make_plan(config(**{"parallel.data_parallel": "fsdp"}), 8, 4, H100, other=False)
    assert other.ranks[0] is not first.ranks[0] and other.ranks[0].params < first.ranks[0].params
    cfg.set_keys.discard("model.max_seq_length")
    assert make_plan(cfg, 4, 4, H100, other=False).ranks[0] is not first.ranks[0]
