"""A 2-rank job that deadlocks on purpose, for test_watchdog (run under torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/hang_worker.py RUN_DIR STALL [healthy]

Each step beats "forward", then "allreduce", and all-reduces a tensor (a stand-in for the
gradient all-reduce). At step SKIP_STEP rank 1 takes a branch rank 0 does not: it skips the
all-reduce and waits instead in a barrier on a side group that rank 0 never enters. Both then
block for good, each in a different collective, and deterministically so: the barrier lives on
its own group (its own gloo context), so it cannot pair with rank 0's all-reduce the way two
mismatched collectives on one group can. Rank 1 never reached the all-reduce's phase, so it is
behind. The process-group timeout (120 s) is far above the stall limit: the watchdog, not gloo,
ends the run.

With "healthy", no rank goes astray and every step takes STALL / 6 s, so the whole run lasts
longer than the stall limit while each step stays well inside it: the watchdog must not fire.
"""

import datetime
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lockstep.config import DistributedConfig
from lockstep.runtime import init_runtime, shutdown_runtime
from lockstep.runtime.watchdog import Watchdog

SKIP_STEP = 3


def main() -> None:
    run_dir = Path(sys.argv[1])
    stall = float(sys.argv[2])
    healthy = sys.argv[3:] == ["healthy"]
    rt = init_runtime(DistributedConfig(device="cpu", backend="gloo", timeout_seconds=120))
    logging.basicConfig(level=logging.INFO, format=f"[rank{rt.rank}] %(levelname)s %(message)s")
    side = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=120))
    with Watchdog(rt, run_dir, stall_seconds=stall) as wd:
        for step in range(1, 11 if healthy else 6):
            wd.beat(step, "forward")
            grad = torch.full((4,), float(rt.rank))
            if healthy:
                time.sleep(stall / 6)
            elif rt.rank == 1 and step == SKIP_STEP:
                # the test times the watchdog from here
                print(f"hang begins at {time.time()}", flush=True)
                dist.barrier(group=side)  # HANG-RANK1: rank 1 waits here, rank 0 never comes
            wd.beat(step, "allreduce")
            dist.all_reduce(grad)  # HANG-RANK0: rank 0 waits here for rank 1
    print(f"rank {rt.rank} finished", flush=True)
    shutdown_runtime()  # collects the DDP/FSDP garbage first: see its docstring


if __name__ == "__main__":
    main()
