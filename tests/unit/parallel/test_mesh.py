"""Layout arithmetic: which combinations of world size, dp, tp and pp are accepted, and the errors for the rest."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import run_main

from lockstep.config import Config, ModelConfig, ParallelConfig
from lockstep.errors import ConfigError
from lockstep.parallel.mesh import BatchPlan, describe_plans, plan_world_sizes, resolve_layout


def _layout(world, tp=1, pp=1, dp="ddp", heads=4, layers=4, kind="gpt"):
    return resolve_layout(
        ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp),
        ModelConfig(kind=kind, attention_heads=heads, layers=layers),
        world,
    )


def test_layouts_and_rank_coordinates():
    lay = _layout(4, tp=2, dp="fsdp")
    assert (lay.dp, lay.tp, lay.pp, lay.data_parallel) == (2, 2, 1, "fsdp")
    # tp innermost
    assert [lay.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    lay = _layout(2, pp=2)
    assert [lay.coords(r) for r in range(2)] == [(0, 0, 0), (1, 0, 0)]
    # 2 stages of 2 replicas, and 2 stages of 2 tensor-parallel peers: pp outermost, tp innermost
    lay = _layout(4, pp=2)
    assert (lay.dp, lay.pp) == (2, 2) and lay.sharded_checkpoints
    assert [lay.coords(r) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    lay = _layout(8, tp=2, pp=2)
    assert (lay.dp, lay.tp, lay.pp, lay.data_parallel) == (2, 2, 2, "ddp")
    assert lay.coords(5) == (1, 0, 1)
    assert _layout(1, dp="fsdp").data_parallel == "ddp"  # one replica: nothing to shard across
    assert _layout(2, dp="fsdp").sharded_checkpoints and not _layout(2).sharded_checkpoints


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (
            {"world": 6, "tp": 4},
            "world_size(6) is not divisible by tensor_parallel(4) x pipeline_parallel(1) = 4",
        ),
        (
            {"world": 2, "tp": 2, "heads": 3},
            "model.attention_heads (3) is not divisible by parallel.tensor_parallel (2)",
        ),
        (
            {"world": 8, "pp": 8, "layers": 4},
            "parallel.pipeline_parallel (8) exceeds model.layers (4)",
        ),
        ({"world": 4, "tp": 2}, "needs parallel.data_parallel: fsdp"),
        (
            {"world": 4, "pp": 2, "dp": "fsdp"},
            "parallel.data_parallel: fsdp does not shard pipeline stages yet; use "
            "parallel.data_parallel: ddp",
        ),
        ({"world": 2, "tp": 2, "kind": "hf"}, "use parallel.data_parallel: fsdp"),
    ],
)
def test_invalid_layouts_show_the_arithmetic(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        _layout(**kwargs)
    assert needle in str(e.value), str(e.value)


def test_1f1b_needs_as_many_micro_batches_as_stages_and_launchers_check_before_starting(capsys):
    from lockstep.cli import main
    from lockstep.config import load_config
    from lockstep.parallel.mesh import check_layout

    cfg = load_config(overrides={"parallel.pipeline_parallel": 2, "train.batch_size": 8})
    with pytest.raises(ConfigError) as e:
        check_layout(cfg, 2)
    assert "grad_accum(1) < pipeline_parallel(2)" in str(e.value) and "gpipe" in str(e.value)
    assert (
        check_layout(
            load_config(overrides={"parallel.pipeline_parallel": 2, "train.grad_accum": 2}), 2
        ).pp
        == 2
    )
    assert main(["train", "--world-size", "2", "--set", "parallel.pipeline_parallel=2"]) == 2
    assert "grad_accum(1) < pipeline_parallel(2)" in capsys.readouterr().err


def test_compression_without_a_ddp_all_reduce_is_refused_with_the_layout_rules(
    tmp_path, corpus, capsys
):
    from lockstep.cli import main
    from lockstep.config import load_config
    from lockstep.parallel.mesh import check_layout

    sets = {"parallel.grad_compression": "powersgd", "parallel.data_parallel": "fsdp"}
    with pytest.raises(ConfigError) as e:
        check_layout(load_config(overrides=sets), 2)
    assert str(e.value) == (
        "parallel.grad_compression = 'powersgd' compresses DDP's gradient all-reduce, and this "
        "run's layout is dp 2 (fsdp) x tp 1 x pp 1 = world 2: FSDP reduce-scatters gradient "
        "shards inside its own hooks, which DDP's communication hooks cannot reach. Use "
        "data_parallel: ddp with tensor_parallel 1 and pipeline_parallel 1, or set "
        "parallel.grad_compression: none"
    )
    # one process has no replica to shard across (the layout is ddp) and no all-reduce: nothing
    # to refuse
    assert check_layout(load_config(overrides=sets), 1).data_parallel == "ddp"
    assert check_layout(load_config(overrides={"parallel.grad_compression": "powersgd"}), 2).dp == 2
    run = tmp_path / "run"
    args = [
        "train",
        "--world-size",
        "2",
        "--data",
        str(corpus),
        "--output-dir",
        str(run),
        "--set",
        "parallel.grad_compression=powersgd",
        "--set",
        "parallel.data_parallel=fsdp",
    ]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert "FSDP reduce-scatters gradient shards" in err and len(err.strip().splitlines()) == 1, err
    assert (
        "parallel.grad_compression = 'powersgd' compresses DDP's gradient all-reduce, and this "
        "run's layout is dp 2 (fsdp) x tp 1 x pp 1 = world 2: FSDP reduce-scatters gradient "
        "shards"
    ) in err and "Traceback" not in err
    assert "set parallel.grad_compression: none" in err and "starting 2 workers" not in out
    # refused before the run directory gets a log or a checkpoint
    assert not (run / "logs").exists() and not (run / "checkpoints").exists()


def test_a_global_batch_the_world_cannot_split_is_refused_by_the_cli(capsys):
    code, out, err = run_main(
        capsys, "train", "--world-size", "4", "--global-batch-size", "30", "--micro-batch-size", "2"
    )
    assert code == 2 and "Traceback" not in err, err
    assert "starting 2 workers" not in out, "workers were started before the input was checked"
    assert (
        "global batch 30 is not divisible by world_size(4) x micro_batch_size(2) = 8; "
        "set train.batch_size to a multiple of 8" in err
    )


def _cfg(**train) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def test_an_elastic_job_keeps_global_batch_and_micro_batch_and_raises_accumulation():
    overrides, plans = plan_world_sizes(_cfg(batch_size=64), [8, 16])
    assert overrides == {
        "train.batch_size": 64,
        "train.micro_batch_size": 4,
        "train.grad_accum": None,
    }
    assert plans == {16: BatchPlan(64, 16, 4, 1), 8: BatchPlan(64, 8, 4, 2)}
    assert describe_plans(plans) == [
        "16 ranks: global batch 64 = 16 replicas x micro-batch 4 x 1 accumulation step",
        "8 ranks: global batch 64 = 8 replicas x micro-batch 4 x 2 accumulation steps",
    ]
    # the per-device way (HF's): the global batch is the largest world's, fixed from then on
    overrides, plans = plan_world_sizes(
        _cfg(batch_size=None, micro_batch_size=2, grad_accum=3), [1, 2]
    )
    assert overrides["train.batch_size"] == 12 and plans[1] == BatchPlan(12, 1, 2, 6)


def test_an_elastic_job_whose_batch_a_world_size_cannot_split_is_refused_with_the_batches_that_work():
    with pytest.raises(ConfigError) as info:
        plan_world_sizes(_cfg(batch_size=48), [8, 16, 24])
    assert str(info.value) == (
        "global batch 48 (micro-batch 2, fixed at the largest world size, 24) cannot be kept at every world size "
        "this job may run at (8, 16, 24):\n"
        "at 16 ranks: global batch 48 is not divisible by world_size(16) x micro_batch_size(2) = 32; set "
        "train.batch_size to a multiple of 32\n"
        "set train.batch_size to a multiple of 96, or narrow --nnodes MIN:MAX to the world sizes that work: 8, 24"
    )
    with pytest.raises(
        ConfigError,
        match=r"^at 3 ranks, the largest world size this job may run at: global batch 32 "
        r"is not divisible by world_size\(3\)",
    ):
        plan_world_sizes(_cfg(batch_size=32), [2, 3])
