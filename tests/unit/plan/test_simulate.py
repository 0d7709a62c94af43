"""lockstep.plan.simulate: one rank of worlds of 8 to 1,024 ranks on torch's fake process group, the
real parallel code applied to a tiny GPT on fake tensors: every layout's shard shapes against the
arithmetic of DDP (whole), FSDP2 (dim 0 in equal chunks) and TP (Megatron's splits), the data cut
of an epoch, the batch plan, and the memory of a step by part."""

from __future__ import annotations

import math
import sys

import pytest
import torch.distributed as dist

from lockstep.config import load_config
from lockstep.data.sampler import epoch_permutation, rank_micro_batches, steps_per_epoch
from lockstep.errors import ConfigError
from lockstep.parallel.mesh import check_layout, resolve_batch
from lockstep.parallel.pp import stage_layers
from lockstep.plan.fake_step import ORDER
from lockstep.plan.simulate import build_fake_model, fake_world, simulate_rank

# 8 heads and 8 layers: TP up to 8, PP up to 8 stages
MODEL = {
    "model.hidden_size": 64,
    "model.attention_heads": 8,
    "model.layers": 8,
    "model.max_seq_length": 16,
    "model.vocab_size": 256,
}
# (data_parallel, tensor_parallel, pipeline_parallel): layouts lockstep trains (mesh.resolve_layout)
LAYOUTS = [
    ("ddp", 1, 1),
    ("fsdp", 1, 1),
    ("fsdp", 2, 1),
    ("fsdp", 8, 1),
    ("ddp", 1, 8),
    ("ddp", 1, 2),  # 2 stages, world / 2 replicas of each
    ("ddp", 2, 2),  # 2 stages, TP 2 inside each, world / 4 replicas
]
COLUMN = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias")
ROW = ("attn.proj.weight", "mlp.proj.weight")


def config(dp: str, tp: int, pp: int, micro: int = 2, accum: int = 8):
    return load_config(
        None,
        {
            **MODEL,
            "parallel.data_parallel": dp,
            "parallel.tensor_parallel": tp,
            "parallel.pipeline_parallel": pp,
            "train.batch_size": None,
            "train.micro_batch_size": micro,
            "train.grad_accum": accum,
            "train.mixed_precision": "no",
        },
    )


