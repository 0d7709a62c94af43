"""lockstep/train/setup.py: the step count of a run and its refusal; the layout's refusals; everything setup builds
for a tiny GPT on one process; on a real 2-process gloo group, the DDP it applies (the DDP check on a custom model
that leaves a parameter out, with the micro-batches it read put back) and the gradient comparison."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch

from conftest import one_process, run_ranks
from lockstep.config import ModelConfig, ParallelConfig, TrainConfig, load_config
from lockstep.data.sampler import Cursor
from lockstep.errors import ConfigError, DataError, GradientDivergence
from lockstep.parallel.ddp import LossModule
from lockstep.parallel.mesh import BatchPlan
from lockstep.runtime import Runtime
from lockstep.train.setup import apply_checked_ddp, build_batches, build_layout, build_setup, compare_gradients, count_steps

from .tiny import tiny_config

LOG = logging.getLogger("test.train.setup")  # propagates to the root logger: caplog sees it
PLAN = BatchPlan(global_batch=8, world_size=1, micro_batch=8, grad_accum=1)


def test_count_steps_takes_max_steps_or_epochs_whichever_ends_first():
    # 100 samples, global batch 8: 12 whole steps per epoch (the tail of 4 is dropped)
    assert count_steps(TrainConfig(max_steps=1000, epochs=None), 100, PLAN) == 1000
    assert count_steps(TrainConfig(max_steps=None, epochs=2), 100, PLAN) == 24
    assert count_steps(TrainConfig(max_steps=None, epochs=0.5), 100, PLAN) == 6
    assert count_steps(TrainConfig(max_steps=None, epochs=1.1), 100, PLAN) == 14  # a started step counts: ceil(13.2)
    assert count_steps(TrainConfig(max_steps=10, epochs=2), 100, PLAN) == 10
    assert count_steps(TrainConfig(max_steps=100, epochs=2), 100, PLAN) == 24
    assert count_steps(TrainConfig(max_steps=5), 8, PLAN) == 5  # exactly one global batch is enough


def test_count_steps_refuses_a_corpus_smaller_than_one_global_batch():
    with pytest.raises(DataError) as e:
        count_steps(TrainConfig(max_steps=10), 7, PLAN)
    assert str(e.value) == ("the corpus has 7 training windows, fewer than one global batch of 8; use more data, a "
                            "smaller train.batch_size or a shorter model.max_seq_length")


def two_ranks() -> Runtime:
    """Rank 0 of 2 as a value: build_layout reads the world size and the device, and joins no group."""
    return Runtime(0, 0, 2, 2, 0, torch.device("cpu"), "gloo", "test", "h")


def test_build_layout_refuses_check_grads_where_gradients_are_sharded():
    gpt = ModelConfig(hidden_size=32, attention_heads=2, layers=2)
    for parallel, layout in ((ParallelConfig(data_parallel="fsdp", check_grads=True), "dp 2 (fsdp) x tp 1 x pp 1"),
                             (ParallelConfig(tensor_parallel=2, check_grads=True), "dp 1 (ddp) x tp 2 x pp 1")):
        with pytest.raises(ConfigError) as e:
            build_layout(parallel, gpt, "no", two_ranks())
        assert str(e.value) == (f"parallel.check_grads compares whole gradients across data-parallel replicas; with "
                                f"{layout} = world 2 they are sharded: use it with data_parallel: ddp, tp 1, pp 1")
    layout = build_layout(ParallelConfig(check_grads=True), gpt, "no", two_ranks())
    assert layout.describe() == "dp 2 (ddp) x tp 1 x pp 1 = world 2" and not layout.sharded_checkpoints
    # fsdp without check_grads is fine; fp16 on a CPU is not (no loss scaling there)
    assert build_layout(ParallelConfig(data_parallel="fsdp"), gpt, "no", two_ranks()).sharded_checkpoints
    with pytest.raises(ConfigError, match=r"train.mixed_precision = 'fp16' needs a CUDA device \(GradScaler\)"):
        build_layout(ParallelConfig(), gpt, "fp16", one_process())


def test_build_layout_refuses_grad_compression_where_ddp_does_not_all_reduce():
    gpt = ModelConfig(hidden_size=32, attention_heads=2, layers=2)
    for parallel, layout in ((ParallelConfig(data_parallel="fsdp", grad_compression="powersgd"),
                              "dp 2 (fsdp) x tp 1 x pp 1 = world 2"),
                             (ParallelConfig(pipeline_parallel=2, grad_compression="bf16"),
                              "dp 1 (ddp) x tp 1 x pp 2 = world 2")):
        with pytest.raises(ConfigError) as e:
            build_layout(parallel, gpt, "no", two_ranks())
        assert str(e.value).startswith(f"parallel.grad_compression = {parallel.grad_compression!r} compresses DDP's "
                                       f"gradient all-reduce, and this run's layout is {layout}: ")
    assert not build_layout(ParallelConfig(grad_compression="fp16"), gpt, "no", two_ranks()).sharded_checkpoints


def test_fsdp_on_one_replica_says_it_trains_the_plain_layout(tmp_path, corpus, token_cache, caplog):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **{"parallel.data_parallel": "fsdp"})
    with caplog.at_level(logging.WARNING, LOG.name):
        s = build_setup(cfg, one_process(), LOG)
    assert s.layout.data_parallel == "ddp" and not s.layout.sharded_checkpoints
    assert ("parallel.data_parallel = fsdp with dp 1 (ddp) x tp 1 x pp 1 = world 1: one data-parallel replica "
            "has nothing to shard, so this run trains the plain layout" in caplog.text)


def test_build_setup_on_one_process(tmp_path, corpus, token_cache, caplog):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **{"data.pack": "false"})
    with caplog.at_level(logging.INFO, LOG.name):
        s = build_setup(cfg, one_process(), LOG)
    assert s.run_dir == tmp_path / "run" and s.dp_rank == 0 and s.total_steps == 3
    assert s.layout.describe() == "dp 1 (ddp) x tp 1 x pp 1 = world 1"
    assert s.plan == BatchPlan(global_batch=8, world_size=1, micro_batch=8, grad_accum=1)
    assert s.lr == 2e-3  # optim.lr_scaling none: the configured rate (the default)
    assert s.model is s.wl.model and all(p.device.type == "cpu" for p in s.model.parameters())
    assert s.model.head.weight.shape == (256, 32)  # the byte tokenizer's vocabulary
    assert s.flops_per_token == s.model.flops_per_token() > 0
    assert s.pipeline is None and s.scaler is None and isinstance(s.autocast, contextlib.nullcontext)
    # nothing wrapped in DDP yet: apply_checked_ddp decides, and on one process leaves the model with its loss
    assert s.ddp_model.model is s.model and s.ddp_model.loss is s.wl.loss and s.ddp_choice is None and s.guard is None
    trained = {id(p) for group in s.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in s.model.parameters()}
    assert s.scheduler.optimizer is s.optimizer and s.scheduler.last_epoch == 0
    assert ("data.pack = False has no effect: data.kind 'text' does not read it (it packs ChatML conversations)"
            in caplog.text)

    s.batches, s.eval_batches = build_batches(s, Cursor(), 0, cfg.data, cfg.train)
    x, y = next(s.batches)
    assert x.shape == y.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])  # y: the next byte of x
    assert len(s.eval_batches) == 2 and all(len(b) == 8 for b in s.eval_batches)  # train.eval_batches of micro 8
    assert len({i for b in s.eval_batches for i in b}) == 16
    apply_checked_ddp(s, cfg.parallel, 0, LOG)
    assert type(s.ddp_model) is LossModule and s.ddp_model.model is s.model and s.ddp_choice is None  # no DDP


PARTLY_USED = """
    import torch
    from torch import nn

    class PartlyUsed(nn.Module):
        '''A regression model with a parameter no forward reaches.'''

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)
            self.spare = nn.Linear(4, 1)

        def forward(self, x, y):
            return ((self.lin(x).squeeze(-1) - y) ** 2).mean()

    def build_model():
        return PartlyUsed()

    def build_data():
        g = torch.Generator().manual_seed(0)
        return [{"x": torch.randn(4, generator=g), "y": torch.randn((), generator=g)} for _ in range(64)]
