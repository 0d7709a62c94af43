"""The DDP check, the choice of settings, the guard, and the gradient-hash comparison, on real gloo groups.

The matrix test runs every combination the chooser can produce (model known or not x what the check saw
x grad_accum 1 / 2 x the config's overrides) under real 2-process DDP and compares the trained weights with
one process computing the same global batch; the settings that cannot work must stop with a message or be
refused, never hang.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from conftest import run_ranks
from torch import nn

from lockstep.config import Config, ParallelConfig
from lockstep.errors import ConfigError, GradientDivergence, UnusedParameterError
from lockstep.parallel.ddp import LossModule, UsageGuard, apply_ddp
from lockstep.parallel.ddp_check import (
    UsageReport,
    check_gradients_agree,
    check_static_graph,
    choose_ddp_options,
    find_unused_parameters,
    gather_usage,
    gradient_digests,
)
from lockstep.parallel.mesh import check_layout
from lockstep.runtime import Runtime
from lockstep.train.step import train_step

from .branchy import Branchy, _forward

BRANCH = ["branch.bias", "branch.weight"]


def test_check_reports_each_micro_batch_and_leaves_no_trace():
    torch.manual_seed(0)
    model = Branchy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = [[(torch.randn(2, 4), True), (torch.randn(2, 4), False)], [(torch.randn(2, 4), False)]]
    torch.manual_seed(5)
    expected_next = torch.rand(3)
    torch.manual_seed(5)
    unused, opaque = find_unused_parameters(model, steps, _forward, contextlib.nullcontext())
    # per micro-batch, not per merged step: under no_sync the last micro-batch alone must reach every parameter;
    # frozen parameters are not DDP's concern
    assert unused == [[[], BRANCH], [BRANCH]]
    assert not opaque
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.rand(3), expected_next)  # the RNG stream is where it was


ALL_USED = [[[[], []]], [[[], []]]]  # unused[rank][step][micro]
CONSTANT = [[[BRANCH, BRANCH]], [[BRANCH, BRANCH]]]
SKEWED = [[[[], []]], [[BRANCH, BRANCH]]]


@pytest.mark.parametrize(
    "uses_all, unused, settings, accum, expect",
    [
        # (find_unused_parameters, static_graph, guarded)
        # the built-in GPT: plain DDP, nothing to guard
        (True, ALL_USED, {}, 4, (False, False, False)),
        (True, None, {}, 4, (False, False, False)),  # ... also without the check
        # a model lockstep trusts, proven wrong by the check
        (True, SKEWED, {}, 1, (True, False, False)),
        # any other model: a rare branch cannot be ruled out
        (False, ALL_USED, {}, 4, (True, False, False)),
        (False, None, {}, 1, (True, False, False)),
        (False, CONSTANT, {}, 4, (True, False, False)),  # static_graph is never chosen
        (False, SKEWED, {}, 4, (True, False, False)),
        # forced: guarded
        (False, ALL_USED, {"find_unused_parameters": "false"}, 4, (False, False, True)),
        (False, CONSTANT, {"static_graph": "true"}, 1, (True, True, True)),
        (True, ALL_USED, {"static_graph": "true"}, 1, (False, True, False)),
    ],
)
def test_choice(uses_all, unused, settings, accum, expect):
    report = UsageReport(3, unused) if unused is not None else None
    choice = choose_ddp_options(report, ParallelConfig(**settings), accum, uses_all)
    assert (choice.find_unused_parameters, choice.static_graph, choice.guarded) == expect, choice
    assert ("set in the config" in choice.reason) == bool(settings)
    if not uses_all and not settings and unused in (ALL_USED, None):
        assert (
            "rare batch" in choice.reason
            and "parallel.find_unused_parameters: false" in choice.hint
        )
    if settings.get("find_unused_parameters") == "false":
        assert choice.hint.startswith("lockstep's own choice would be find_unused_parameters=True")


def test_static_graph_with_accumulation_is_refused_before_launch():
    with pytest.raises(
        ConfigError,
        match=r"static_graph: true with grad_accum 4: .*expect_autograd_hooks_.*grad_accum 1",
    ):
        check_static_graph(ParallelConfig(static_graph="true"), 4)
    check_static_graph(ParallelConfig(static_graph="true"), 1)  # no accumulation: allowed
    cfg = Config()
    cfg.parallel.static_graph = "true"
    cfg.train.batch_size, cfg.train.micro_batch_size = 32, 4
    with pytest.raises(ConfigError, match="grad_accum 4"):
        check_layout(cfg, 2)  # what `lockstep train` / `launch` run before any worker starts
    check_layout(cfg, 1)  # one process has no DDP


def test_report_counts_micro_batches_per_rank():
    text = UsageReport(
        7, [[[["a.w"], []], [[], []]], [[["a.w", "b.w"], []], [["a.w"], []]]]
    ).format()
    assert (
        "2 of 7 trainable parameters went unused in some of the 8 micro-batches checked (2 step(s) x 2 "
        "micro-batch(es) x 2 rank(s))" in text
    )
    assert (
        "a.w: unused in 3 of 8 (rank 0: 1/4, rank 1: 2/4)" in text
        and "b.w: unused in 1 of 8" in text
    )
    assert "reached all 7" in UsageReport(7, [[[[]]], [[[]]]]).format()


# ---------------------------------------------------------------- the matrix, on 2 real processes

STEPS = 3


def _plan(pattern: str, accum: int) -> list[list[list[bool]]]:
    """plan[step][rank] = use_branch per micro-batch."""

    def step(r0: list[bool], r1: list[bool]) -> list[list[bool]]:
        return [r0, r1]

    on, off = [True] * accum, [False] * accum
    match pattern:
        case "all":
            return [step(on, on)] * STEPS
        case "never":
            return [step(off, off)] * STEPS
        case "skewed":  # rank 0 always, rank 1 never
            return [step(on, off)] * STEPS
        case "rare":  # used everywhere in the checked step 1; step 3's last micro-batch on rank 1 leaves it out
            return [step(on, on), step(on, on), step(on, on[:-1] + [False])]
    raise AssertionError(pattern)


def _batch(step: int, rank: int, micro: int, use: bool):
    return torch.randn(
        2, 4, generator=torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    ), use


SCENARIOS = {  # name: (pattern, accum, uses_all_parameters, check steps, parallel settings, expected outcome)
    "gpt-like plain": ("all", 1, True, 1, {}, "trains"),
    "gpt-like plain accum": ("all", 2, True, 1, {}, "trains"),
    "gpt-like unchecked": ("all", 2, True, 0, {}, "trains"),
    "trusted but check saw unused": ("skewed", 2, True, 1, {}, "trains"),
    "unknown all used": ("all", 2, False, 1, {}, "trains"),
    "unknown never used": ("never", 1, False, 1, {}, "trains"),
    "unknown never used accum": ("never", 2, False, 1, {}, "trains"),
    "unknown skewed": ("skewed", 1, False, 1, {}, "trains"),
    "unknown skewed accum": ("skewed", 2, False, 1, {}, "trains"),
    "unknown rare": ("rare", 1, False, 1, {}, "trains"),
    "unknown rare accum": ("rare", 2, False, 1, {}, "trains"),
    "unknown rare unchecked": ("rare", 2, False, 0, {}, "trains"),
    "forced plain, rare": ("rare", 1, False, 1, {"find_unused_parameters": "false"}, "stops"),
    "forced plain, rare accum": ("rare", 2, False, 1, {"find_unused_parameters": "false"}, "stops"),
    "forced static, never used": ("never", 1, False, 1, {"static_graph": "true"}, "trains"),
    "forced static, rare": ("rare", 1, False, 1, {"static_graph": "true"}, "stops"),
    "forced static, skewed": ("skewed", 1, False, 1, {"static_graph": "true"}, "stops"),
    "forced static, accum": ("all", 2, False, 1, {"static_graph": "true"}, "refused"),
}


def _reference(pattern: str, accum: int) -> dict[str, torch.Tensor]:
    """One process: each step's gradient is the mean over both ranks' micro-batches, as DDP's average is."""
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for s, ranks in enumerate(_plan(pattern, accum)):
        for r, uses in enumerate(ranks):
            for i, use in enumerate(uses):
                (_forward(model, _batch(s, r, i, use)) / (accum * 2)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _scenario(
    rt: Runtime, pattern: str, accum: int, uses_all: bool, check_steps: int, settings: dict
):
    torch.manual_seed(0)
    model = Branchy()
    plan = _plan(pattern, accum)
    report = None
    if check_steps:
        steps = [
            [_batch(s, rt.rank, i, use) for i, use in enumerate(plan[s][rt.rank])]
            for s in range(check_steps)
        ]
        unused, opaque = find_unused_parameters(model, steps, _forward, contextlib.nullcontext())
        report = gather_usage(rt, unused, 4, opaque)
    try:
        choice = choose_ddp_options(report, ParallelConfig(**settings), accum, uses_all)
    except ConfigError as e:
        return "refused", str(e), None
    ddp = apply_ddp(model, rt, _forward, choice.find_unused_parameters, choice.static_graph)
    guard = UsageGuard(rt, model, choice.static_graph, choice.reason) if choice.guarded else None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    try:
        for s in range(STEPS):
            batches = [_batch(s, rt.rank, i, use) for i, use in enumerate(plan[s][rt.rank])]
            train_step(
                ddp,
                model,
                opt,
                batches,
                rt,
                grad_accum=accum,
                before_reduce=guard and (lambda loss, s=s: guard(loss, s + 1)),
            )
    except UnusedParameterError as e:
        return "stops", str(e), (choice.find_unused_parameters, choice.static_graph)
    return (
        "trains",
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        (choice.find_unused_parameters, choice.static_graph),
    )


FSDP_SCENARIOS = {
    "fsdp skewed": ("skewed", 2),
    "fsdp rare": ("rare", 2),
}  # lockstep's default for such a model


def _fsdp_scenario(rt: Runtime, pattern: str, accum: int):
    """FSDP2 (the root sharded over both ranks) on a model whose ranks leave different parameters unused."""
    from torch.distributed.device_mesh import init_device_mesh

    from lockstep.parallel.fsdp import apply_fsdp

    torch.manual_seed(0)
    model = Branchy()
    apply_fsdp(model, init_device_mesh("cpu", (2,)), unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plan = _plan(pattern, accum)
    for s in range(STEPS):
        batches = [_batch(s, rt.rank, i, use) for i, use in enumerate(plan[s][rt.rank])]
        train_step(LossModule(model, _forward), model, opt, batches, rt, grad_accum=accum)
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def _matrix_and_hashes(rt: Runtime) -> dict:
    """Every scenario, then _hashes, on the same 2 ranks. A wrong choice must fail the tests, not
    hang them: gloo raises after run_ranks' timeout of 60 s."""
    plain = dataclasses.replace(rt, control_group=None)  # collectives on the default group
    results = {name: _scenario(plain, *spec[:5]) for name, spec in SCENARIOS.items()}
    results.update({name: _fsdp_scenario(plain, *spec) for name, spec in FSDP_SCENARIOS.items()})
    return {"matrix": results, "hashes": _hashes(dataclasses.replace(rt, launcher="manual"))}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Each rank's _matrix_and_hashes: one gloo group for the module."""
    return run_ranks(_matrix_and_hashes)


@pytest.fixture(scope="module")
def matrix(two_ranks) -> list[dict]:
    return [rank["matrix"] for rank in two_ranks]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_choice_trains_exactly_or_stops_on_every_rank(matrix, name):
    pattern, accum, _, _, settings, expected = SCENARIOS[name]
    (outcome0, value0, choice0), (outcome1, value1, choice1) = matrix[0][name], matrix[1][name]
    assert outcome0 == outcome1 == expected, (value0, value1)
    assert choice0 == choice1
    if expected == "trains":
        reference = _reference(pattern, accum)
        # both replicas hold the weights one process gets from the same global batches
        for key in reference:
            torch.testing.assert_close(value0[key], reference[key], rtol=0, atol=1e-6)
            assert torch.equal(value0[key], value1[key])
    elif expected == "stops":
        assert value0 == value1  # one message, the same on every rank
        assert "rank 1: no gradient for 'branch.bias', 'branch.weight'" in value0, value0
        step = 1 if pattern == "skewed" else 3
        assert value0.startswith(
            f"step {step}: the loss did not reach every parameter DDP expects"
        ), value0
        fix = (
            "parallel.static_graph: false"
            if settings.get("static_graph")
            else "parallel.find_unused_parameters: true"
        )
        assert fix in value0 and "set in the config" in value0
    else:
        assert "grad_accum 2" in value0 and "expect_autograd_hooks_" in value0


@pytest.mark.parametrize("name", list(FSDP_SCENARIOS))
def test_fsdp_sends_zeros_for_the_gradients_a_rank_left_out(matrix, name):
    # FSDP2 alone reduce-scatters only the gradients a rank has: rank-skewed branches abort gloo ("collective
    # mismatch"); with reduce_scatter_unused_params the weights are those of one process on the same batches
    reference = _reference(*FSDP_SCENARIOS[name])
    for key in reference:
        torch.testing.assert_close(matrix[0][name][key], reference[key], rtol=0, atol=1e-6)
        assert torch.equal(matrix[0][name][key], matrix[1][name][key])


# ---------------------------------------------------------------- --check-grads


def _hashes(rt: Runtime) -> tuple:
    rank = rt.rank
    torch.manual_seed(0)
    model = Branchy()
    ddp = apply_ddp(model, rt, _forward, find_unused_parameters=True)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    ddp((x, rank == 0)).backward()  # the branch runs on rank 0 only
    check_gradients_agree(rt, model, 1)  # DDP averaged everything, the unused branch included
    ok_digests = gradient_digests(model)
    model.zero_grad()
    # a parameter hidden from DDP keeps each rank's own gradient: the check must name it
    torch.manual_seed(0)
    model = Branchy()
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["trunk.bias"]
    )
    ddp = apply_ddp(model, rt, _forward)
    ddp((x, True)).backward()
    try:
        check_gradients_agree(rt, model, 7)
        message = None
    except GradientDivergence as e:
        message = str(e)
    return ok_digests, message


def test_gradient_hashes_agree_under_ddp_and_name_a_parameter_ddp_skipped(two_ranks):
    (digests0, message0), (digests1, message1) = (rank["hashes"] for rank in two_ranks)
    # trunk + branch, weight and bias; frozen has none
    assert digests0 == digests1 and len(digests0) == 4
    assert message0 == message1
    assert message0.startswith("step 7: the gradient of 'trunk.bias' differs between ranks"), (
        message0
    )


def test_the_cli_refuses_static_graph_with_accumulation_before_any_worker_starts(tmp_path, capsys):
    """The custom_conditioning example's config (batch 16, micro-batch 4: grad_accum 2 on 2 ranks)
    with parallel.static_graph: true, through `lockstep train`: refused by the layout check, before
    its factories are imported or its data is read."""
    from pathlib import Path

    from conftest import run_main

    examples = Path(__file__).resolve().parents[3] / "examples"
    config = examples / "custom_conditioning" / "config.yaml"
    run = tmp_path / "run"
    code, out, err = run_main(
        capsys,
        "train",
        "--config",
        config,
        "--world-size",
        "2",
        "--data",
        tmp_path / "tts.jsonl",
        "--output-dir",
        run,
        "--set",
        "parallel.static_graph=true",
    )
    assert code == 2
    assert "parallel.static_graph: true with grad_accum 2" in err, err
    assert not (run / "logs").exists() and "starting 2 workers" not in out
