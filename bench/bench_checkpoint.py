"""Checkpoint saves, sync vs async: the step-time stall of a save on a 124M-parameter GPT, side by side in one run.

    python bench/bench_checkpoint.py                         # 1 process, 2 DDP processes (~8 min); rewrites BENCHMARKS.md
    python bench/bench_checkpoint.py --nproc 1 --reps 1 --out -   # quick: print only

One training run per process count, on lockstep's own Trainee (lockstep.train.setup's builders, the GPT-2-small shape: 12 layers,
768 wide, 12 heads, vocab 50304, 124M parameters; fp32, AdamW, global batch 2 x 64 tokens). Two Checkpointers
share it, one synchronous and one with checkpoint.async_save, and take turns: each repetition saves once with
each (the order alternating), and before each save the run trains --baseline steps with nothing being written.
Per save it records

- the stall: how long checkpointer.save() held the step path (sync: the whole commit; async: the copy to host
  memory, after the RNG gather),
- the step with the save against the median step with nothing written,
- the time the steps after it took above that median (--after of them, more while the background write lasts:
  it shares the CPU with training), plus any wait left at finish(),
- the write time: sync = the stall; async = lockstep.checkpoint.background's call of save_checkpoint, timed in
  the background thread (write, fsync, hash, manifest, rename, `latest`, prune),

and the committed checkpoint's size. With 2 processes every rank times itself and the larger value counts (the
other rank waits for rank 0, the writer, at the save's broadcast or the next gradient all-reduce).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_train import ROOT, ForeignLoad, _child_env, emit_section, machine_info, wait_quiet

BEGIN = "<!-- bench_checkpoint:begin (written by bench/bench_checkpoint.py; edits between the markers are replaced) -->"
END = "<!-- bench_checkpoint:end -->"
MODEL = {
    "model.vocab_size": 50304,
    "model.hidden_size": 768,
    "model.attention_heads": 12,
    "model.layers": 12,
    "model.max_seq_length": 64,
}


# ----------------------------------------------------------------------------- one training run (every rank)


def _config(run_dir: Path, cache: Path):
    from lockstep.config import load_config

    return load_config(
        None,
        {
            **MODEL,
            "train.batch_size": 2,
            "train.max_steps": 10_000,
            "train.mixed_precision": "no",
            "train.peak_flops": 1e12,
            "train.sample_tokens": 0,
            "data.max_bytes": 1_000_000,
            "data.num_workers": 0,
            "data.cache_dir": str(cache),
            "distributed.device": "cpu",
            "checkpoint.output_dir": str(run_dir),
            "checkpoint.keep_last": 2,
        },
    )


def _timed_background_writes(rank: int) -> list[float]:
    """Seconds each background write took (rank 0's save_checkpoint call in the writer thread)."""
    import lockstep.checkpoint.background as background

    seconds: list[float] = []
    real = background.save_checkpoint

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    background.save_checkpoint = timed
    return seconds


def run_rank(rt, work: str, reps: int, baseline: int, after: int) -> list[dict] | None:
    """This rank's measurements, one dict per save; gathered to rank 0, which returns them (others None)."""

    from lockstep.collectives import all_reduce_max, gather_objects
    from lockstep.data.sampler import Cursor
    from lockstep.train.checkpointer import Checkpointer
    from lockstep.train.loop import StopRequest
    from lockstep.train.setup import build_batches, build_layout_and_workload, build_trainee

    log = logging.getLogger("bench.checkpoint")
    cfg = _config(Path(work) / "run", Path(work) / "cache")
    layout, plan, wl = build_layout_and_workload(cfg, rt, log)
    trainee = build_trainee(cfg, rt, wl, layout, plan)
    batches = build_batches(cfg, trainee, Cursor(), 0)
    trainee.wrap_ddp(batches, cfg.parallel, None, log)
    writes = _timed_background_writes(rt.rank)
    stop = StopRequest()
    step_no = 0

    def step(background: Checkpointer) -> float:
        nonlocal step_no
        start = time.perf_counter()
        trainee.step(batches.next_step(), step_no + 1)  # the optimizer's step and the schedule's
        # the loop's per-step all-reduce, which carries a failed save
        stop.agreed(rt, background.failed())
        step_no += 1
        return time.perf_counter() - start

    rows = []
    sync_cp = Checkpointer(trainee, batches, cfg, None, log)
    in_background = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, async_save=True)
    )
    with Checkpointer(trainee, batches, in_background, None, log) as async_cp:
        for _ in range(3):  # warm-up: allocator, first optimizer step
            step(async_cp)
        for rep in range(reps):
            for mode in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):
                checkpointer = async_cp if mode == "async" else sync_cp
                plain = [step(async_cp) for _ in range(baseline)]
                start = time.perf_counter()
                step(async_cp)
                saved = time.perf_counter()
                checkpointer.save(step_no)
                stall, with_save = time.perf_counter() - saved, time.perf_counter() - start
                written = len(writes)
                later = [step(async_cp) for _ in range(after)]
                while (
                    mode == "async"
                    and all_reduce_max(rt, float(rt.is_main and len(writes) == written))
                    and len(later) < 200
                ):
                    # until the background write has ended (rank 0 knows)
                    later.append(step(async_cp))
                finishing = time.perf_counter()
                checkpointer.finish()
                rows.append(
                    {
                        "mode": mode,
                        "plain": plain,
                        "stall": stall,
                        "with_save": with_save,
                        "after": later,
                        "finish_wait": time.perf_counter() - finishing,
                        "write": (writes[-1] if mode == "async" else stall) if rt.is_main else 0.0,
                        "bytes": _size(checkpointer.committed) if rt.is_main else 0,
                    }
                )
                all_reduce_max(rt, 0.0)  # both ranks start the next block together
    gathered = gather_objects(rt, rows)
    return gathered if rt.is_main else None


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def _rank_main(rank: int, world: int, port: int, work: str, args: tuple, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from lockstep.runtime import Runtime, shutdown_runtime

    torch.set_num_threads(1)  # 2 processes on 2 cores: lockstep's cores // local_world_size
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )
    rt = Runtime(
        rank,
        rank,
        world,
        world,
        0,
        torch.device("cpu"),
        "gloo",
        "bench",
        "h",
        control_group=dist.group.WORLD,
    )
    try:
        result = run_rank(rt, work, *args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        shutdown_runtime(rt)


def worker(nproc: int, work: str, reps: int, baseline: int, after: int, out: str) -> None:
    """The run of one process count (a child of the bench: its CPU time is not foreign load)."""
    import torch

    args = (reps, baseline, after)
    if nproc == 1:
        from lockstep.runtime import Runtime

        rt = Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "h")
        Path(out).write_text(json.dumps(run_rank(rt, work, *args)))
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(
        _rank_main, args=(nproc, port, work, args, out), nprocs=nproc, start_method="spawn"
    )