"""


def _ddp_on(rt, cfg) -> dict:
    s = build_setup(cfg, rt, LOG)
    s.batches, s.eval_batches = build_batches(s, Cursor(), 0, cfg.data, cfg.train)
    apply_checked_ddp(s, cfg.parallel, 0, LOG)
    got = {"wrapped": type(s.ddp_model).__name__, "choice": s.ddp_choice, "guarded": s.guard is not None}
    # the check read the first steps' micro-batches and put them back: training starts with the same ones
    first = build_batches(s, Cursor(), 0, cfg.data, cfg.train)[0]
    got["same_batches"] = all(torch.equal(a["x"], b["x"]) for a, b in zip(
        [next(s.batches) for _ in range(5)], [next(first) for _ in range(5)]))  # 4 were read ahead

    batch = next(first)
    s.ddp_model(batch).backward()
    compare_gradients(rt, s.model, 1, s.ddp_choice)  # DDP averaged them: every rank holds the same
    if rt.rank == 1:
        s.model.lin.bias.grad += 1  # changed outside DDP, on one rank
    for choice in (s.ddp_choice, None):
        try:
            compare_gradients(rt, s.model, 1, choice)
        except GradientDivergence as e:
            got.setdefault("errors", []).append(str(e))
    return got


def test_apply_checked_ddp_checks_a_custom_model_on_2_ranks(tmp_path, write_module):
    module = write_module(PARTLY_USED)
    cfg = load_config(None, {"model.kind": "custom", "model.factory": f"{module}:build_model", "data.kind": "custom",
                             "data.factory": f"{module}:build_data", "data.num_workers": 0, "train.batch_size": 8,
                             "train.grad_accum": 2, "train.max_steps": 4, "train.mixed_precision": "no",
                             "distributed.device": "cpu", "checkpoint.output_dir": str(tmp_path / "run")})
    results = run_ranks(_ddp_on, cfg)
    for got in results:
        assert got["wrapped"] == "DistributedDataParallel" and got["same_batches"]
        choice = got["choice"]
        # the check's 2 steps x 2 micro-batches found `spare` unused on every rank
        assert choice.find_unused_parameters and not choice.static_graph and not got["guarded"]
        assert choice.reason == "needed: micro-batches of the check left parameters out"
        with_options, without = got["errors"]
        assert without.startswith("step 1: the gradient of 'lin.bias' differs between ranks (rank 0 != rank(s) [1]")
        assert with_options == (f"{without}. DDP ran with find_unused_parameters=True, static_graph=False "
                                f"(needed: micro-batches of the check left parameters out)")



def test_load_compression_state_keeps_error_feedback_only_at_the_world_size_that_saved_it(caplog):
    from lockstep.parallel.compression import Compression, PowerSGD
    from lockstep.train.setup import load_compression_state

    saved = {"format": 1, "kind": "powersgd", "world_size": 2, "iter": 7, "q": {"model.w": torch.ones(6)},
             "errors": [{"model.w": torch.zeros(12)}, {"model.w": torch.full((12,), 2.0)}]}
    rank1 = Runtime(1, 1, 2, 2, 0, torch.device("cpu"), "gloo", "test", "h")
    same = PowerSGD({}, rank=2, start_step=3)
    load_compression_state(same, saved, rank1, LOG)
    assert same.torch_state.iter == 7 and torch.equal(same.loose["error"]["model.w"], torch.full((12,), 2.0))
    assert torch.equal(same.loose["q"]["model.w"], torch.ones(6))

    grown = PowerSGD({}, rank=2, start_step=3)
    with caplog.at_level(logging.WARNING):
        load_compression_state(grown, saved, Runtime(0, 0, 3, 3, 0, torch.device("cpu"), "gloo", "test", "h"), LOG)
    assert grown.torch_state.iter == 7 and grown.loose["error"] == {} and "model.w" in grown.loose["q"]
    assert "saved by 2 ranks; with 3 it starts from zero" in caplog.text and "not exact" in caplog.text

    other = Compression("bf16")  # a checkpoint's PowerSGD state means nothing to bf16: it is left alone
    load_compression_state(other, saved, rank1, LOG)
    assert other.state_dict() is None


def test_a_compiled_run_trains_as_the_plain_one_and_saves_the_same_keys(tmp_path, corpus, token_cache):
    """train.compile: torch.compile in place (inductor's CPU code here), the same losses as eager within float
    rounding (fused kernels reorder sums), and a checkpoint whose tensors are named as the plain run's."""
    from safetensors.torch import load_file

    from .tiny import train

    rows, tensors = {}, {}
    for compiled in (False, True):
        run = tmp_path / f"compile-{compiled}"
        train(tiny_config(run, corpus, token_cache, **{"train.compile": compiled, "train.max_steps": 3}))
        rows[compiled] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                          if json.loads(line)["split"] == "train"]
        tensors[compiled] = load_file(run / "checkpoints" / "step_00000003" / "model.safetensors")
    assert len(rows[True]) == 3 and rows[True] == pytest.approx(rows[False], rel=1e-4)
    assert tensors[True].keys() == tensors[False].keys()  # no "_orig_mod." prefix: checkpoints interchangeable
    assert all(torch.allclose(tensors[True][k], v, rtol=1e-3, atol=1e-5) for k, v in tensors[False].items())


def test_compile_is_refused_for_pipeline_stages():
    from lockstep.parallel.mesh import Layout
    from lockstep.train.setup import apply_compile

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"train.compile with dp 1 \(ddp\) x tp 1 x pp 2 = world 2: lockstep does "
                                          r"not compile pipeline stages; drop --compile"):
        apply_compile(model, Layout(world_size=2, dp=1, tp=1, pp=2))
    apply_compile(model, Layout(world_size=1, dp=1, tp=1, pp=1))
    assert model._compiled_call_impl is not None  # nn.Module.compile: in place, the module itself is compiled
