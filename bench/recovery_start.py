"""How long an attempt takes to decide where it starts and read that state, when a node's memory holds
a snapshot newer than the disk: memory first (lockstep.train.recovery.start_point: the disk checkpoint
is not read) against the order before 4ef2eb4 (verify the disk checkpoint, then the snapshot).

    python bench/recovery_start.py              # GPT-2-small-sized state (124M parameters + AdamW)
    python bench/recovery_start.py --params 20  # another size, in millions

One process, the state as a plain checkpoint (model tensors and AdamW's two moments) on this disk at
step 30 and as a snapshot under /dev/shm at step 47; each side timed 3 times, alternating, page cache
dropped before each where /proc/sys/vm/drop_caches is writable. Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lockstep.checkpoint.manifest import SNAPSHOT_MARK
from lockstep.checkpoint.memory import NodeSnapshots, fingerprint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import CheckpointConfig
from lockstep.runtime import Runtime
from lockstep.train.recovery import recover, start_point
from lockstep.train.snapshots import MemorySnapshots
from lockstep.train.state import pick_resume_point


def model_state(params_m: float) -> tuple[dict, dict]:
    """Tensors of `params_m` million parameters in 12 layers, and AdamW's state for them."""
    n = int(params_m * 1e6) // 12
    tensors = {f"layer{i}.weight": torch.randn(n) for i in range(12)}
    moments = {
        i: {"step": torch.tensor(1.0), "exp_avg": t.clone(), "exp_avg_sq": t.abs()}
        for i, t in enumerate(tensors.values())
    }
    return tensors, {"state": moments, "param_groups": [{"params": list(moments)}]}


def _drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except (
        OSError
    ):  # not root, or a container that forbids it: the disk is read from the page cache
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=124.0, help="millions of parameters")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    log = logging.getLogger("bench")
    rt = Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "bench")
    tensors, optimizer = model_state(args.params)
    with (
        tempfile.TemporaryDirectory(dir=".") as run,
        tempfile.TemporaryDirectory(dir="/dev/shm") as shm,
    ):
        disk = save_checkpoint(run, 30, tensors, optimizer, None, {"step": 30})
        node = NodeSnapshots(Path(shm), "run1", "bench")
        model = fingerprint(tensors)
        mark = {"step": 47, SNAPSHOT_MARK: node.mark(model)}
        save_checkpoint(node.root, 47, tensors, optimizer, None, mark)
        size = sum(f.stat().st_size for f in disk.iterdir())
        checkpoint = CheckpointConfig(output_dir=run)
        snapshots = MemorySnapshots(node, rt, writes=True, interval=1, model=model, log=log)

        def memory_first() -> int:
            got, _ = start_point(snapshots, checkpoint, rt, log)
            return got.state["step"]

        def disk_first() -> int:
            picked = pick_resume_point(checkpoint, rt, Path(run), log)
            return recover(snapshots, picked, checkpoint, log).state["step"]

        times: dict[str, list[float]] = {"memory first": [], "disk first (before)": []}
        for _ in range(args.reps):
            for name, fn in (("disk first (before)", disk_first), ("memory first", memory_first)):
                _drop_caches()
                began = time.perf_counter()
                assert fn() == 47
                times[name].append(time.perf_counter() - began)
    print(
        f"state: {args.params:g}M parameters + AdamW, {size / 2**30:.2f} GiB per checkpoint; "
        f"torch {torch.__version__}; `{' '.join(sys.argv)}`"
    )
    print("| order | start, median of %d (s) | each (s) |" % args.reps)
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.2f} | {', '.join(f'{x:.2f}' for x in t)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
