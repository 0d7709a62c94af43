"""DDP around the model and its loss, the walk that finds the parameters a loss reaches, and the guard that stops
a wrong DDP setting before it hangs (lockstep/parallel/ddp.py); on one process and a real 2-process gloo group."""

from __future__ import annotations

import pytest
import torch
from conftest import one_process, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from lockstep.errors import UnusedParameterError
from lockstep.parallel.ddp import UsageGuard, apply_ddp, reachable_parameters

from .branchy import Branchy, _forward


def _batch(rank: int, use: bool = True):
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(rank)), use


class Log:
    def __init__(self):
        self.warnings = []

    def warning(self, message):
        self.warnings.append(message)


PLAIN_FIX = (
    "set parallel.find_unused_parameters: true (or auto, which chooses it for models whose forward lockstep "
    "cannot see into)"
)


# ---------------------------------------------------------------- reachable_parameters


def test_reentrant_checkpointing_hides_parameters_and_is_reported_as_opaque():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    reached, opaque = reachable_parameters(checkpoint(model, x, use_reentrant=True).sum())
    assert opaque and not reached & {id(p) for p in model.parameters()}
    reached, opaque = reachable_parameters(checkpoint(model, x, use_reentrant=False).sum())
    assert not opaque and {id(p) for p in model.parameters()} <= reached


def test_reachable_parameters_are_those_a_branch_uses():
    torch.manual_seed(0)
    model = Branchy()
    ids = {name: id(p) for name, p in model.named_parameters()}
    reached, opaque = reachable_parameters(model(torch.randn(2, 4), False))
    assert not opaque and reached == {
        ids["trunk.weight"],
        ids["trunk.bias"],
    }  # frozen: no gradient to reach
    reached, _ = reachable_parameters(model(torch.randn(2, 4), True))
    assert reached == {
        ids[n] for n in ("trunk.weight", "trunk.bias", "branch.weight", "branch.bias")
    }


# ---------------------------------------------------------------- apply_ddp on one process


def test_one_process_gets_the_loss_module_alone():
    torch.manual_seed(0)
    model = Branchy()
    # torch's convention, under the model's names
    model._ddp_params_and_buffers_to_ignore = ["branch.weight"]
    loss_module = apply_ddp(model, one_process(), _forward, find_unused_parameters=True)
    assert not isinstance(loss_module, DDP) and loss_module.model is model
    # its names, inside the wrapper
    assert loss_module._ddp_params_and_buffers_to_ignore == ["model.branch.weight"]
    batch = _batch(0)
    assert torch.equal(loss_module(batch), _forward(model, batch))
    # no divisor: the function as it is
    assert torch.equal(loss_module(batch, None), _forward(model, batch))
    assert not hasattr(loss_module, "never_used")  # only DDP's reducer needs the quiet parameter


# ---------------------------------------------------------------- UsageGuard on one process


def test_guard_stops_a_step_that_leaves_a_parameter_out():
    torch.manual_seed(0)
    model = Branchy()
    guard = UsageGuard(one_process(), model, static_graph=False, why="set in the config")
    # every trainable parameter reached: nothing to say
    guard(_forward(model, _batch(0, use=True)), 1)
    with pytest.raises(UnusedParameterError) as info:
        guard(_forward(model, _batch(0, use=False)), 2)
    assert str(info.value) == (
        "step 2: the loss did not reach every parameter DDP expects (rank 0: no gradient for 'branch.bias', "
        "'branch.weight'). DDP runs with find_unused_parameters=False and would wait forever for the missing "
        f"all-reduce (set in the config). Stopped before this step's gradients were all-reduced: {PLAIN_FIX}"
    )


def test_guard_skips_what_ddp_ignores_and_goes_blind_behind_reentrant_checkpointing():
    torch.manual_seed(0)
    model = Branchy()
    model._ddp_params_and_buffers_to_ignore = ["branch.weight", "branch.bias"]
    # DDP waits for neither
    UsageGuard(one_process(), model, False, "why")(_forward(model, _batch(0, use=False)), 1)

    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    log = Log()
    guard = UsageGuard(one_process(), seq, False, "why", log)
    x = torch.randn(2, 4, requires_grad=True)
    for step in (1, 2):  # the parameters are hidden, not missing: no error, and one warning
        guard(checkpoint(seq, x, use_reentrant=True).sum(), step)
    assert guard.blind and len(log.warnings) == 1 and "use_reentrant=False" in log.warnings[0]


