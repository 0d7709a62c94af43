"""lockstep.models.loss: the two rules of a workload's Loss, on a model whose losses are known in advance."""

from __future__ import annotations

import pytest
import torch

from lockstep.models.loss import Loss


class Weight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))


def test_the_mean_rule_calls_the_function_as_it_is_and_ignores_a_divisor():
    calls = []

    def forward(model, batch):  # two arguments: a user's loss function of (model, batch)
        calls.append(batch)
        return model.w * batch

    loss = Loss(forward)
    assert not loss.token_weighted and loss.count_targets is None
    assert loss(Weight(), torch.tensor(3.0)).item() == 6.0
    # a step's count means nothing to a mean
    assert loss(Weight(), torch.tensor(3.0), 7).item() == 6.0
    assert len(calls) == 2


def test_token_weighted_divides_a_batchs_sum_by_the_steps_count_or_its_own():
    # per-target loss `v` on each of the batch's n targets, summed, over divisor
    def summed(model, batch, divisor):
        return batch["v"] * batch["n"] * model.w / divisor

    loss = Loss(summed, lambda batch: batch["n"])
    assert loss.token_weighted
    batch = {"v": torch.tensor(1.5), "n": 4}
    # with the step's 10 targets; alone (the DDP check), its own 4: its per-target mean
    assert loss(Weight(), batch, 10).item() == pytest.approx(1.5 * 4 * 2 / 10)
    assert loss(Weight(), batch).item() == 1.5 * 2
    empty = {"v": torch.tensor(1.5), "n": 0}
    assert loss(Weight(), empty).item() == 0.0  # no targets: divided by 1, not 0 (no NaN)
