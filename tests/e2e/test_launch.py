"""`lockstep launch`: one node, and two "nodes" made of network namespaces joined by a veth pair.
The settings it refuses before any worker starts: tests/unit/cli/test_launch.py and
tests/unit/launch/test_elastic.py, in-process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import netns
import pytest
import torch
from conftest import run_lockstep
from lockstep_process import LockstepProcess, start_lockstep
from procs import held, kill_tree, pending, worker_pid
from safetensors.torch import load_file

from lockstep.config import TrainConfig
from lockstep.data.sampler import Cursor, step_indices
from lockstep.runtime import free_port

pytestmark = pytest.mark.slow


def write_config(path: Path, run: Path, corpus: Path, cache: Path, **extra: str) -> Path:
    lines = [
        "model: {hidden_size: 32, attention_heads: 2, layers: 2, max_seq_length: 32}",
        "train: {max_steps: 6, batch_size: 8, sample_tokens: 0, log_interval: 1, "
        "peak_flops: 1.0e12, plots: false}",
        f"data: {{num_workers: 0, path: '{corpus}', cache_dir: '{cache}'}}",
        f"checkpoint: {{output_dir: '{run}', save_interval: 3}}",
        *extra.values(),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(
        run
        / "checkpoints"
        / (run / "checkpoints" / "latest").read_text().strip()
        / "model.safetensors"
    )


def test_launch_one_node(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    proc = run_lockstep(
        "launch", write_config(tmp_path / "c.yaml", run, corpus, token_cache), "--nproc", "2"
    )
    assert "2 worker(s) on this node, 2 in all" in proc.stdout
    assert sorted(p.name for p in (run / "logs").iterdir()) == [
        "launcher_node0.log",
        "rank0.log",
        "rank1.log",
    ]
    assert (run / "checkpoints" / "step_00000006" / "manifest.json").exists()


@pytest.fixture
def two_nodes():
    """Two network namespaces on a private test subnet, joined by a veth pair; removed afterwards."""
    for link in netns.two_nodes_or_skip():
        yield (link.a.ns, link.a.addr), (link.b.ns, link.b.addr)


def _shape_egress(ns: str, rate: str) -> None:
    """What node `ns` sends leaves at `rate` (a token bucket on its end of the veth pair); the other
    way stays at the veth's speed."""
    links = subprocess.run(
        ["ip", "-n", ns, "-o", "link", "show", "type", "veth"], capture_output=True, text=True
    )
    dev = links.stdout.split(":")[1].strip().split("@")[0]
    shape = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
    if subprocess.run([*shape, *netns.tbf_args(rate)], capture_output=True).returncode:
        pytest.skip("tc qdiscs are not permitted here")