def tp_shape(name: str, full: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """A parameter's shape on one tensor-parallel rank (lockstep.parallel.tp)."""
    if name.endswith(COLUMN):
        return (full[0] // tp, *full[1:])
    if name.endswith(ROW):
        return (full[0], full[1] // tp)
    return full


def fsdp_rows(rows: int, dp: int, dp_rank: int) -> int:
    """torch.chunk's cut of dim 0, as FSDP2 shards: ceil(rows / dp) each, the last ones short."""
    each = math.ceil(rows / dp)
    return max(0, min(each, rows - dp_rank * each))


@pytest.mark.parametrize("world", [8, 64, 512, 1024])
def test_every_layout_shards_as_its_arithmetic_says_at_world(world):
    for dp_mode, tp, pp in LAYOUTS:
        cfg = config(dp_mode, tp, pp)
        layout = check_layout(cfg, world)
        plan = resolve_batch(cfg.train, layout.dp)
        assert plan.global_batch == layout.dp * plan.micro_batch * plan.grad_accum
        assert (layout.dp, layout.tp, layout.pp) == (world // (tp * pp), tp, pp)
        # the first and the last rank: FSDP's short and empty shards are the last ones'
        for rank in (0, world - 1):
            sim = simulate_rank(cfg, layout, plan, rank, step=False)
            stage, dp_rank, tp_rank = layout.coords(rank)
            assert sim.coords == (stage, dp_rank, tp_rank)
            for name, (full, local) in sim.shards.items():
                want = tp_shape(name, full, tp)
                if layout.data_parallel == "fsdp":
                    want = (fsdp_rows(want[0], layout.dp, dp_rank), *want[1:])
                assert local == want, (world, dp_mode, tp, pp, rank, name, full, local)
            if pp > 1:  # the stage's blocks, and the embedding or the head at the ends
                blocks = {n.split(".")[1] for n in sim.shards if n.startswith("blocks.")}
                assert blocks == {str(b) for b in stage_layers(8, pp)[stage]}
                assert ("tok_emb.weight" in sim.shards) == (stage == 0)
                assert ("head.weight" in sim.shards) == (stage == pp - 1)
            else:
                assert sim.full_params == sum(math.prod(f) for f, _ in sim.shards.values())
        assert not dist.is_initialized()


@pytest.mark.parametrize("world", [8, 64, 512, 1024])
def test_every_sample_of_an_epoch_is_read_once_across_the_data_parallel_ranks(world):
    for dp_mode, tp, pp in LAYOUTS:
        cfg = config(dp_mode, tp, pp, micro=1, accum=8)
        layout = check_layout(cfg, world)
        plan = resolve_batch(cfg.train, layout.dp)
        samples = 4 * plan.global_batch - 1  # three steps, and a tail the epoch drops
        order = epoch_permutation(samples, 0, 0)
        read = []
        for step in range(steps_per_epoch(samples, plan.global_batch)):
            indices = order[step * plan.global_batch : (step + 1) * plan.global_batch]
            for dp_rank in range(layout.dp):  # tensor and pipeline peers read their dp rank's
                read += [i for mb in rank_micro_batches(indices, plan, dp_rank) for i in mb]
        assert sorted(read) == sorted(order[: 3 * plan.global_batch].tolist())
        assert len(set(read)) == len(read) == 3 * plan.global_batch


def test_a_step_s_memory_by_part_follows_the_layout():
    """One optimizer step of a tiny GPT at 8 ranks: DDP holds every parameter, its gradients in
    DDP's buckets and AdamW's two moments; FSDP an eighth of them, and gathers the rest for a
    moment; tensor parallelism splits the blocks' matrices."""
    sims = {}
    for dp_mode, tp in (("ddp", 1), ("fsdp", 1), ("fsdp", 2)):
        cfg = config(dp_mode, tp, 1, micro=2, accum=2)
        layout = check_layout(cfg, 8)
        sims[dp_mode, tp] = simulate_rank(cfg, layout, resolve_batch(cfg.train, layout.dp), 0)
    ddp, fsdp, fsdp_tp = sims["ddp", 1], sims["fsdp", 1], sims["fsdp", 2]
    assert set(ddp.memory) == set(ORDER)
    whole = ddp.full_params * 4  # float32
    assert ddp.memory["parameters"] == whole == ddp.memory["ddp buckets"]
    # AdamW's two moments and a float32 step count per parameter; at the optimizer's peak, one
    # tensor's temporaries too (it updates one parameter at a time; the largest is 256 x 64)
    state = 2 * whole + 4 * len(ddp.shards)
    assert 0 <= ddp.memory["optimizer"] - state <= 3 * 256 * 64 * 4
    assert ddp.memory["gradients"] == 0
    assert ddp.memory["activations"] > 0 and fsdp.memory["activations"] > 0
    assert fsdp.memory["parameters"] == fsdp.params * 4 < whole / 7
    state = 2 * fsdp.params * 4 + 4 * len(fsdp.shards)
    assert 0 <= fsdp.memory["optimizer"] - state <= 3 * 256 * 64 * 4
    assert fsdp.memory["ddp buckets"] == 0 < fsdp.memory["gathered parameters"]
    assert fsdp_tp.params > fsdp.params  # its dp group is 4 ranks: a quarter of half a block each
    assert ddp.peak > fsdp.peak == sum(fsdp.memory.values())


def test_a_layout_train_refuses_is_refused_with_train_s_message():
    with pytest.raises(ConfigError, match=r"model.attention_heads \(8\) is not divisible by"):
        check_layout(config("fsdp", 3, 1), 6)
    with pytest.raises(ConfigError, match=r"exceeds model.layers \(8\)"):
        check_layout(config("ddp", 1, 16), 16)


def test_the_fake_world_is_gone_after_an_error():
    hook = sys.excepthook
    with pytest.raises(ZeroDivisionError):
        with fake_world(1024, 1023):
            assert (dist.get_world_size(), dist.get_rank()) == (1024, 1023)
            1 / 0
    assert not dist.is_initialized()
    with fake_world(8, 0):
        assert sys.excepthook is not hook  # torch's, prefixing "[rank0]: " to a traceback
        with pytest.raises(RuntimeError, match="a process group is initialized already"):
            with fake_world(8, 1):
                pass
        assert dist.get_rank() == 0
    assert sys.excepthook is hook  # a plan's process is no rank: its tracebacks are unprefixed


def test_a_custom_factory_s_model_is_refused_saying_why():
    cfg = config("ddp", 1, 1)
    cfg.model.kind = "custom"
    with pytest.raises(
        ConfigError, match="builds model.kind = 'gpt' and 'hf' models, not 'custom'"
    ):
        build_fake_model(cfg)