# ---------------------------------------------------------------- on 2 real processes


def _ddp_cases(rt) -> dict:
    out = {}
    # DDP averages the two ranks' gradients: each rank computes the expected mean itself
    torch.manual_seed(0)
    model = Branchy()
    reference = Branchy()
    reference.load_state_dict(model.state_dict())
    for r in range(rt.world_size):
        (_forward(reference, _batch(r)) / rt.world_size).backward()
    ddp = apply_ddp(model, rt, _forward, find_unused_parameters=True)
    ddp(_batch(rt.rank)).backward()
    out["is_ddp"] = isinstance(ddp, DDP)
    out["grad_error"] = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
        if p.requires_grad
    )
    out["never_used_outside_model"] = hasattr(
        ddp.module, "never_used"
    ) and "never_used" not in dict(model.named_parameters())

    # plain DDP: step 1 fine, step 2 rank 1's loss skips the branch -> every rank stops with one message
    guard = UsageGuard(rt, model, static_graph=False, why="set in the config")
    guard(_forward(model, _batch(rt.rank)), 1)
    try:
        guard(_forward(model, _batch(rt.rank, use=rt.rank == 0)), 2)
        out["plain"] = None
    except UnusedParameterError as e:
        out["plain"] = str(e)

    # static graph: step 1 decides what every step must use, on every rank alike
    static = UsageGuard(rt, model, static_graph=True, why="set in the config")
    try:
        static(_forward(model, _batch(rt.rank, use=rt.rank == 0)), 1)
        out["static_first"] = None
    except UnusedParameterError as e:
        out["static_first"] = str(e)
    static = UsageGuard(rt, model, static_graph=True, why="set in the config")
    # both leave the branch out: that is the graph
    static(_forward(model, _batch(rt.rank, use=False)), 1)
    static(_forward(model, _batch(rt.rank, use=False)), 2)
    try:
        static(_forward(model, _batch(rt.rank, use=rt.rank == 0)), 3)
        out["static_later"] = None
    except UnusedParameterError as e:
        out["static_later"] = str(e)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_ddp_cases)


def test_ddp_averages_the_ranks_gradients(two_ranks):
    for rank in two_ranks:
        assert rank["is_ddp"] and rank["grad_error"] < 1e-6
        # keeps torch's reducer quiet; never optimized or saved
        assert rank["never_used_outside_model"]


def test_guard_stops_every_rank_with_the_same_message(two_ranks):
    plain = two_ranks[0]["plain"]
    assert plain == two_ranks[1]["plain"] and plain == (
        "step 2: the loss did not reach every parameter DDP expects (rank 1: no gradient for 'branch.bias', "
        "'branch.weight'). DDP runs with find_unused_parameters=False and would wait forever for the missing "
        f"all-reduce (set in the config). Stopped before this step's gradients were all-reduced: {PLAIN_FIX}"
    )


def test_static_graph_guard_holds_every_step_to_step_1(two_ranks):
    first, later = two_ranks[0]["static_first"], two_ranks[0]["static_later"]
    assert first == two_ranks[1]["static_first"] and later == two_ranks[1]["static_later"]
    assert first.startswith(
        "step 1: the loss did not reach every parameter DDP expects (rank 1: no gradient for "
        "'branch.bias', 'branch.weight'). DDP runs with static_graph=True"
    ), first
    assert later.startswith(
        "step 3: the loss did not reach every parameter DDP expects (rank 0: a gradient for "
        "'branch.bias', 'branch.weight', which step 1 left out)"
    ), later
    assert later.endswith(
        "set parallel.static_graph: false and leave parallel.find_unused_parameters at auto, which "
        "handles parameters that some batches skip"
    )
