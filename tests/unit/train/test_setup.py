"""lockstep/train/setup.py: the step count of a run and its refusal; the layout's refusals; everything the builders
make for a tiny GPT on one process (the layout, the workload, the Trainee, its Batches); compiled training."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch
from conftest import one_process

from lockstep.config import ModelConfig, ParallelConfig, TrainConfig
from lockstep.data.sampler import Cursor
from lockstep.errors import ConfigError, DataError
from lockstep.parallel.ddp import LossModule
from lockstep.parallel.mesh import BatchPlan
from lockstep.runtime import Runtime
from lockstep.train.setup import (
    build_batches,
    build_layout,
    build_layout_and_workload,
    build_trainee,
    count_steps,
)

from .tiny import tiny_config

LOG = logging.getLogger("test.train.setup")  # propagates to the root logger: caplog sees it
PLAN = BatchPlan(global_batch=8, world_size=1, micro_batch=8, grad_accum=1)


def test_count_steps_takes_max_steps_or_epochs_whichever_ends_first():
    # 100 samples, global batch 8: 12 whole steps per epoch (the tail of 4 is dropped)
    assert count_steps(TrainConfig(max_steps=1000, epochs=None), 100, PLAN) == 1000
    assert count_steps(TrainConfig(max_steps=None, epochs=2), 100, PLAN) == 24
    assert count_steps(TrainConfig(max_steps=None, epochs=0.5), 100, PLAN) == 6
    # a started step counts: ceil(13.2)
    assert count_steps(TrainConfig(max_steps=None, epochs=1.1), 100, PLAN) == 14
    assert count_steps(TrainConfig(max_steps=10, epochs=2), 100, PLAN) == 10
    assert count_steps(TrainConfig(max_steps=100, epochs=2), 100, PLAN) == 24
    assert count_steps(TrainConfig(max_steps=5), 8, PLAN) == 5  # exactly one global batch is enough


def test_count_steps_refuses_a_corpus_smaller_than_one_global_batch():
    with pytest.raises(DataError) as e:
        count_steps(TrainConfig(max_steps=10), 7, PLAN)
    assert str(e.value) == (
        "the corpus has 7 training windows, fewer than one global batch of 8; use more data, a "
        "smaller train.batch_size or a shorter model.max_seq_length"
    )


def two_ranks() -> Runtime:
    """Rank 0 of 2 as a value: build_layout reads the world size and the device, and joins no group."""
    return Runtime(0, 0, 2, 2, 0, torch.device("cpu"), "gloo", "test", "h")


def test_build_layout_refuses_check_grads_where_gradients_are_sharded():
    gpt = ModelConfig(hidden_size=32, attention_heads=2, layers=2)
    for parallel, layout in (
        (ParallelConfig(data_parallel="fsdp", check_grads=True), "dp 2 (fsdp) x tp 1 x pp 1"),
        (ParallelConfig(tensor_parallel=2, check_grads=True), "dp 1 (ddp) x tp 2 x pp 1"),
    ):
        with pytest.raises(ConfigError) as e:
            build_layout(parallel, gpt, "no", two_ranks())
        assert str(e.value) == (
            f"parallel.check_grads compares whole gradients across data-parallel replicas; with "
            f"{layout} = world 2 they are sharded: use it with data_parallel: ddp, tp 1, pp 1"
        )
    layout = build_layout(ParallelConfig(check_grads=True), gpt, "no", two_ranks())
    assert (
        layout.describe() == "dp 2 (ddp) x tp 1 x pp 1 = world 2" and not layout.sharded_checkpoints
    )
    # fsdp without check_grads is fine; fp16 on a CPU is not (no loss scaling there)
    assert build_layout(
        ParallelConfig(data_parallel="fsdp"), gpt, "no", two_ranks()
    ).sharded_checkpoints
    with pytest.raises(
        ConfigError, match=r"train.mixed_precision = 'fp16' needs a CUDA device \(GradScaler\)"
    ):
        build_layout(ParallelConfig(), gpt, "fp16", one_process())


def test_build_layout_refuses_grad_compression_where_ddp_does_not_all_reduce():
    gpt = ModelConfig(hidden_size=32, attention_heads=2, layers=2)
    for parallel, layout in (
        (
            ParallelConfig(data_parallel="fsdp", grad_compression="powersgd"),
            "dp 2 (fsdp) x tp 1 x pp 1 = world 2",
        ),
        (
            ParallelConfig(pipeline_parallel=2, grad_compression="bf16"),
            "dp 1 (ddp) x tp 1 x pp 2 = world 2",
        ),
    ):
        with pytest.raises(ConfigError) as e:
            build_layout(parallel, gpt, "no", two_ranks())
        assert str(e.value).startswith(
            f"parallel.grad_compression = {parallel.grad_compression!r} compresses DDP's "
            f"gradient all-reduce, and this run's layout is {layout}: "
        )
    assert not build_layout(
        ParallelConfig(grad_compression="fp16"), gpt, "no", two_ranks()
    ).sharded_checkpoints


def test_fsdp_on_one_replica_says_it_trains_the_plain_layout(tmp_path, corpus, token_cache, caplog):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **{"parallel.data_parallel": "fsdp"})
    with caplog.at_level(logging.WARNING, LOG.name):
        layout, _, _ = build_layout_and_workload(cfg, one_process(), LOG)
    assert layout.data_parallel == "ddp" and not layout.sharded_checkpoints
    assert (
        "parallel.data_parallel = fsdp with dp 1 (ddp) x tp 1 x pp 1 = world 1: one data-parallel replica "
        "has nothing to shard, so this run trains the plain layout" in caplog.text
    )


def test_the_builders_on_one_process(tmp_path, corpus, token_cache, caplog):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **{"data.pack": "false"})
    rt = one_process()
    with caplog.at_level(logging.INFO, LOG.name):
        layout, plan, wl = build_layout_and_workload(cfg, rt, LOG)
        t = build_trainee(cfg, rt, wl, layout, plan)
    assert t.workload is wl and t.dp_rank == 0 and t.total_steps == 3
    assert t.layout.describe() == "dp 1 (ddp) x tp 1 x pp 1 = world 1"
    assert t.plan == BatchPlan(global_batch=8, world_size=1, micro_batch=8, grad_accum=1)
    assert t.lr == 2e-3  # optim.lr_scaling none: the configured rate (the default)
    assert t.model is wl.model and all(p.device.type == "cpu" for p in t.model.parameters())
    assert t.model.head.weight.shape == (256, 32)  # the byte tokenizer's vocabulary
    assert t.flops_per_token == t.model.flops_per_token() > 0
    assert (
        t.pipeline is None and t.scaler is None and isinstance(t.autocast, contextlib.nullcontext)
    )
    # nothing wrapped in DDP yet: wrap_ddp decides, and on one process leaves the model with its loss
    assert (
        t.wrapped.model is t.model
        and t.wrapped.loss is wl.loss
        and t.ddp_choice is None
        and t.guard is None
    )
    trained = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in t.model.parameters()}
    assert t.scheduler.optimizer is t.optimizer and t.scheduler.last_epoch == 0
    assert (
        "data.pack = False has no effect: data.kind 'text' does not read it (it packs ChatML conversations)"
        in caplog.text
    )

    batches = build_batches(cfg, t, Cursor(), 0)
    x, y = batches.next_step().micro_batches[0]
    # y: the next byte of x
    assert x.shape == y.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])
    eval_batches = batches.eval_indices
    # train.eval_batches of micro 8
    assert len(eval_batches) == 2 and all(len(b) == 8 for b in eval_batches)
    assert len({i for b in eval_batches for i in b}) == 16
    t.wrap_ddp(batches, cfg.parallel, None, LOG)
    # no DDP
    assert type(t.wrapped) is LossModule and t.wrapped.model is t.model and t.ddp_choice is None


@pytest.mark.slow  # a cold inductor cache: 45-75 s of C++ compiles
def test_a_compiled_run_trains_as_the_plain_one_and_saves_the_same_keys(
    tmp_path, corpus, token_cache
):
    """train.compile: torch.compile in place (inductor's CPU code here), the same losses as eager within float
    rounding (fused kernels reorder sums), and a checkpoint whose tensors are named as the plain run's."""
    from safetensors.torch import load_file

    from .tiny import train

    rows, tensors = {}, {}
    for compiled in (False, True):
        run = tmp_path / f"compile-{compiled}"
        train(
            tiny_config(
                run,
                corpus,
                token_cache,
                # no evaluation: under no_grad and eval mode the model would be compiled again
                **{"train.compile": compiled, "train.max_steps": 3, "data.eval_fraction": 0},
            )
        )
        rows[compiled] = [
            json.loads(line)["loss"]
            for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["split"] == "train"
        ]
        tensors[compiled] = load_file(run / "checkpoints" / "step_00000003" / "model.safetensors")
    assert len(rows[True]) == 3 and rows[True] == pytest.approx(rows[False], rel=1e-4)
    # no "_orig_mod." prefix: checkpoints interchangeable
    assert tensors[True].keys() == tensors[False].keys()
    assert all(
        torch.allclose(tensors[True][k], v, rtol=1e-3, atol=1e-5) for k, v in tensors[False].items()
    )


def test_compile_is_refused_for_pipeline_stages():
    from lockstep.parallel.mesh import Layout
    from lockstep.train.setup import apply_compile

    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        ConfigError,
        match=r"train.compile with dp 1 \(ddp\) x tp 1 x pp 2 = world 2: lockstep does "
        r"not compile pipeline stages; drop --compile",
    ):
        apply_compile(model, Layout(world_size=2, dp=1, tp=1, pp=2))
    apply_compile(model, Layout(world_size=1, dp=1, tp=1, pp=1))
    # nn.Module.compile: in place, the module itself is compiled
    assert model._compiled_call_impl is not None


