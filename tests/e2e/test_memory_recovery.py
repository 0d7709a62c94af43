"""Recovery from memory (lockstep/train/snapshots.py, recovery.py) with torch's elastic agent: a worker killed
at a random step between two disk checkpoints costs at most one step, and the run ends on the weights of a run
that was never interrupted, bit for bit."""

from __future__ import annotations

import json
import os
import random
import re
import signal
from collections import Counter
from pathlib import Path

import netns
import pytest
import torch
from conftest import run_lockstep
from lockstep_process import LockstepProcess, start_lockstep
from procs import kill_tree, wait_for, worker_pid

from lockstep.checkpoint.sharded_load import load_full_model_tensors

pytestmark = pytest.mark.slow


def _config(path: Path, run: Path, corpus: Path, cache: Path) -> Path:
    path.write_text(
        "model: {hidden_size: 64, attention_heads: 2, layers: 2, max_seq_length: 32}\n"
        "train: {max_steps: 40, batch_size: 8, sample_tokens: 0, log_interval: 1, "
        "peak_flops: 1.0e12, plots: false}\n"
        f"data: {{num_workers: 0, path: '{corpus}', cache_dir: '{cache}'}}\n"
        f"checkpoint: {{output_dir: '{run}', save_interval: 20, memory_interval: 1, "
        f"memory_dir: '{run.parent / 'shm'}'}}\n"
    )
    return path


def _final_weights(run: Path, last: int = 40) -> dict[str, torch.Tensor]:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{last:08d}"
    return load_full_model_tensors(run / "checkpoints" / latest)  # either layout's


def _logged_steps(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["split"] == "train"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus, token_cache) -> Path:
    """The run never interrupted: its final checkpoint is what a recovered run must end on."""
    tmp = tmp_path_factory.mktemp("straight")
    run = tmp / "run"
    run_lockstep("launch", _config(tmp / "a.yaml", run, corpus, token_cache), "--nproc", "2")
    assert not any((tmp / "shm").iterdir())  # a finished run leaves no snapshot
    return run


def test_killed_workers_cost_at_most_one_step_each_and_the_weights_are_an_uninterrupted_run_s(
    tmp_path, corpus, token_cache, straight
):
    """Rank 1 killed, then (rank 0 writes the node's snapshots) rank 0 of the attempt that recovered."""
    run = tmp_path / "killed" / "run"
    run.parent.mkdir()
    cfg = _config(tmp_path / "b.yaml", run, corpus, token_cache)
    proc = start_lockstep("launch", cfg, "--nproc", "2", "--max-restarts", "2")
    # between the disk checkpoints of 20 and 40, the second kill in the attempt the first one started
    first = random.Random(os.getpid()).randint(22, 27)
    kills = [(1, first), (0, random.Random(os.getpid() + 1).randint(first + 4, 35))]
    log = run / "logs" / "rank0.log"
    try:
        for n, (rank, step) in enumerate(kills):
            wait_for(
                lambda: (
                    (run / "metrics.jsonl").exists()
                    and step in _logged_steps(run)
                    and log.read_text().count("recovery: from memory") == n
                ),
                180,
                f"step {step}",
                proc,
            )
            os.kill(worker_pid(run, rank), signal.SIGKILL)
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, out[-3000:]
    text = log.read_text()
    found = re.findall(
        r"recovery: from memory, the snapshot of step (\d+) \(held by \S+\); the newest disk "
        r"checkpoint is step 20, so (\d+) step\(s\) are not trained again; (\d+) step\(s\) are "
        r"\(metrics.jsonl's last step: (\d+)\)",
        text,
    )
    assert len(found) == 2, text[-3000:]
    for (_, kill_at), groups in zip(kills, found):
        step, saved, again, reached = map(int, groups)
        # the step logged last before the kill, or (rank 0 killed while writing its snapshot) the one
        # before
        assert (
            kill_at - 1 <= step <= reached and saved == step - 20 and again == reached - step <= 1
        )
    logged = Counter(_logged_steps(run))
    assert sorted(logged) == list(range(1, 41))
    # the run's records: at most one step twice for each recovery
    assert sum(n - 1 for n in logged.values()) <= 2
    assert text.count(f"resumed from {run.parent / 'shm'}") == 2
    weights, expected = _final_weights(run), _final_weights(straight)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert not any((run.parent / "shm").iterdir())


# ---- three namespace nodes, the rendezvous served from a fourth that trains nothing ----------------------

# disk checkpoints at 12 and 24: a node dies at a random step between 15 and 18, after the first
# checkpoint and its snapshot, and far enough before the second that the job is still short of it
# when the survivors notice
STEPS, EVERY = (24, 12)


def _nodes_config(
    path: Path, run: Path, corpus: Path, cache: Path, memory: Path, layout: str = "ddp"
) -> Path:
    # a global batch of 12 in micro-batches of 2: 3 ranks accumulate 2, 2 ranks 3
    path.write_text(
        "model: {hidden_size: 64, attention_heads: 2, layers: 2, max_seq_length: 32}\n"
        f"parallel: {{data_parallel: {layout}}}\n"
        f"train: {{max_steps: {STEPS}, batch_size: 12, micro_batch_size: 2, sample_tokens: 0, "
        "log_interval: 1, peak_flops: 1.0e12, record_samples: true, plots: false}\n"
        f"data: {{num_workers: 0, path: '{corpus}', cache_dir: '{cache}'}}\n"
        f"checkpoint: {{output_dir: '{run}', save_interval: {EVERY}, keep_last: 100, "
        f"memory_interval: 1, memory_dir: '{memory}'}}\n"
    )
    return path


