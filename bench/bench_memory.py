"""In-memory snapshots: what they cost a step, what they hold per node, and what they save when a worker or a
node is lost, against the disk-only recovery (checkpoint.memory_interval=0), side by side in one run.

    python bench/bench_memory.py                     # overhead and recovery (~15 min); rewrites BENCHMARKS.md
    python bench/bench_memory.py --quick --out -     # fewer steps and scenarios: print only
    python bench/bench_memory.py --layout fsdp       # the same under FSDP (its own section, ~15 min)

Overhead: whole `lockstep launch` runs of the default GPT (4 x 256, 128 tokens) and the GPT-2-small shape
(124M parameters), 1 and 2 processes, with snapshots off, at every step, and at auto's interval, in turns; the
step time is the median gap between consecutive metrics.jsonl records after the first 3 steps.

Recovery: the default GPT with 90 steps and disk checkpoints every 30, a failure at a random step between the
first two, on one node (a worker SIGKILLed; 2 processes, --max-restarts 1) and on three network-namespace
nodes (tests/netns.py) whose rendezvous `lockstep rendezvous` serves from a fourth namespace: a node's
agent and workers killed, node 0's, two nodes one after the other (1:3 nodes), and a node that comes back.
Each node's memory is a tmpfs in a mount namespace of its own, gone with the node. Recovery time: from the
kill to the first step logged after it; steps trained again: steps metrics.jsonl logs twice.

--layout fsdp: 2 processes only, and the first three failures: every rank writes its shards, and each
node's are copied to the next node (lockstep.checkpoint.memory_shards).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench_train import ROOT, emit_section, machine_info

sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402  (tests/netns.py: namespaces on one switch)

MARKERS = {
    layout: (
        f"<!-- bench_memory{tag}:begin (written by bench/bench_memory.py{flag}; edits between the "
        "markers are replaced) -->",
        f"<!-- bench_memory{tag}:end -->",
    )
    for layout, tag, flag in (("ddp", "", ""), ("fsdp", "_fsdp", " --layout fsdp"))
}
LOCKSTEP = [sys.executable, "-m", "lockstep"]
GPT124M = {
    "model.vocab_size": 50304,
    "model.hidden_size": 768,
    "model.attention_heads": 12,
    "model.layers": 12,
    "model.max_seq_length": 64,
    "train.batch_size": 2,
}


def _config(path: Path, run: Path, memory: Path, steps: int, sets: dict) -> Path:
    base = {
        "train.max_steps": steps,
        "train.log_interval": 1,
        "train.sample_tokens": 0,
        "train.eval_interval": 0,
        "train.eval_batches": 1,
        "data.num_workers": 0,
        "checkpoint.output_dir": str(run),
        "checkpoint.memory_dir": str(memory),
        "checkpoint.keep_last": 2,
        **sets,
    }
    tree: dict = {}
    for key, value in base.items():
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = value
    path.write_text(json.dumps(tree))  # YAML reads JSON
    return path


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("split") == "train":
            out.append(record)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    pids = [proc.pid]
    # breadth-first over /proc: torch's agent starts workers in sessions of their own
    for pid in pids:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                        pids.append(int(entry.name))
                except (OSError, IndexError, ValueError):
                    pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


# ---------------------------------------------------------------------------------------------- overhead


def overhead(work: Path, model: str, nproc: int, steps: int, reps: int, layout: dict) -> dict:
    """Median step time (s) with snapshots off / every step / auto, each in `reps` turns; auto's interval."""
    sets = {"checkpoint.save_interval": 0, **(GPT124M if model == "124M" else {}), **layout}
    work.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {"off": [], "every step": [], "auto": []}
    auto_k, size = None, None
    for rep in range(reps):
        for mode, interval in (("off", 0), ("every step", 1), ("auto", "auto")):
            run = work / f"{model}-{nproc}-{mode}-{rep}".replace(" ", "_")
            cfg = _config(run.with_suffix(".yaml"), run, work / "shm", steps, sets)
            cmd = [*LOCKSTEP, "launch", str(cfg), "--nproc", str(nproc)]
            cmd += ["--set", f"checkpoint.memory_interval={interval}"]
            if mode == "auto":  # auto takes snapshots only where a restart can read them
                cmd += ["--max-restarts", "1"]
            subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=work)
            stamps = [r["time"] for r in _records(run)][3:]
            times[mode].append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
            log = (run / "logs" / "rank0.log").read_text()
            if m := re.search(
                r"memory snapshots: every (\d+) step\(s\) .*?; ([\d.]+) MiB per node", log
            ):
                auto_k, size = int(m[1]), float(m[2])
    median = {mode: statistics.median(values) for mode, values in times.items()}
    return {
        "model": model,
        "nproc": nproc,
        "step_s": median,
        "overhead": {m: median[m] / median["off"] - 1 for m in ("every step", "auto")},
        "auto_k": auto_k,
        "snapshot_mib": size,
    }


