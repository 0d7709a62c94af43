"""What the GPU tests share: `lockstep train` on cuda as a real subprocess, what a run wrote
(metrics, log, checkpoints), a run killed with SIGKILL after a given checkpoint, and a function run
in a fresh process that holds a 1-rank NCCL group.

The CPU tests' helpers (tests/conftest.py: TINY, run_lockstep, kill_tree, wait_for) are used as they
are: a GPU test is its CPU twin with `--device cuda`.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from conftest import TINY, lockstep_cmd, run_lockstep
from procs import kill_tree, wait_for

DEVICE = "cuda"


def train_args(run: Path, corpus: Path, cache: Path, *extra: Any) -> list[str]:
    """`lockstep train` of conftest.TINY's GPT on DEVICE; flags in `extra` come last and win."""
    return [
        *("train", "--data", str(corpus), "--output-dir", str(run), "--device", DEVICE),
        *(*TINY, "--set", f"data.cache_dir={cache}", *map(str, extra)),
    ]


def train(
    run: Path, corpus: Path, cache: Path, *extra: Any, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    return run_lockstep(*train_args(run, corpus, cache, *extra), timeout=timeout, env=env)


def metrics(run: Path, split: str = "train") -> list[dict]:
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r for r in rows if r.get("split", "train") == split]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics(run) if "loss" in r]


def rank0_log(run: Path) -> str:
    return (run / "logs" / "rank0.log").read_text()


def latest_step(run: Path) -> int:
    return int((run / "checkpoints" / "latest").read_text().strip()[len("step_") :])


def checkpoint_dir(run: Path, step: int | None = None) -> Path:
    """RUN/checkpoints/step_N; the latest one without `step`."""
    return run / "checkpoints" / f"step_{latest_step(run) if step is None else step:08d}"


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    """Bit for bit: the same names, dtypes, shapes and values."""
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())[:5]}"
    for name in a:
        same = a[name].dtype == b[name].dtype and torch.equal(a[name], b[name])
        assert same, f"{name} differs: {what}"


def assert_same_state(a: Any, b: Any, what: str) -> None:
    """Nested state (an optimizer's state dict): every tensor bit for bit, other leaves equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{what}: {list(a)[:5]}, {list(b)[:5]}"
        for key in a:
            assert_same_state(a[key], b[key], f"{what}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def kill_after_checkpoint(
    args: list[str], run: Path, step: int, timeout: float = 300, env: dict | None = None
) -> int:
    """Start `lockstep ARGS` and SIGKILL it (and everything below it) once a checkpoint at `step`
    or later is committed, as tests/e2e do on the CPU; the step of the last committed checkpoint."""
    env = {**os.environ, **(env or {})}
    cmd = lockstep_cmd(*args)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    latest = run / "checkpoints" / "latest"
    try:
        done = lambda: latest.exists() and latest_step(run) >= step  # noqa: E731
        wait_for(done, timeout, f"a checkpoint at step {step}", proc)
    finally:
        kill_tree(proc)  # SIGKILL: nothing gets to clean up
    return latest_step(run)


def logged_seconds(log: str, pattern: str) -> dict[int, float]:
    """{step: seconds} from the log lines `pattern` matches (groups: the step, then the seconds)."""
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(pattern, log)}


# ------------------------------------------------------------ a 1-rank NCCL group, fresh process


def _gpu_main(rank: int, store: str, out: str, fn, args: tuple) -> None:
    import torch.distributed as dist

    from lockstep.runtime import Runtime, shutdown_runtime
    from lockstep.runtime.process_end import exit_process

    device = torch.device(DEVICE, 0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # a FileStore: one process needs no TCP rendezvous; the timeout makes a stuck call an error
    dist.init_process_group(
        backend,
        store=dist.FileStore(store, 1),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
        device_id=device if device.type == "cuda" else None,
    )
    # as lockstep's runtime does on nccl: small CPU messages (RNG states, outcomes) go over gloo
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    host = socket.gethostname()
    rt = Runtime(0, 0, 1, 1, 0, device, backend, "test", host, control_group=control)
    try:
        torch.save(fn(rt, *args), out)
    finally:
        shutdown_runtime(rt)
    exit_process(0)


def run_on_gpu(fn, *args) -> Any:
    """fn(rt, *args) in a fresh process holding a 1-rank NCCL group on GPU 0 (rt.control_group:
    gloo); its result.

    fn must be a module-level function (spawn imports it by name). A fresh process keeps the test
    process free of process groups and NCCL state, whatever fn does; an exception in it fails the
    caller with its traceback.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lockstep-gpu-") as tmp:
        args = (f"{tmp}/store", f"{tmp}/result", fn, args)
        mp.start_processes(_gpu_main, args=args, nprocs=1, start_method="spawn")
        return torch.load(f"{tmp}/result", weights_only=False)