@pytest.fixture
def switch():
    """Four namespaces on one switch: the rendezvous host, then three nodes."""
    try:
        with netns.switched_nodes(4) as nodes:
            yield nodes
    except netns.LinkUnavailable as e:
        pytest.skip(f"network namespaces are not permitted here ({e})")


def _start_node(i: int, ns: str, cfg: Path, endpoint: str, memory: Path) -> LockstepProcess:
    """Node i in its namespace, with a host name of its own and its own memory: a tmpfs at `memory`
    in a mount namespace of its own, which goes when the node's last process does."""
    launch = [
        "launch",
        cfg,
        "--nnodes",
        "2:3",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-store",
        "external",
        "--rdzv-id",
        "nodes",
        "--rdzv-conf",
        "last_call_timeout=3",
        "--rdzv-conf",
        "keep_alive_interval=1",
        "--rdzv-timeout",
        "60",
    ]
    return start_lockstep(*launch, ns=ns, host=f"node{i}", memory=memory)


# node 0 no longer hosts the rendezvous, so losing it is losing any node: under DDP every survivor
# holds a whole copy; under FSDP node 1's shards are on node 2 only (the ring)
@pytest.mark.parametrize(("layout", "lost"), [("ddp", 0), ("fsdp", 1)])
def test_a_lost_node_costs_at_most_one_step_and_the_weights_are_the_schedule_s(
    tmp_path, corpus, token_cache, switch, layout, lost
):
    store_host, *nodes = switch
    memory = tmp_path / "shm"
    memory.mkdir()
    run = tmp_path / "run"
    cfg = _nodes_config(tmp_path / "c.yaml", run, corpus, token_cache, memory, layout)
    endpoint = f"{store_host.addr}:29400"
    # it ends by itself once the job is over (its agents close the rendezvous `nodes`)
    serve = ["rendezvous", "--host", store_host.addr, "--until-closed", "nodes"]
    store = start_lockstep(*serve, ns=store_host.ns, stderr=None)
    procs = []
    kill_at = random.Random(os.getpid() + lost).randint(EVERY + 3, 2 * EVERY - 6)
    try:
        assert "serving the store at" in store.stdout.readline()
        procs = [_start_node(i, node.ns, cfg, endpoint, memory) for i, node in enumerate(nodes)]
        wait_for(
            lambda: (run / "metrics.jsonl").exists() and kill_at in _logged_steps(run),
            180,
            f"step {kill_at}",
            procs[0],
        )
        kill_tree(procs[lost])  # the node's agent, its workers, and with them its memory
        outs = {i: p.communicate(timeout=240)[0] for i, p in enumerate(procs) if i != lost}
        assert store.wait(timeout=30) == 0
    finally:
        for p in [*procs, store]:
            if p.poll() is None:
                kill_tree(p)
    assert [procs[i].returncode for i in outs] == [0, 0], [o[-3000:] for o in outs.values()]
    log = (run / "logs" / "rank0.log").read_text()
    # held by the survivors whose snapshot of that step was whole; one that was not (its gather failed
    # as the node died) is sent it
    found = re.search(
        r"recovery: from memory, the snapshot of step (\d+) \(held by ([\w, ]+?)(?:; sent to ([\w, ]+))?\); "
        rf"the newest disk checkpoint is step {EVERY}, so \d+ step\(s\) are not trained again; "
        r"(\d+) step\(s\) are",
        log,
    )
    assert found, log[-4000:]
    step, again = int(found[1]), int(found[4])
    survivors = {f"node{i}" for i in outs}
    sent = set(found[3].split(", ")) if found[3] else set()
    assert set(found[2].split(", ")) | sent == survivors, found[0]
    assert kill_at - 1 <= step < 2 * EVERY and again <= 1
    assert f"left: node{lost} (1 rank)" in log
    logged = Counter(_logged_steps(run))
    assert sorted(logged) == list(range(1, STEPS + 1)) and sum(logged.values()) - STEPS <= 1

    # the same membership schedule uninterrupted: 3 ranks on one node to `step`, then 2 from its
    # checkpoint; without snapshots (they change nothing trained and cost a step's time)
    three, rest = tmp_path / "three", tmp_path / "rest"
    no_snapshots = ("--set", "checkpoint.memory_interval=0")
    run_lockstep(
        "launch",
        _nodes_config(tmp_path / "t.yaml", three, corpus, token_cache, tmp_path / "shm2", layout),
        "--nproc",
        "3",
        "--set",
        f"checkpoint.save_interval={step}",
        *no_snapshots,
    )
    run_lockstep(
        "launch",
        _nodes_config(tmp_path / "r.yaml", rest, corpus, token_cache, tmp_path / "shm3", layout),
        "--nproc",
        "2",
        "--set",
        f"checkpoint.resume={three / 'checkpoints' / f'step_{step:08d}'}",
        *no_snapshots,
    )
    weights, expected = _final_weights(run, STEPS), _final_weights(rest, STEPS)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
