"""fp16 autocast with a GradScaler on CUDA (issue 23, item 2c): an overflow forced on chosen steps
is skipped and logged, the scaler's state goes into the checkpoint, and a run killed mid-way
resumes bit for bit.

The model is the user's own (model.kind custom): a small regression net whose loss is multiplied by
1e8 in its forward calls number 15 and 28. Scaled by the GradScaler (2**16 at first), that loss's
gradients overflow fp16 in the backward of the autocast matmuls, so those optimizer steps must be
skipped and the scale halved. Its forward count is a buffer, saved in the checkpoint like the
weights: a resumed run boosts the same steps as one that was never stopped. One forward per step
(batch 8, one micro-batch; the data factory returns no evaluation set).

Checked on the CPU with torch.autocast('cpu', float16) and GradScaler('cpu') on the same model and
data: steps 15 and 28 alone are skipped, the scale goes 2**16 -> 2**15 -> 2**14.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lockstep.checkpoint.open import load_checkpoint

from .runs import (
    DEVICE,
    assert_same_state,
    assert_same_tensors,
    checkpoint_dir,
    metrics,
    rank0_log,
    run_lockstep,
)

BOOSTED = (15, 28)
# killed in forward 25: the last commit is step 20, between the two overflows
STEPS, SAVE_EVERY, KILL_AT = 40, 10, 25

MODEL = """
    import os
    import signal

    import torch
    from torch import nn

    BOOSTED = {boosted}


    class Boosted(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32))
            # saved in the checkpoint with the weights
            self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))

        def forward(self, x, y):
            if self.training:
                self.forwards += 1
                if int(self.forwards) == int(os.environ.get("KILL_AT", "0")):
                    os.kill(os.getpid(), signal.SIGKILL)  # a lost node: nothing cleans up
            loss = ((self.net(x).float() - y) ** 2).mean()
            boosted = self.training and int(self.forwards) in BOOSTED
            return loss * 1e8 if boosted else loss


    def build_model():
        return Boosted()


    def build_data():
        g = torch.Generator().manual_seed(0)
        x = [torch.randn(16, generator=g) for _ in range(512)]
        return [{{"x": v, "y": 0.5 * torch.randn(32, generator=g)}} for v in x]
"""


def _train(tmp_path: Path, run: Path, check: bool = True, **env: str):
    (tmp_path / "boosted_model.py").write_text(textwrap.dedent(MODEL.format(boosted=BOOSTED)))
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return run_lockstep(
        *("train", "--model-kind", "custom", "--set", "model.factory=boosted_model:build_model"),
        *("--data-kind", "custom", "--set", "data.factory=boosted_model:build_data"),
        *("--device", DEVICE, "--mixed-precision", "fp16", "--output-dir", run),
        *("--max-steps", STEPS, "--save-interval", SAVE_EVERY, "--keep-last", "5"),
        *"--global-batch-size 8 --log-interval 1 --learning-rate 1e-3 --warmup-steps 2".split(),
        *"--set data.num_workers=0".split(),
        env={"PYTHONPATH": path, **env},
        check=check,
        timeout=300,
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fp16")
    run = tmp / "straight"
    _train(tmp, run)
    return run


def test_the_overflowing_steps_are_skipped_logged_and_halve_the_scale(straight):
    rows = {r["step"]: r for r in metrics(straight)}
    assert sorted(rows) == list(range(1, STEPS + 1))
    # only the forced overflows: none of the others overflows at 2**16
    skipped = {step for step, r in rows.items() if r["skipped_steps"]}
    assert skipped == set(BOOSTED), skipped
    assert all(rows[s]["skipped_steps"] == 1 for s in BOOSTED)
    # each skip halves the scale (GradScaler's backoff 0.5); growing it takes 2000 good steps
    for s in BOOSTED:
        before, after = rows[s - 1]["loss_scale"], rows[s + 1]["loss_scale"]
        assert before == 2 * after, (s, before, after)
    assert rows[1]["loss_scale"] == 2.0**16 and rows[STEPS]["loss_scale"] == 2.0**14
    lines = rank0_log(straight).splitlines()
    warned = [x for x in lines if " WARNING " in x and "skipped" in x and "overflow" in x]
    assert len(warned) == len(BOOSTED), warned
    assert all(f"step {s} skipped" in x for s, x in zip(BOOSTED, warned)), warned
    normal = [r["loss"] for step, r in rows.items() if step not in BOOSTED]
    assert normal[-1] < normal[0], normal  # the other steps trained


def test_the_scalers_state_is_in_the_checkpoint(straight):
    for step, scale in ((10, 2.0**16), (20, 2.0**15), (40, 2.0**14)):
        state = json.loads((checkpoint_dir(straight, step) / "state.json").read_text())
        scaler = state["grad_scaler"]
        assert scaler["scale"] == scale, (step, scaler)
        assert scaler["growth_interval"] == 2000 and scaler["backoff_factor"] == 0.5, scaler
    weights = load_file(checkpoint_dir(straight, 40) / "model.safetensors")
    assert int(weights["forwards"]) == STEPS


def test_killed_and_resumed_fp16_run_equals_the_uninterrupted_one(straight, tmp_path):
    broken = tmp_path / "broken"
    proc = _train(tmp_path, broken, check=False, KILL_AT=str(KILL_AT))
    assert proc.returncode == -9, proc.stderr[-3000:]  # SIGKILL, from inside forward 25
    assert checkpoint_dir(broken).name == "step_00000020"
    resumed = _train(tmp_path, broken)
    assert f"resumed from {checkpoint_dir(broken, 20)}" in resumed.stderr
    # 2**15 restored at step 20, halved again at step 28
    state = json.loads((checkpoint_dir(broken, 40) / "state.json").read_text())
    assert state["grad_scaler"]["scale"] == 2.0**14
    a = load_checkpoint(checkpoint_dir(straight, 40))
    b = load_checkpoint(checkpoint_dir(broken, 40))
    assert_same_tensors(a.tensors, b.tensors, "fp16 run killed after step 20 and resumed")
    assert_same_state(a.optimizer_state, b.optimizer_state, "optimizer")
    again = {r["step"]: r for r in metrics(broken) if r["step"] > 20}  # the resumed run's lines
    assert again[28]["skipped_steps"] == 1 and again[29]["loss_scale"] == 2.0**14


def test_fp16_on_cuda_gets_a_grad_scaler():
    import torch

    from lockstep.train.step import build_autocast, build_grad_scaler

    scaler = build_grad_scaler("fp16", torch.device("cuda"))
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    with build_autocast("fp16", torch.device("cuda")):
        a, b = torch.randn(4, 4, device="cuda"), torch.randn(4, 4, device="cuda")
        assert (a @ b).dtype == torch.float16
