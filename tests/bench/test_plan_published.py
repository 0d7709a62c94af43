"""bench/plan_published.py's quick mode: a 2-layer Llama 3 planned as torchtitan's H100 run, its row
holding the published figures beside the plan's, the ratio the plan's own numbers make."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_is_set_beside_torchtitan_s_figures():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan_published.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = re.findall(
        r"^\| Llama 3.1 8B, FSDP x 8, batch 2 on h100-80gb \| 5,762 \| ([\d,]+) \(([\d.]+)x\) \| "
        r"([\d.]+)% \| 82.4 \| ([\d.]+) / ([\d.]+) \| Table 1 \|$",
        proc.stdout,
        re.M,
    )
    per_gpu, ratio, mfu, with_ac, without_ac = row
    assert abs(float(ratio) - int(per_gpu.replace(",", "")) / 5762) <= 0.006
    assert 0 < float(mfu) < 100 and 0 < float(with_ac) < float(without_ac)
