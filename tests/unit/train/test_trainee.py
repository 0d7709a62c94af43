"""lockstep/train/trainee.py: what a Trainee does with its model. On one process: a step runs at the scheduled
learning rate and moves the schedule, the evaluation is the held-out mean, a checkpoint's state comes back. On a
real 2-process gloo group: the DDP it applies (the DDP check on a custom model that leaves a parameter out, with
the micro-batches it read served again) and the gradient comparison."""

from __future__ import annotations

import logging

import torch
from conftest import one_process, run_ranks

from lockstep.config import load_config
from lockstep.data.sampler import Cursor
from lockstep.errors import GradientDivergence
from lockstep.train.setup import build_batches, build_layout_and_workload, build_trainee
from lockstep.train.trainee import compare_gradients

from .tiny import tiny_config

LOG = logging.getLogger("test.train.trainee")


def _gpt_trainee(tmp_path, corpus, token_cache, **overrides):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **overrides)
    rt = one_process()
    layout, plan, wl = build_layout_and_workload(cfg, rt, LOG)
    return cfg, build_trainee(cfg, rt, wl, layout, plan)


def test_a_step_runs_at_the_scheduled_rate_and_moves_the_schedule(tmp_path, corpus, token_cache):
    cfg, t = _gpt_trainee(tmp_path, corpus, token_cache, **{"optim.warmup_steps": 2})
    batches = build_batches(cfg, t, Cursor(), 0)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    x, y = batches.peek(1)[0]
    with torch.no_grad():
        want = float(t.model(x, y)[1])  # the loss of the step's one micro-batch, before it
    first_lr = t.scheduler.get_last_lr()[0]
    done = t.step(batches.next_step(), 1)
    # no loss scaling on the CPU
    assert done.lr == first_lr and not done.skipped and done.scale == 0.0
    assert abs(float(done.loss) - want) < 1e-5 and float(done.grad_norm) > 0
    scheduled = t.scheduler.get_last_lr()[0]
    assert t.scheduler.last_epoch == 1 and scheduled > done.lr  # warming up
    assert any(not torch.equal(before[n], p) for n, p in t.model.named_parameters())
    # the end of the 2 warm-up steps: the peak
    assert t.step(batches.next_step(), 2).lr == scheduled == t.lr
    # the held-out loss: the mean of its micro-batches' losses, in eval mode, the model handed back training
    with torch.no_grad():
        t.model.eval()
        losses = [float(t.model(*b)[1]) for b in batches.held_out()]
        t.model.train()
    assert (
        len(losses) == 2 and abs(t.evaluate(batches) - sum(losses) / 2) < 1e-5 and t.model.training
    )


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
    layout, plan, wl = build_layout_and_workload(cfg, rt, LOG)
    t = build_trainee(cfg, rt, wl, layout, plan)
    batches = build_batches(cfg, t, Cursor(), 0)
    t.wrap_ddp(batches, cfg.parallel, None, LOG)
    got = {
        "wrapped": type(t.wrapped).__name__,
        "choice": t.ddp_choice,
        "guarded": t.guard is not None,
    }
    # the check read the first steps' micro-batches and serves them again: training starts with the same ones
    first = build_batches(cfg, t, Cursor(), 0)
    # 2 steps x 2 were read ahead
    served = [b for _ in range(3) for b in batches.next_step().micro_batches]
    got["same_batches"] = all(
        torch.equal(a["x"], b["x"])
        for a, b in zip(served, [b for _ in range(3) for b in first.next_step().micro_batches])
    )

    batch = first.next_step().micro_batches[0]
    t.wrapped(batch).backward()
    compare_gradients(rt, t.model, 1, t.ddp_choice)  # DDP averaged them: every rank holds the same
    if rt.rank == 1:
        t.model.lin.bias.grad += 1  # changed outside DDP, on one rank
    for choice in (t.ddp_choice, None):
        try:
            compare_gradients(rt, t.model, 1, choice)
        except GradientDivergence as e:
            got.setdefault("errors", []).append(str(e))
    return got


def test_wrap_ddp_checks_a_custom_model_on_2_ranks(tmp_path, write_module):
    module = write_module(PARTLY_USED)
    cfg = load_config(
        None,
        {
            "model.kind": "custom",
            "model.factory": f"{module}:build_model",
            "data.kind": "custom",
            "data.factory": f"{module}:build_data",
            "data.num_workers": 0,
            "train.batch_size": 8,
            "train.grad_accum": 2,
            "train.max_steps": 4,
            "train.mixed_precision": "no",
            "distributed.device": "cpu",
            "checkpoint.output_dir": str(tmp_path / "run"),
        },
    )
    results = run_ranks(_ddp_on, cfg)
    for got in results:
        assert got["wrapped"] == "DistributedDataParallel" and got["same_batches"]
        choice = got["choice"]
        # the check's 2 steps x 2 micro-batches found `spare` unused on every rank
        assert choice.find_unused_parameters and not choice.static_graph and not got["guarded"]
        assert choice.reason == "needed: micro-batches of the check left parameters out"
        with_options, without = got["errors"]
        assert without.startswith(
            "step 1: the gradient of 'lin.bias' differs between ranks (rank 0 != rank(s) [1]"
        )
        assert with_options == (
            f"{without}. DDP ran with find_unused_parameters=True, static_graph=False "
            f"(needed: micro-batches of the check left parameters out)"
        )