def test_two_nodes_train_as_one_job_and_the_slow_link_is_named(
    tmp_path, corpus, token_cache, two_nodes
):
    """Node 1 sends at 20 Mbit/s: every step waits for its gradients, and the straggler watch names
    the link node1 -> node0 at the first comparison where communication is most of the step and no
    rank is behind; the weights are those of one node's 2 processes."""
    (ns_a, addr_a), (ns_b, _) = two_nodes
    _shape_egress(ns_b, "20mbit")
    run = tmp_path / "multi"
    cfg = write_config(tmp_path / "c.yaml", run, corpus, token_cache)
    longer = ("--set", "train.max_steps=60", "--set", "checkpoint.save_interval=30")
    endpoint = f"{addr_a}:{29400 + os.getpid() % 500}"
    procs = [
        start_lockstep(
            "launch",
            cfg,
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--rdzv-endpoint",
            endpoint,
            *longer,
            ns=ns,
            host=f"node{rank}",
        )
        for rank, ns in ((0, ns_a), (1, ns_b))
    ]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_tree(p)
            raise
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("1 worker(s) on this node, 2 in all" in out for out in outs)
    for rank in (0, 1):
        assert f"rank {rank}/2" in (run / "logs" / f"rank{rank}.log").read_text()
    log = (run / "logs" / "rank0.log").read_text()
    warnings = re.findall(r"WARNING straggler: (.*)", log)
    assert warnings and warnings[0].startswith(
        "communication is most of every rank's step, and the link rank 1 -> rank 0 (host node1 -> "
        "host node0) took "
    ), log[-3000:]
    assert "tc qdisc show" in warnings[0]

    # the same job on one node, 2 processes: the same samples and the same sums, so the same weights
    single = tmp_path / "single"
    run_lockstep(
        "launch",
        write_config(tmp_path / "s.yaml", single, corpus, token_cache),
        "--nproc",
        "2",
        *longer,
    )
    a, b = final_weights(run), final_weights(single)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_doctor_across_two_nodes_reports_two_hosts_and_names_the_slow_link(tmp_path, two_nodes):
    (ns_a, addr_a), (ns_b, _) = two_nodes
    endpoint = f"{addr_a}:{29900 + os.getpid() % 90}"
    _shape_egress(ns_b, "100mbit")  # node 1 sends at 100 Mbit/s, node 0 at the veth's speed
    procs = []
    for rank, ns in ((0, ns_a), (1, ns_b)):
        # each "node" gets its own host name (a UTS namespace), as separate machines would have
        doctor = [
            "doctor",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--rdzv-endpoint",
            endpoint,
            "--nproc",
            "1",
            "--output-dir",
            tmp_path / "out",
            "--max-size",
            "1MiB",
            "--json",
        ]
        procs.append(start_lockstep(*doctor, ns=ns, host=f"node{rank}", stderr=subprocess.PIPE))
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=180))
        except subprocess.TimeoutExpired:
            for p in procs:
                kill_tree(p)
            raise
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    for out, _ in outs:  # every node prints the whole report
        report = json.loads(out)
        assert report["ok"] and "2 ranks on 2 hosts" in report["summary"]
        assert sorted(r["host"] for r in report["ranks"]) == ["node0", "node1"]
        checks = {c["name"]: c for c in report["checks"]}
        assert checks["shared filesystem"]["status"] == "ok"  # both namespaces see the same disk
        # the link node 1 -> node 0 named, the other way not
        ring = checks["p2p ring"]
        assert ring["status"] == "warn" and ring["detail"].startswith(
            "rank 1 -> rank 0 (host node1 -> host node0) took "
        ), ring
        assert "rank 0 -> rank 1" not in ring["detail"] and "tc qdisc show" in ring["fix"]


def test_max_restarts_recovers_from_a_killed_worker(tmp_path, corpus, token_cache):
    """A worker dies (SIGKILL); the elastic agent restarts the group and training resumes from the last commit.
    (Before the runtime gave each attempt its own store prefix, gloo read the dead workers' addresses: 3 of 5
    runs failed with "connectFullMesh ... Connection refused".)"""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", run, corpus, token_cache)
    proc = start_lockstep(
        "launch",
        cfg,
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        "--set",
        "train.max_steps=60",
        "--set",
        "checkpoint.save_interval=5",
    )
    latest = run / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 180
        while not (latest.exists() and int(latest.read_text().strip()[5:]) >= 10):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint at step 10"
            time.sleep(0.1)
        os.kill(worker_pid(run, 1), 9)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in (run / "logs" / "rank0.log").read_text()
    assert latest.read_text().strip() == "step_00000060"
    assert (run / "logs" / "rank1.log").read_text().count(
        "rank 1/2 on"
    ) == 2  # the restarted worker


def _records(run: Path) -> dict[int, dict[int, list[list[int]]]]:
    """step -> {rank: its micro-batches' sample indices} (RUN/samples/rank*.jsonl)."""
    steps: dict[int, dict[int, list[list[int]]]] = {}
    for path in (run / "samples").glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            assert record["rank"] not in steps.setdefault(record["step"], {}), (
                f"step {record['step']} twice"
            )
            steps[record["step"]][record["rank"]] = record["micro_batches"]
    return steps