def test_a_model_loaded_in_eval_mode_trains_in_train_mode(tmp_path, tiny_llama):
    """transformers' from_pretrained leaves a model in eval mode, where its layers skip activation
    checkpointing: the trainee trains it in train mode, and a checkpointed layer runs twice a step
    (its forward, and again in the backward)."""
    from .test_hf_workload import chat_file
    from .test_hf_workload import config as hf_config

    sets = {"model.use_lora": True, "model.gradient_checkpointing": True, "train.batch_size": 2}
    cfg = hf_config(tiny_llama, chat_file(tmp_path / "chat.jsonl"), tmp_path / "run", **sets)
    rt = one_process()
    layout, plan, wl = build_layout_and_workload(cfg, rt, LOG)
    layer = wl.model.base_model.model.model.layers[0]
    assert not layer.training and layer.gradient_checkpointing  # as transformers loaded it
    t = build_trainee(cfg, rt, wl, layout, plan)
    assert t.model.training and all(m.training for m in t.model.modules())
    # the layer's hooks stay outside its checkpoint, and the recompute stops once it has the saved
    # tensors, before the MLP's forward ends: its forward pre-hooks count the layer's runs
    calls = []
    layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    micro = build_batches(cfg, t, Cursor(), 0).next_step().micro_batches[0]
    t.wrapped(micro).backward()
    assert len(calls) == 2  # checkpointed: its forward, and again in the backward
