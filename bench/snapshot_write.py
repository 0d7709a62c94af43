"""What a memory snapshot costs the step that takes it: written in the background, as lockstep does
(the step waits for the copy of the state to host memory), against written synchronously (the step
would wait for the copy, the files, their SHA-256 and the commit).

    python bench/snapshot_write.py              # the default GPT's size (3.2M) and 124M, + AdamW
    python bench/snapshot_write.py --params 20  # one size, in millions

One process, lockstep.train.snapshots.MemorySnapshots writing into /dev/shm: "background" times
write() (it returns once the state is copied), "synchronous" times write() and settle() (which
waits for the commit); alternating, each timed --reps times after one untimed. Prints a table;
writes nothing else.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from recovery_start import model_state

from lockstep.checkpoint.memory import NodeSnapshots, fingerprint
from lockstep.runtime import Runtime
from lockstep.train.snapshots import MemorySnapshots


def _timed(params_m: float, reps: int, shm: Path) -> dict[str, list[float]]:
    rt = Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "bench")
    tensors, optimizer = model_state(params_m)
    node = NodeSnapshots(shm, "run1", "bench")
    model = fingerprint(tensors)
    log = logging.getLogger("bench")
    snapshots = MemorySnapshots(node, rt, writes=True, interval=1, model=model, log=log)
    times: dict[str, list[float]] = {"background": [], "synchronous": []}
    for step in range(2 * reps + 2):
        what = {
            "run_dir": shm,
            "step": step + 1,
            "state": {"step": step + 1},
            "extra": {},
            "keep_last": 1,
            "rng_states": None,
        }
        way = "synchronous" if step % 2 else "background"
        snapshots.settle()  # the one before is committed: each is timed alone
        began = time.perf_counter()
        snapshots.write(step + 1, what, tensors, optimizer)
        if way == "synchronous":
            assert snapshots.settle(), "the snapshot failed"
        if step >= 2:  # the first of each way warms the allocator and the tmpfs
            times[way].append(time.perf_counter() - began)
    assert snapshots.settle() and snapshots.size > 0
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, action="append", help="millions of parameters")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    print(f"torch {torch.__version__}; `{' '.join(['python', *sys.argv])}`")
    print("| state | snapshot | background, median (s) | synchronous, median (s) | each (s) |")
    print("|---|---|---|---|---|")
    for params in args.params or [3.2, 124.0]:
        with tempfile.TemporaryDirectory(prefix="lockstep-bench-", dir="/dev/shm") as shm:
            times = _timed(params, args.reps, Path(shm))
        tensors, _ = model_state(params)
        size = 3 * sum(t.numel() * t.element_size() for t in tensors.values())
        each = "; ".join(f"{way}: {', '.join(f'{x:.3f}' for x in t)}" for way, t in times.items())
        print(
            f"| {params:g}M + AdamW | {size / 2**20:.0f} MiB | "
            f"{statistics.median(times['background']):.3f} | "
            f"{statistics.median(times['synchronous']):.3f} | {each} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