def _wait_for(what: str, ready, procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for p in procs:
            assert p.poll() is None, f"a launcher exited ({p.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def _step(latest: Path) -> int:
    return int(latest.read_text().strip()[5:]) if latest.exists() else -1


def test_elastic_job_loses_a_node_goes_on_alone_and_grows_back(
    tmp_path, corpus, token_cache, two_nodes
):
    """--nnodes 1:2 on two namespace "nodes": node 1 is killed mid-run (agent and worker, SIGKILL); node 0 re-forms
    the group alone from the last commit at world size 1 with twice the accumulation; node 1 starts again and
    rejoins (world size 2); the run finishes. Every step trained exactly the samples of an uninterrupted run: the
    global order the sampler gives from the start (seed, dataset size, global batch), split by world size.
    While node 1 starts again, node 0's worker is held still (SIGSTOP) until its agent has seen node 1 waiting
    and asked it to stop (SIGTERM pending): the join comes before the run's end whatever the load, with steps
    of a tiny model (they once were slow on purpose, 120 steps of ~0.2 s each, 2 cores busy for the wait)."""
    (ns_a, addr_a), (ns_b, _) = two_nodes
    steps = 120
    sets = [
        a
        for kv in (
            f"train.max_steps={steps}",
            "train.log_interval=10",
            "train.record_samples=true",
            "checkpoint.save_interval=10",
        )
        for a in ("--set", kv)
    ]
    run = tmp_path / "elastic"
    cfg = write_config(tmp_path / "c.yaml", run, corpus, token_cache)
    endpoint = f"{addr_a}:{29300 + os.getpid() % 90}"

    def start(rank: int, ns: str) -> LockstepProcess:
        # keep_alive_interval 1: the lost node's heartbeat expires after 3 x 1 s, not torch's 3 x 5 s (38 -> 29 s)
        launch = [
            "launch",
            cfg,
            "--nnodes",
            "1:2",
            "--node-rank",
            str(rank),
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-conf",
            "last_call_timeout=2",
            "--rdzv-conf",
            "keep_alive_interval=1",
            "--rdzv-timeout",
            "60",
            *sets,
        ]
        return start_lockstep(*launch, ns=ns, host=f"node{rank}")

    log0 = run / "logs" / "rank0.log"
    latest = run / "checkpoints" / "latest"
    procs = [start(0, ns_a), start(1, ns_b)]
    try:
        _wait_for("a commit at world size 2", lambda: _step(latest) >= 20, procs, 120)
        worker = worker_pid(run, 1)
        # node 1's agent dies; its worker dies with it
        procs[1].kill()  # the agent is the `lockstep launch` process itself
        procs[1].wait(timeout=30)
        _wait_for("node 1's worker to end", lambda: not Path(f"/proc/{worker}").exists(), [], 10)
        _wait_for(
            "node 0 alone", lambda: "left: node1 (1 rank)" in log0.read_text(), procs[:1], 120
        )
        alone = _step(latest)
        _wait_for("a commit at world size 1", lambda: _step(latest) >= alone + 10, procs[:1], 120)
        worker = worker_pid(run, 0)
        with held([worker]):
            procs[1] = start(1, ns_b)  # node 1 comes back
            _wait_for(
                "node 0's agent to stop its worker",
                lambda: pending(worker, signal.SIGTERM),
                procs,
                120,
            )
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], [out[-3000:] for out in outs]
    text = log0.read_text()
    assert (
        "elastic job; the batch plan at each world size:\n  2 ranks: global batch 8 = 2 replicas x micro-batch 4 x "
        "1 accumulation step\n  1 rank: global batch 8 = 1 replica x micro-batch 4 x 2 accumulation steps"
        in outs[0]
    )
    left = re.search(
        r"membership changed since the last attempt \(left: node1 \(1 rank\)\): world size 2 -> 1, "
        r"global batch 8 = 1 replica x micro-batch 4 x 2 accumulation steps; resumed at step (\d+)",
        text,
    )
    joined = re.search(
        r"membership changed since the last attempt \(joined: node1 \(1 rank\)\): world size 1 -> 2, "
        r"global batch 8 = 2 replicas x micro-batch 4 x 1 accumulation step; resumed at step (\d+)",
        text,
    )
    assert left and joined, text[-3000:]
    lost, back = int(left[1]), int(joined[1])
    assert 20 <= lost < back < steps and _step(latest) == steps

    # each step once, split as its world size splits it, and the samples of the uninterrupted order
    records = _records(run)
    assert sorted(records) == list(range(1, steps + 1))
    for step, ranks in records.items():
        world = 1 if lost < step <= back else 2
        assert sorted(ranks) == list(range(world)) and all(
            len(mbs) == 2 // world for mbs in ranks.values()
        ), step
    size = int(re.search(r"(\d+) train / \d+ eval windows", text)[1])
    cursor = Cursor()
    for step in range(1, steps + 1):
        expected, cursor = step_indices(size, TrainConfig().seed, cursor, 8)
        trained = sorted(i for mbs in records[step].values() for mb in mbs for i in mb)
        assert trained == sorted(expected.tolist()), step