# ---------------------------------------------------------------------------------------------- recovery


def _launch(
    cfg: Path, extra: list[str], ns: str | None, host: str, memory: Path
) -> subprocess.Popen:
    cmd = [*LOCKSTEP, "launch", str(cfg), *extra]
    if ns is None:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return subprocess.Popen(
        netns.node_argv(ns, cmd, host, memory),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def _last_step(run: Path) -> int:
    records = _records(run)
    return records[-1]["step"] if records else 0


def _restarted(run: Path, since: float) -> float | None:
    """When the first step after the restart was logged: the first record after `since` that follows a
    pause of a second or more (a step of these runs takes well under one; a restart, seconds)."""
    records = _records(run)
    for before, record in zip(records, records[1:]):
        if record["time"] > since and record["time"] - before["time"] >= 1.0:
            return record["time"]
    return None


def recovery(
    work: Path, scenario: str, memory_on: bool, steps: int, every: int, seed: int, sets: dict
) -> dict:
    """One failure in one run with the settings `sets`; what it cost."""
    run, memory = work / "run", work / "shm"
    memory.mkdir(parents=True, exist_ok=True)
    sets = {
        **sets,
        "checkpoint.save_interval": every,
        "checkpoint.memory_interval": 1 if memory_on else 0,
    }
    if scenario != "worker":  # 12 samples a step: 2 or 3 ranks x micro-batches of 2
        sets |= {"train.batch_size": 12, "train.micro_batch_size": 2}
    cfg = _config(work / "c.yaml", run, memory, steps, sets)
    kill_at = random.Random(seed).randint(every + 5, 2 * every - 8)
    procs: list[subprocess.Popen] = []
    store = None
    switch = netns.switched_nodes(4) if scenario != "worker" else None
    try:
        if switch is None:
            procs = [_launch(cfg, ["--nproc", "2", "--max-restarts", "1"], None, "", memory)]
        else:
            store_host, *nodes = switch.__enter__()
            endpoint = f"{store_host.addr}:29400"
            store = subprocess.Popen(
                netns.node_argv(
                    store_host.ns, [*LOCKSTEP, "rendezvous", "--host", store_host.addr]
                ),
                stdout=subprocess.DEVNULL,
            )
            low = "1" if scenario == "two nodes, one after the other" else "2"
            extra = [
                "--nnodes",
                f"{low}:3",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-store",
                "external",
            ]
            extra += ["--rdzv-conf", "last_call_timeout=3", "--rdzv-conf", "keep_alive_interval=1"]
            procs = [_launch(cfg, extra, n.ns, f"node{i}", memory) for i, n in enumerate(nodes)]
        _wait(lambda: _last_step(run) >= kill_at, 600, f"step {kill_at}")
        killed_at_step, kill_time = _last_step(run), time.time()
        if scenario == "worker":
            pid = int(re.findall(r"\(pid (\d+)\)", (run / "logs" / "rank1.log").read_text())[-1])
            os.kill(pid, signal.SIGKILL)
        else:
            _kill_tree(procs[0 if scenario == "node 0" else 2])
        _wait(lambda: _restarted(run, kill_time) is not None, 600, "a step after the restart")
        back = _restarted(run, kill_time)
        if scenario == "two nodes, one after the other":
            second = time.time()
            _wait(lambda: _last_step(run) >= killed_at_step + 5, 600, "5 more steps")
            _kill_tree(procs[1])
            _wait(lambda: any(r["time"] > second + 0.5 for r in _records(run)), 600, "a step after")
        if scenario == "a node that comes back":
            _wait(lambda: _last_step(run) >= killed_at_step + 5, 600, "5 more steps")
            procs[2] = _launch(cfg, extra, nodes[2].ns, "node2", memory)
        survivors = [p for i, p in enumerate(procs) if p.poll() is None]
        for p in survivors:
            p.wait(timeout=900)
        log = (run / "logs" / "rank0.log").read_text()
    finally:
        for p in [*procs, *([store] if store else [])]:
            if p.poll() is None:
                _kill_tree(p)
        if switch is not None:
            switch.__exit__(None, None, None)
    records = _records(run)
    logged = Counter(r["step"] for r in records)
    step_s = statistics.median(b["time"] - a["time"] for a, b in zip(records, records[1:]))
    resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", log)]
    return {
        "scenario": scenario,
        "memory": memory_on,
        "killed_after": killed_at_step,
        "resumed_at": resumed[0] if resumed else 0,
        "again": sum(n - 1 for n in logged.values()),
        "recovery_s": back - kill_time,
        "lost_s": back - kill_time + step_s * sum(n - 1 for n in logged.values()),
        "from_memory": "recovery: from memory" in log,
        "sent": bool(re.search(r"; sent to node", log)),
        "finished": _last_step(run) == steps,
    }


SCENARIOS = ("worker", "node", "node 0", "two nodes, one after the other", "a node that comes back")


def render(over: list[dict], rec: list[dict], info: dict, command: str, layout: str) -> str:
    lines = [
        MARKERS[layout][0],
        "### In-memory snapshots: overhead and recovery"
        + (" under FSDP" if layout == "fsdp" else ""),
        "",
        f"`{command}` on {info['cpu']} ({info['isa']}), torch {info['torch']}, commit {info['commit']}, "
        f"{info['date']}. The ratios are from the same run, side by side.",
        "",
        "| model | processes | step, off (s) | every step | auto | auto's interval | snapshot per node |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in over:
        s, x = o["step_s"], o["overhead"]
        lines.append(
            f"| {o['model']} | {o['nproc']} | {s['off']:.3f} | {s['every step']:.3f} "
            f"({x['every step']:+.1%}) | {s['auto']:.3f} ({x['auto']:+.1%}) | {o['auto_k'] or '-'} | "
            f"{o['snapshot_mib'] or 0:.0f} MiB |"
        )
    lines += [
        "",
        "| failure | recovery | failed after step | resumed at | steps trained again | recovery time (s) | time lost (s) | finished |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rec:
        sent = (
            ", sent to the node that joined"
            if layout == "ddp"
            else ", each node sent what it lacked"
        )
        how = ("memory" + (sent if r["sent"] else "")) if r["from_memory"] else "disk"
        lines.append(
            f"| {r['scenario']} | {how} | {r['killed_after']} | {r['resumed_at']} | {r['again']} | "
            f"{r['recovery_s']:.1f} | {r['lost_s']:.1f} | {'yes' if r['finished'] else 'NO'} |"
        )
    lines += ["", MARKERS[layout][1]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer steps, repetitions and scenarios")
    p.add_argument(
        "--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file, or - to print only"
    )
    p.add_argument(
        "--layout", choices=("ddp", "fsdp"), default="ddp", help="parallel.data_parallel"
    )
    args = p.parse_args(argv)
    command = "python bench/bench_memory.py" + (" --quick" if args.quick else "")
    command += " --layout fsdp" if args.layout == "fsdp" else ""
    info = machine_info()
    over, rec = [], []
    layout = {"parallel.data_parallel": args.layout}
    runs = [("default", 1, 40), ("default", 2, 40), ("124M", 1, 12), ("124M", 2, 12)]
    scenarios = SCENARIOS
    if args.layout == "fsdp":  # sharded over 2 processes; the lost worker, node and node 0
        runs, scenarios = [r for r in runs if r[1] == 2], SCENARIOS[:3]
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        work = Path(tmp)
        for model, nproc, steps in runs[:2] if args.quick else runs:
            steps //= 2 if args.quick else 1
            over.append(
                overhead(
                    work / f"o-{model}-{nproc}", model, nproc, steps, 1 if args.quick else 2, layout
                )
            )
            print(over[-1], flush=True)
        for i, scenario in enumerate(scenarios[:2] if args.quick else scenarios):
            for memory_on in (True, False):
                where = work / f"r{i}-{memory_on}"
                rec.append(recovery(where, scenario, memory_on, 90, 30, seed=i, sets=layout))
                print(rec[-1], flush=True)
    emit_section(render(over, rec, info, command, args.layout), args.out, *MARKERS[args.layout])


if __name__ == "__main__":
    main()
