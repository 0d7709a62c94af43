"""bench/step_clock_cost.py on the default GPT: a row with the parameters the clock watches (every
trainable one), its cost per step and a measured training step."""

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
