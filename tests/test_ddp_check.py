"""The DDP check's choice, its dry run leaving no trace, and the gradient-hash comparison on a real gloo group."""

from __future__ import annotations

import contextlib
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lockstep.config import ParallelConfig
from lockstep.parallel.ddp import apply_ddp
from lockstep.parallel.ddp_check import (GradientDivergence, UsageReport, check_gradients_agree, choose_ddp_options,
                                         find_unused_parameters, gradient_digests)
from lockstep.runtime import Runtime


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.branch, self.frozen = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.frozen(self.trunk(x))
        return (self.branch(h) if use_branch else h).square().mean()


def _forward(model, batch):
    x, use = batch
    return model(x, use)


def test_find_unused_parameters_reports_per_step_and_leaves_no_trace():
    torch.manual_seed(0)
    model = Branchy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = [[(torch.randn(2, 4), True), (torch.randn(2, 4), True)], [(torch.randn(2, 4), False)],
             [(torch.randn(2, 4), False), (torch.randn(2, 4), True)]]
    torch.manual_seed(5)
    expected_next = torch.rand(3)
    torch.manual_seed(5)
    unused = find_unused_parameters(model, steps, _forward, contextlib.nullcontext())
    # frozen parameters are not DDP's concern; a micro-batch that takes the branch makes the step use it
    assert unused == [[], ["branch.bias", "branch.weight"], []]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.rand(3), expected_next)  # the RNG stream is where it was


@pytest.mark.parametrize("unused, expect", [
    ([[[], []], [[], []]], (False, False)),
    ([[["b"], ["b"]], [["b"], ["b"]]], (False, True)),  # the same set everywhere: static graph
    ([[["b"], []], [["b"], ["b"]]], (True, False)),  # changes between steps
    ([[[], []], [["b"], ["b"]]], (True, False)),  # differs between ranks
])
def test_choice_follows_what_the_check_saw(unused, expect):
    choice = choose_ddp_options(UsageReport(2, 4, unused), ParallelConfig())
    assert (choice.find_unused_parameters, choice.static_graph) == expect
    forced = choose_ddp_options(UsageReport(2, 4, unused), ParallelConfig(find_unused_parameters="true",
                                                                          static_graph="false"))
    assert (forced.find_unused_parameters, forced.static_graph) == (True, False)
    assert "set in the config" in forced.reason


def test_report_names_rank_step_and_parameters():
    text = UsageReport(2, 7, [[["a.w"], []], [["a.w", "b.w"], []]]).format()
    assert "rank 1 step 1: a.w, b.w" in text and "rank 0 step 2: (none)" in text
    assert "received a gradient" in UsageReport(1, 7, [[[]], [[]]]).format()


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rt = Runtime(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0,
                 device=torch.device("cpu"), backend="gloo", launcher="manual", hostname="h",
                 control_group=dist.group.WORLD)
    try:
        torch.manual_seed(0)
        model = Branchy()
        ddp = apply_ddp(model, rt, find_unused_parameters=True)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))  # each rank its own data
        ddp(x, rank == 0).backward()  # the branch runs on rank 0 only
        check_gradients_agree(rt, model, 1)  # DDP averaged everything, the unused branch included
        ok_digests = gradient_digests(model)
        model.zero_grad()
        # a parameter hidden from DDP keeps each rank's own gradient: the check must name it
        torch.manual_seed(0)
        model = Branchy()
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["trunk.bias"])
        ddp = apply_ddp(model, rt)
        ddp(x, True).backward()
        try:
            check_gradients_agree(rt, model, 7)
            message = None
        except GradientDivergence as e:
            message = str(e)
        results[rank] = (ok_digests, message)
    finally:
        dist.destroy_process_group()


def test_gradient_hashes_agree_under_ddp_and_name_a_parameter_ddp_skipped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(port, results), nprocs=2)
    (digests0, message0), (digests1, message1) = results[0], results[1]
    assert digests0 == digests1 and len(digests0) == 4  # trunk + branch, weight and bias; frozen has none
    assert message0 == message1
    assert message0.startswith("step 7: the gradient of 'trunk.bias' differs between ranks"), message0
