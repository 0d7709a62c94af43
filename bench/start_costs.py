"""Two start-up costs of a lockstep command, timed for the lockstep tree given (BENCHMARKS.md, "Command
start"): `parser`, the mean of 10 `lockstep.cli.build_parser()` calls after a first one; `probe`,
`measure_peak_flops` on the CPU timed whole, in float32 and bfloat16. Run it for an older checkout
(`git worktree add /tmp/wt_old REV`) and for `.`, alternately, to compare the two.

    .venv/bin/python bench/start_costs.py parser /tmp/wt_old
"""

import sys
import time
from pathlib import Path

what, tree = sys.argv[1], str(Path(sys.argv[2]).resolve())
# the editable install's finder answers `import lockstep` before sys.path: drop it, import from `tree`
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, tree)

if what == "parser":
    import lockstep.cli as cli

    assert cli.__file__.startswith(tree), cli.__file__
    cli.build_parser()
    start = time.perf_counter()
    for _ in range(10):
        cli.build_parser()
    print("parser", tree, round((time.perf_counter() - start) / 10 * 1000, 1), "ms")
elif what == "probe":
    import torch

    import lockstep.peak_flops as peak

    assert peak.__file__.startswith(tree), peak.__file__
    for dtype in (torch.float32, torch.bfloat16):
        start = time.perf_counter()
        flops = peak.measure_peak_flops(torch.device("cpu"), dtype)
        print(
            "probe",
            tree,
            dtype,
            round(time.perf_counter() - start, 2),
            "s",
            f"{flops / 1e9:.2f} GFLOP/s",
        )
else:
    sys.exit(f"start_costs.py: {what!r}: expected parser or probe")
