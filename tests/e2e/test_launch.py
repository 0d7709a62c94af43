"""`lockstep launch`: one node, and two "nodes" made of network namespaces joined by a veth pair."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import busy_port, kill_tree, lockstep_cmd, run_lockstep
from lockstep.runtime import free_port

pytestmark = pytest.mark.slow


def write_config(path: Path, run: Path, corpus: Path, cache: Path, **extra: str) -> Path:
    lines = ["model: {hidden_size: 32, attention_heads: 2, layers: 2, max_seq_length: 32}",
             "train: {max_steps: 6, batch_size: 8, sample_tokens: 0, log_interval: 1, peak_flops: 1.0e12}",
             f"data: {{num_workers: 0, path: '{corpus}', cache_dir: '{cache}'}}",
             f"checkpoint: {{output_dir: '{run}', save_interval: 3}}", *extra.values()]
    path.write_text("\n".join(lines) + "\n")
    return path


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "model.safetensors")


def test_launch_one_node(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    proc = run_lockstep("launch", write_config(tmp_path / "c.yaml", run, corpus, token_cache), "--nproc", "2")
    assert "2 worker(s) on this node, 2 in all" in proc.stdout
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert (run / "checkpoints" / "step_00000006" / "manifest.json").exists()


@pytest.fixture
def two_nodes():
    """Two network namespaces on a private test subnet, joined by a veth pair; removed afterwards."""
    tag = f"{os.getpid() % 10000}"
    a, b = f"lsA{tag}", f"lsB{tag}"
    subnet = f"10.213.{os.getpid() % 200 + 20}"
    setup = [f"ip netns add {a}", f"ip netns add {b}", f"ip link add va{tag} type veth peer name vb{tag}",
             f"ip link set va{tag} netns {a}", f"ip link set vb{tag} netns {b}",
             f"ip -n {a} addr add {subnet}.1/24 dev va{tag}", f"ip -n {b} addr add {subnet}.2/24 dev vb{tag}",
             f"ip -n {a} link set va{tag} up", f"ip -n {b} link set vb{tag} up",
             f"ip -n {a} link set lo up", f"ip -n {b} link set lo up"]
    for cmd in setup:
        proc = subprocess.run(cmd.split(), capture_output=True, text=True)
        if proc.returncode != 0:
            subprocess.run(["ip", "netns", "del", a], capture_output=True)
            subprocess.run(["ip", "netns", "del", b], capture_output=True)
            pytest.skip(f"network namespaces are not permitted here ({cmd!r}: {proc.stderr.strip()})")
    yield (a, f"{subnet}.1"), (b, f"{subnet}.2")
    for ns in (a, b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_nodes_train_as_one_job(tmp_path, corpus, token_cache, two_nodes):
    (ns_a, addr_a), (ns_b, _) = two_nodes
    run = tmp_path / "multi"
    cfg = write_config(tmp_path / "c.yaml", run, corpus, token_cache)
    endpoint = f"{addr_a}:{29400 + os.getpid() % 500}"
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, *lockstep_cmd("launch", cfg, "--nnodes", "2", "--node-rank",
                                                                        str(rank), "--rdzv-endpoint", endpoint)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, ns in ((0, ns_a), (1, ns_b))]
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

    # the same job on one node, 2 processes: the same samples and the same sums, so the same weights
    single = tmp_path / "single"
    run_lockstep("launch", write_config(tmp_path / "s.yaml", single, corpus, token_cache), "--nproc", "2")
    a, b = final_weights(run), final_weights(single)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_rendezvous_endpoint_that_does_not_answer(tmp_path, corpus, token_cache):
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", corpus, token_cache)
    started = time.monotonic()
    proc = run_lockstep("launch", cfg, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                        f"127.0.0.1:{free_port()}", "--rdzv-timeout", "3", check=False, timeout=60)
    assert proc.returncode == 2 and time.monotonic() - started < 45
    assert "did not answer within 3 s" in proc.stderr and "start node rank 0" in proc.stderr


def test_bad_launch_settings(tmp_path, corpus, token_cache):
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", corpus, token_cache,
                       dist="distributed: {world_size: 3}")
    proc = run_lockstep("launch", cfg, "--nproc", "2", check=False)
    assert proc.returncode == 2 and "nnodes(1) x nproc(2) = 2 != distributed.world_size(3)" in proc.stderr
    sock, port = busy_port()
    with sock:
        cfg = write_config(tmp_path / "d.yaml", tmp_path / "run", corpus, token_cache)
        proc = run_lockstep("launch", cfg, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                            f"127.0.0.1:{port}", check=False)
        assert proc.returncode == 2 and f"master port {port}" in proc.stderr and "already in use" in proc.stderr


def test_doctor_across_two_nodes_reports_two_hosts(tmp_path, two_nodes):
    (ns_a, addr_a), (ns_b, _) = two_nodes
    endpoint = f"{addr_a}:{29900 + os.getpid() % 90}"
    procs = []
    for rank, ns in ((0, ns_a), (1, ns_b)):
        # each "node" gets its own host name (a UTS namespace), as separate machines would have
        cmd = " ".join([f"hostname node{rank} &&", "exec", *lockstep_cmd(
            "doctor", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--nproc", "1",
            "--output-dir", str(tmp_path / "out"), "--max-size", "1MiB", "--json")])
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", cmd],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
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


def test_max_restarts_recovers_from_a_killed_worker(tmp_path, corpus, token_cache):
    """A worker dies (SIGKILL); the elastic agent restarts the group and training resumes from the last commit.
    (Before the runtime gave each attempt its own store prefix, gloo read the dead workers' addresses: 3 of 5
    runs failed with "connectFullMesh ... Connection refused".)"""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", run, corpus, token_cache)
    proc = subprocess.Popen(lockstep_cmd("launch", cfg, "--nproc", "2", "--max-restarts", "1",
                                         "--set", "train.max_steps=60", "--set", "checkpoint.save_interval=5"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    latest = run / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 180
        while not (latest.exists() and int(latest.read_text().strip()[5:]) >= 10):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint at step 10"
            time.sleep(0.1)
        first = (run / "logs" / "rank1.log").read_text().splitlines()[0]
        os.kill(int(first.split("(pid ")[1].split(")")[0]), 9)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in (run / "logs" / "rank0.log").read_text()
    assert latest.read_text().strip() == "step_00000060"
    assert (run / "logs" / "rank1.log").read_text().count("rank 1/2 on") == 2  # the restarted worker