# ----------------------------------------------------------------------------- the bench


def _combine(per_rank: list[list[dict]]) -> list[dict]:
    """One row per save: every rank's value of a time, the larger one; rank 0's write time and size. The plain
    step: the median of every step with nothing written, over the whole run (one block's few steps are noisy)."""
    base = max(statistics.median(t for save in saves for t in save["plain"]) for saves in per_rank)
    rows = []
    for saves in zip(*per_rank):
        first = saves[0]
        rows.append(
            {
                "mode": first["mode"],
                "stall": max(r["stall"] for r in saves),
                "with_save": max(r["with_save"] for r in saves),
                "base": base,
                "after_steps": len(first["after"]),
                "after_extra": max(
                    sum(t - base for t in r["after"]) + r["finish_wait"] for r in saves
                ),
                "write": first["write"],
                "bytes": first["bytes"],
            }
        )
    return rows


def _med_range(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def render(
    results: dict[int, list[dict]], foreign: dict[int, float], info: dict, args, command: str
) -> str:
    lines = [
        BEGIN,
        "## Checkpoint saves: sync vs async",
        "",
        f"- date: {info['date']}; `{command}`; lockstep at `{info['commit']}`",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); torch {info['torch']}, "
        f"Python {info['python']}; checkpoints on the local disk (fsynced)",
        "- model: the built-in GPT at GPT-2-small shape (12 layers, 768 wide, 12 heads, vocab 50304; 124M parameters), "
        f"fp32, AdamW; global batch 2 x {MODEL['model.max_seq_length']} tokens; 1 process = torch's default threads, "
        "2 processes = DDP over gloo, 1 thread each; both checkpointers in one run, taking turns",
        f"- per save: {args.baseline} steps with nothing written first (their median is the plain step), then the "
        f"step with the save, then {args.after} steps (more while a background write lasts); {args.reps} saves of each "
        "kind, medians (min-max)",
        "- stall = how long `Checkpointer.save` held the step path; next steps = the time the following steps took "
        "above the plain step, plus any wait left at `finish()` (the background write shares the 2 cores with "
        "training); write = the whole commit (sync: the stall; async: the background thread's write, fsync, "
        "hashes, manifest, rename, `latest`)",
        "",
        "| processes | save | stall (s) | step with the save / plain step | next steps' extra time (s) | write (s) "
        "| checkpoint | foreign load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for nproc, rows in results.items():
        stalls = {}
        for mode in ("sync", "async"):
            mine = [r for r in rows if r["mode"] == mode]
            stalls[mode] = statistics.median(r["stall"] for r in mine)
            lines.append(
                f"| {nproc} | {mode} | {_med_range([r['stall'] for r in mine])} | "
                f"{_med_range([r['with_save'] / r['base'] for r in mine], '{:.1f}')} (plain "
                f"{statistics.median(r['base'] for r in mine):.2f} s) | {_med_range([r['after_extra'] for r in mine])} | "
                f"{_med_range([r['write'] for r in mine])} | {statistics.median(r['bytes'] for r in mine) / 1e9:.2f} GB "
                f"| {100 * foreign[nproc]:.0f}% |"
            )
        ratios.append(
            f"{nproc} process{'es' if nproc > 1 else ''}: async stall = "
            f"{stalls['async'] / stalls['sync']:.3f} x sync ({stalls['sync'] / stalls['async']:.0f}x shorter)"
        )
    lines += [
        "",
        "Stall ratio (medians): "
        + "; ".join(ratios)
        + ". Foreign load = share of the CPUs that other "
        "processes used during the run.",
        "",
        END,
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--nproc", type=int, nargs="+", default=[1, 2], help="process counts to run (default 1 2)"
    )
    p.add_argument("--reps", type=int, default=3, help="saves of each kind per run")
    p.add_argument(
        "--baseline", type=int, default=3, help="steps with nothing written before each save"
    )
    p.add_argument("--after", type=int, default=8, help="steps timed after each save")
    p.add_argument(
        "--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file, or - to print only"
    )
    p.add_argument("--worker", nargs=2, metavar=("NPROC", "WORK"), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(
            int(args.worker[0]), args.worker[1], args.reps, args.baseline, args.after, args.result
        )
        return
    info = machine_info()
    results, foreign = {}, {}
    for nproc in args.nproc:
        with tempfile.TemporaryDirectory(prefix="lockstep-bench-ckpt-") as work:
            out = Path(work) / "result.json"
            wait_quiet(limit=0.15, max_wait=600)
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                str(nproc),
                work,
                "--reps",
                str(args.reps),
                "--baseline",
                str(args.baseline),
                "--after",
                str(args.after),
                "--result",
                str(out),
            ]
            with ForeignLoad() as load:
                subprocess.run(cmd, env=_child_env(), check=True, cwd=ROOT)
            foreign[nproc] = load.share
            results[nproc] = _combine(json.loads(out.read_text()))
            print(
                json.dumps({"nproc": nproc, "rows": results[nproc], "foreign": load.share}),
                flush=True,
            )
    command = "python bench/bench_checkpoint.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    emit_section(render(results, foreign, info, args, command.strip()), args.out, BEGIN, END)


if __name__ == "__main__":
    main()
