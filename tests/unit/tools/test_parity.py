"""lockstep/tools/parity.py without the runs (those: tests/e2e/test_parity.py): the per-step losses read from a
run's metrics.jsonl as the trainer writes it, the differences, the verdict against the tolerance, and the report."""

from __future__ import annotations

import math

import pytest

from lockstep.metrics import MetricsWriter
from lockstep.tools.parity import ParityReport, ParityStep, _step_losses


def test_step_losses_are_the_train_losses_of_a_run(tmp_path):
    writer = MetricsWriter(tmp_path, is_main=True, total_steps=3, tensorboard=False, progress=False)
    writer.log(1, {"loss": 2.5, "lr": 1e-3})
    writer.log(2, {"loss": 2.25, "tokens_per_s": 900.0})
    writer.log(2, {"loss": 9.0}, split="eval")  # an evaluation: not a training step's loss
    writer.log(3, {"lr": 1e-3})  # no loss logged at this step
    writer.close()
    assert _step_losses(tmp_path) == {1: 2.5, 2: 2.25}


def test_differences_and_the_verdict():
    step = ParityStep(4, reference=2.0, parallel=2.0005)
    assert step.abs_diff == pytest.approx(5e-4) and step.rel_diff == pytest.approx(2.5e-4)
    assert ParityStep(1, reference=0.0, parallel=1e-13).rel_diff == pytest.approx(0.1)  # no division by zero
    steps = [ParityStep(1, 3.0, 3.0), step]
    assert ParityReport(2, "ddp", steps, tolerance=1e-3).ok
    assert ParityReport(2, "ddp", steps, tolerance=1e-3).max_rel_diff == pytest.approx(2.5e-4)
    assert not ParityReport(2, "ddp", steps, tolerance=1e-4).ok
    empty = ParityReport(2, "ddp", [], tolerance=1.0)  # no step in common: nothing was compared
    assert empty.max_rel_diff == math.inf and not empty.ok


def test_report_lines():
    report = ParityReport(4, "fsdp(4)", [ParityStep(1, 3.0, 3.0), ParityStep(2, 2.0, 2.0005)], tolerance=1e-4)
    assert report.format().splitlines() == [
        "parity: 1 process vs 4 (fsdp(4)), 2 steps",
        "step  loss (1 proc)  loss (N procs)  abs diff   rel diff",
        "   1       3.000000        3.000000  0.00e+00  0.00e+00",
        "   2       2.000000        2.000500  5.00e-04  2.50e-04",
        "max relative difference 2.50e-04: OUTSIDE the tolerance 0.0001",
    ]