def _time_wait_on(port: int) -> int:
    """Sockets in TIME_WAIT (state 06) whose local port is `port`, from the kernel's tables."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            count += int(local.rsplit(":", 1)[1], 16) == port and state == "06"
    return count


def test_restart_after_the_rendezvous_host_is_lost(tmp_path, corpus, token_cache):
    """--nnodes 1:2, two agents on this machine: node 0's agent is killed (SIGKILL; its worker dies with it).
    Node 1 stops with one line saying what to do, and no C++ stack frames on its console (its launcher log keeps
    them). Both commands run again at once, as that line says, while the killed agent's connections still hold
    the rendezvous port in TIME_WAIT (once refused for a minute: "master port ... is already in use ... choose
    another with --master-port"); the run resumes from its last commit and finishes."""
    run, steps = tmp_path / "run", 16
    cfg = write_config(tmp_path / "c.yaml", run, corpus, token_cache)
    endpoint, latest = f"127.0.0.1:{free_port()}", run / "checkpoints" / "latest"
    # hang_seconds 20: the hang watchdog of node 1's worker gives up on the lost store after 9 s, not 21;
    # memory snapshots off: this is the restart from the last commit (from memory: test_memory_recovery.py)
    sets = [
        a
        for kv in (
            f"train.max_steps={steps}",
            "checkpoint.save_interval=2",
            "checkpoint.memory_interval=0",
            "distributed.hang_seconds=20",
        )
        for a in ("--set", kv)
    ]

    def start(rank: int) -> LockstepProcess:
        launch = [
            "launch",
            cfg,
            "--nnodes",
            "1:2",
            "--node-rank",
            str(rank),
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-conf",
            "last_call_timeout=1",
            *sets,
        ]
        return start_lockstep(*launch, stderr=subprocess.PIPE)

    procs = [start(0), start(1)]
    try:
        _wait_for("a commit at world size 2", lambda: _step(latest) >= 2, procs, 120)
        procs[0].kill()  # the agent is the `lockstep launch` process itself
        procs[0].wait(timeout=30)
        out, err = procs[1].communicate(timeout=120)
        assert procs[1].returncode == 1, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            f"lockstep launch: error: lost the rendezvous at {endpoint}: the launcher of node rank 0, which hosts "
            "it, is gone. A job goes on without any other node, but not without that one; start node rank 0 again, "
            "then this node, with the same commands (or serve the store elsewhere: `lockstep rendezvous`, "
            "and --rdzv-store external)"
        )
        assert "frame #" not in out + err and "Exception raised from" not in err, err[-3000:]
        log = run / "logs" / "launcher_node1.log"
        assert "frame #0: " in log.read_text()  # the frames left off the console are kept
        assert (
            f"C++ stack frames from torch were left off this console; the full text is in {log}"
            in err
        )
        lost_at = _step(latest)
        # the port is still held: the case restarted in
        assert _time_wait_on(int(endpoint.rsplit(":", 1)[1])) > 0
        procs = [start(0), start(1)]
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    assert _step(latest) == steps
    assert (
        f"resumed from {run / 'checkpoints' / f'step_{lost_at:08d}'} at step {lost_at}"
        in (run / "logs" / "rank0.log").read_text()
    )
