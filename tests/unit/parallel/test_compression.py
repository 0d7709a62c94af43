"""Gradient compression through torch's DDP communication hooks (lockstep/parallel/compression.py), on real 2-process
gloo groups: what each setting sends back, one compressed all-reduce per step under accumulation, PowerSGD's state
carried exactly across new buckets and a new process, fp16 overflow, and the settings refused."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import run_ranks
from torch import nn

from lockstep.config import ParallelConfig
from lockstep.errors import ConfigError, GradientOverflow
from lockstep.parallel.compression import apply_compression, check_compression, check_powersgd_rank
from lockstep.parallel.ddp import apply_ddp
from lockstep.runtime import Runtime
from lockstep.train.step import train_step

from .branchy import Branchy, _forward


class Net(nn.Module):
    """Three matrices of different shapes and their biases: several buckets at a small bucket_cap_mb."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 48), nn.Linear(48, 40), nn.Linear(40, 8)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _mse(model, batch):
    x, y = batch
    return (model(x) - y).square().mean()


def _batches(rank: int, step: int, n: int = 1, scale: float = 1.0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return [
        (torch.randn(8, 32, generator=g), scale * torch.randn(8, 8, generator=g)) for _ in range(n)
    ]


def _wrap(rt, model, kind, rank=4, start=2, bucket_cap_mb=0.004, forward=_mse, find_unused=False):
    ddp = apply_ddp(
        model, rt, forward, find_unused_parameters=find_unused, bucket_cap_mb=bucket_cap_mb
    )
    comp = apply_compression(
        ddp,
        model,
        ParallelConfig(grad_compression=kind, powersgd_rank=rank, powersgd_start_step=start),
    )
    return ddp, comp


def _train(rt, ddp, model, comp, steps, first=1, accum=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(first, first + steps):

        def keep():
            grads.append([p.grad.clone() for p in model.parameters()])
            if comp is not None:
                comp.check_step(step, rt)

        train_step(
            ddp,
            model,
            opt,
            _batches(rt.rank, step, accum),
            rt,
            grad_accum=accum,
            autocast=torch.autocast("cpu", enabled=False),
            after_backward=keep,
        )
    return grads


# ---------------------------------------------------------------- what comes back


def _compressed_grads(rt, kind):
    torch.manual_seed(0)
    model = Net()
    ddp, comp = _wrap(rt, model, kind)
    return _train(rt, ddp, model, comp, steps=4)


KINDS = ["none", "bf16", "fp16", "powersgd"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_ends_with_the_same_gradients(ranks, kind):
    per_rank = [rank["grads"][kind] for rank in ranks]
    plain = ranks[0]["grads"]["none"]
    # what --check-grads hashes: the decompressed gradients, identical on both ranks
    for a, b in zip(*per_rank):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    first, last = per_rank[0][0], per_rank[0][-1]
    # step 1 has the same weights everywhere: bf16 / fp16 differ from the plain mean by their rounding only;
    # powersgd's first step is a plain all-reduce (powersgd_start_step 2), later ones a rank-4 approximation
    tol = {"none": 0, "bf16": 1e-2, "fp16": 2e-3, "powersgd": 0}[kind]
    for g, p in zip(first, plain[0]):
        assert (g - p).abs().max() <= tol * p.abs().max()
    if kind in ("bf16", "fp16"):
        assert any(not torch.equal(g, p) for g, p in zip(first, plain[0]))  # it did compress
    # b.weight (40 x 48) comes back as P Q^T from step 2 on: rank 4 at most, where 16 samples give the plain sum more
    rank = torch.linalg.matrix_rank(last[2]).item()
    assert rank <= 4 if kind == "powersgd" else rank > 4


def _accumulated(rt, accum):
    torch.manual_seed(0)
    model = Net()
    ddp, comp = _wrap(rt, model, "powersgd", start=2)
    _train(rt, ddp, model, comp, steps=3, accum=accum)
    return comp.torch_state.iter


def test_accumulation_makes_one_compressed_all_reduce_per_step(ranks):
    # PowerSGD counts the all-reduces of its last bucket: micro-steps under no_sync() make none
    assert [rank["accumulated"] for rank in ranks] == [3, 3]


def _branchy(rt):
    torch.manual_seed(0)
    model = Branchy()
    ddp = apply_ddp(model, rt, _forward, find_unused_parameters=True)
    comp = apply_compression(ddp, model, ParallelConfig(grad_compression="bf16"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        use = step % 2 == 0  # the branch: used by some steps only
        batch = (
            torch.randn(2, 4, generator=torch.Generator().manual_seed(step * 10 + rt.rank)),
            use,
        )
        train_step(
            ddp,
            model,
            opt,
            [batch],
            rt,
            autocast=torch.autocast("cpu", enabled=False),
            after_backward=lambda: comp.check_step(step, rt),
        )
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_compression_with_find_unused_parameters_keeps_replicas_identical(ranks):
    a, b = (rank["branchy"] for rank in ranks)
    assert all(torch.equal(a[name], b[name]) for name in a)


# ---------------------------------------------------------------- PowerSGD's state across buckets and processes


def _resumed(rt, stop):
    """Train 8 steps straight; and `stop` steps, then a new DDP (new buckets) from the saved weights and state."""
    torch.manual_seed(0)
    model = Net()
    ddp, comp = _wrap(rt, model, "powersgd", start=3)
    _train(rt, ddp, model, comp, steps=stop)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = comp.state_dict()
    straight = _train(rt, ddp, model, comp, steps=8 - stop, first=stop + 1)

    again = Net()
    again.load_state_dict(weights)
    ddp2, comp2 = _wrap(rt, again, "powersgd", start=3)
    comp2.load_state_dict(saved, same_ranks=True)
    resumed = _train(rt, ddp2, again, comp2, steps=8 - stop, first=stop + 1)
    return straight, resumed, sorted(saved["error"]), sorted(saved["q"])


@pytest.mark.parametrize("stop", [2, 5])
def test_powersgd_state_resumes_exactly_in_new_buckets(ranks, stop):
    for straight, resumed, errors, qs in (rank["resumed"][stop] for rank in ranks):
        for a, b in zip(straight, resumed):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        # compressing since step 3: error feedback for every parameter, Q for the matrices worth it
        if stop == 5:
            assert errors == sorted(f"model.{m}.{k}" for m in "abc" for k in ("weight", "bias"))
            # c.weight (8 x 40) at rank 4 would send (8 + 40) x 4 = 192 numbers for 320, under torch's 2x minimum
            assert qs == ["model.a.weight", "model.b.weight"]


def _without_error_feedback(rt):
    torch.manual_seed(0)
    model = Net()
    ddp, comp = _wrap(rt, model, "powersgd", start=3)
    _train(rt, ddp, model, comp, steps=5)
    saved = comp.state_dict()
    dropped = {**saved, "error": {name: torch.zeros_like(t) for name, t in saved["error"].items()}}
    out = []
    for state in (saved, dropped):
        m = Net()
        m.load_state_dict(model.state_dict())
        ddp2, comp2 = _wrap(rt, m, "powersgd", start=3)
        comp2.load_state_dict(state, same_ranks=True)
        out.append(_train(rt, ddp2, m, comp2, steps=1, first=6)[0])
    return out


def test_error_feedback_changes_the_next_step(ranks):
    # the saved error is not decoration: zeroing it changes the next compressed gradient
    kept, zeroed = ranks[0]["error_feedback"]
    assert any(not torch.equal(a, b) for a, b in zip(kept, zeroed))


# ---------------------------------------------------------------- fp16 overflow


def _overflow(rt):
    torch.manual_seed(0)
    model = Net()
    ddp, comp = _wrap(rt, model, "fp16")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    try:
        for step in (1, 2):
            scale = 1.0 if step == 1 else 1e7  # step 2's gradients pass fp16's 65504
            train_step(
                ddp,
                model,
                opt,
                _batches(rt.rank, step, scale=scale),
                rt,
                autocast=torch.autocast("cpu", enabled=False),
                after_backward=lambda: comp.check_step(step, rt),
            )
    except GradientOverflow as e:
        return str(e)
    return None


def test_fp16_overflow_stops_the_run_naming_the_step(ranks):
    for message in (rank["overflow"] for rank in ranks):
        assert message is not None and message.startswith(
            "step 2: fp16 gradient compression overflowed"
        )
        assert "above fp16's largest value 65504" in message and "grad_compression: bf16" in message


# ---------------------------------------------------------------- one group runs them all


def _every_run(rt) -> dict:
    """Each run the tests above check, one after another on the same 2 ranks: each seeds, builds its
    own model, DDP and hook state; the fp16 overflow, which ends its run with an error, comes last."""
    return {
        "grads": {kind: _compressed_grads(rt, kind) for kind in KINDS},
        "accumulated": _accumulated(rt, 4),
        "branchy": _branchy(rt),
        "resumed": {stop: _resumed(rt, stop) for stop in (2, 5)},
        "error_feedback": _without_error_feedback(rt),
        "overflow": _overflow(rt),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Each rank's results of _every_run: one gloo group for the module (it ran 14 before, the plain
    'none' run 5 times over)."""
    return run_ranks(_every_run)


# ---------------------------------------------------------------- refused


@pytest.mark.parametrize(
    "dp, tp, pp, why",
    [
        ("fsdp", 1, 1, "FSDP reduce-scatters gradient shards"),
        ("ddp", 2, 1, "tensor-parallel gradients are sharded DTensors"),
        ("ddp", 1, 2, "pipeline stages reduce their gradients through FSDP"),
    ],
)
def test_layouts_without_a_ddp_all_reduce_are_refused(dp, tp, pp, why):
    with pytest.raises(ConfigError, match=why) as e:
        check_compression(ParallelConfig(grad_compression="bf16"), "LAYOUT", dp, tp, pp)
    assert "parallel.grad_compression = 'bf16'" in str(
        e.value
    ) and "set parallel.grad_compression: none" in str(e.value)
    check_compression(ParallelConfig(), "LAYOUT", dp, tp, pp)  # none: nothing to refuse


def test_powersgd_rank_must_fit_the_smallest_matrix():
    model = Net()  # smallest matrix: c.weight, 8 x 40
    check_powersgd_rank(model, 8)
    with pytest.raises(ConfigError) as e:
        check_powersgd_rank(model, 9)
    assert str(e.value).startswith(
        "parallel.powersgd_rank = 9 is larger than the smallest gradient matrix dimension, "
        "8 (c.weight, shape (8, 40))"
    )
    assert "set parallel.powersgd_rank to 8 or less" in str(e.value)
    model.c.requires_grad_(False)  # frozen matrices are not sent
    check_powersgd_rank(model, 9)
    # 2 x 48: sent whole at any rank, so it does not count
    head = nn.Sequential(nn.Linear(40, 48), nn.Linear(48, 2))
    check_powersgd_rank(head, 32)
    with pytest.raises(ConfigError, match="no trainable matrix PowerSGD would compress"):
        check_powersgd_rank(nn.LayerNorm(4), 1)


LOG = logging.getLogger("test.compression")


def test_load_compression_state_keeps_error_feedback_only_at_the_world_size_that_saved_it(caplog):
    from lockstep.parallel.compression import Compression, PowerSGD, load_compression_state

    saved = {
        "format": 1,
        "kind": "powersgd",
        "world_size": 2,
        "iter": 7,
        "q": {"model.w": torch.ones(6)},
        "errors": [{"model.w": torch.zeros(12)}, {"model.w": torch.full((12,), 2.0)}],
    }
    rank1 = Runtime(1, 1, 2, 2, 0, torch.device("cpu"), "gloo", "test", "h")
    same = PowerSGD({}, rank=2, start_step=3)
    load_compression_state(same, saved, rank1, LOG)
    assert same.torch_state.iter == 7 and torch.equal(
        same.loose["error"]["model.w"], torch.full((12,), 2.0)
    )
    assert torch.equal(same.loose["q"]["model.w"], torch.ones(6))

    grown = PowerSGD({}, rank=2, start_step=3)
    with caplog.at_level(logging.WARNING):
        load_compression_state(
            grown, saved, Runtime(0, 0, 3, 3, 0, torch.device("cpu"), "gloo", "test", "h"), LOG
        )
    assert (
        grown.torch_state.iter == 7 and grown.loose["error"] == {} and "model.w" in grown.loose["q"]
    )
    assert (
        "saved by 2 ranks; with 3 it starts from zero" in caplog.text and "not exact" in caplog.text
    )

    # a checkpoint's PowerSGD state means nothing to bf16: it is left alone
    other = Compression("bf16")
    load_compression_state(other, saved, rank1, LOG)
    assert other.state_dict() is None
