"""lockstep.plan.report: the plan's lines, and the comparison --choose prints."""

from __future__ import annotations

import re

from lockstep.plan.build import make_plan
from lockstep.plan.profiles import load_profile
from lockstep.plan.report import choice_lines, describe

from .test_build import config


def test_the_lines_of_a_plan_and_of_a_choice():
    h100 = load_profile("h100-80gb")
    ddp = make_plan(config(), 2, 8, h100, other=False)
    text = "\n".join(describe(ddp))
    assert "layout dp 2 (ddp) x tp 1 x pp 1 = world 2 on 1 node of 2" in text
    assert re.search(r"^  ddp buckets +\d+\.\d\d$", text, re.M)
    assert "activation checkpointing" not in text  # planned without its twin
    assert re.search(r"all_reduce \(gradients\) +2 ranks in a node", text)
    one = make_plan(config(**{"train.batch_size": 8}), 1, 8, h100, other=False)
    assert "communication per step: none (one replica, no shards)" in "\n".join(describe(one))
    lines = choice_lines([one, ddp], ["a refusal"])
    assert lines[0] == "layouts compared: 2 simulated, 2 fit"
    fastest = max((one, ddp), key=lambda p: p.estimate.tokens_per_s)
    assert fastest.layout.describe() in lines[1] and lines[-2] == "  refused: a refusal"
    assert lines[-1] == f"best: {fastest.settings()}"
