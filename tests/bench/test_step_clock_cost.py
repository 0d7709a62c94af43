"""bench/step_clock_cost.py on the default GPT: a row with the parameters the clock watches (every
trainable one), its cost per step and a measured training step; under FSDP and TP, the waits of a
step counted on 2 real ranks and their timing's cost."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_clock_s_cost_is_timed_against_a_real_step():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_clock_cost.py"), "--model", "default"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = re.findall(
        r"^\| default GPT \(3.2M\) \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+)% \|$", proc.stdout, re.M
    )
    watched, clock_us, step_ms, share = row
    # the 4-layer GPT: embeddings, 12 tensors a block, the final norm (the head is tied)
    assert int(watched) == 52 and int(step_ms) > 0
    # the share is the clock's time over the step's (both shown rounded)
    expected = 100 * int(clock_us) / (1000 * int(step_ms))
    assert abs(float(share) - expected) <= 0.05 * expected + 0.001
    # FSDP and TP: each wait timed (lockstep.train.collective_waits) instead of the hooks
    (per_wait,) = re.findall(r"the timing of a wait costs (\d+) ns", proc.stdout)
    rows = re.findall(
        r"^\| default GPT \(3.2M\) \| (fsdp|tp) \| (\d+) \| ([\d.]+) \| ([\d.]+)% \|$",
        proc.stdout,
        re.M,
    )
    waits = {layout: int(n) for layout, n, _, _ in rows}
    # TP: 4 blocks x (2 all-reduces forward + 2 backward); FSDP: an all-gather per unit at least
    assert waits["tp"] == 16 and waits["fsdp"] >= 5, proc.stdout
    for _, n, cost_us, _ in rows:
        assert abs(float(cost_us) - int(n) * int(per_wait) / 1000) <= 0.05 + 0.01 * float(cost_us)
