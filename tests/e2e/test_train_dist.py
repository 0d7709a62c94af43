"""End to end on real 2-process gloo groups, started the ways a user starts them.

`lockstep train --world-size 2` (torchrun's elastic agent underneath), plain torchrun, and
two hand-started ranks. Every assertion is on values the run wrote: metrics.jsonl, the
checkpoint tensors, the sample indices each rank recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_lockstep
from lockstep_process import start_lockstep
from procs import kill_tree, wait_for
from safetensors.torch import load_file

from lockstep.runtime import free_port

pytestmark = pytest.mark.slow


def metrics(run: Path, split: str = "train") -> list[dict]:
    return [
        r
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r["split"] == split
    ]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(run / "checkpoints" / latest / "model.safetensors")


def test_loss_falls_on_default_corpus(tmp_path, token_cache):
    run = tmp_path / "run"
    proc = run_lockstep(
        "train",
        "--world-size",
        "2",
        "--output-dir",
        run,
        *TINY,
        "--hidden-size",
        "64",
        "--max-seq-length",
        "64",
        "--global-batch-size",
        "16",
        "--max-steps",
        "60",
        "--learning-rate",
        "3e-3",
        "--warmup-steps",
        "5",
        "--save-interval",
        "30",
        "--eval-interval",
        "30",
        "--set",
        "data.max_bytes=1000000",
        "--set",
        f"data.cache_dir={token_cache}",
        "--set",
        "train.sample_tokens=40",
        "--set",
        "train.plots=true",
    )
    train = metrics(run)
    first = sum(r["loss"] for r in train[:5]) / 5
    last = sum(r["loss"] for r in train[-5:]) / 5
    assert first > 5.0 and last < first - 1.5, (first, last)
    evals = metrics(run, "eval")
    assert [r["step"] for r in evals] == [30, 60] and evals[1]["loss"] < evals[0]["loss"]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in train)
    # rank roles: both ranks log (prefixed), rank 0 alone draws the console and writes the shared files
    for rank in (0, 1):
        lines = (run / "logs" / f"rank{rank}.log").read_text().splitlines()
        assert lines and all(line.startswith(f"[rank {rank}]") for line in lines)
    assert (
        "batch plan: global batch 16 (--global-batch-size 16) = 2 ranks (--world-size 2, torchrun) x micro-batch 8 "
        "(derived: 16 / (2 x 1)) x 1 accumulation step (default)"
    ) in proc.stderr
    assert not [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("[rank 1]") and " INFO " in line
    ]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert "sample from the trained model" in proc.stderr
    assert run_lockstep("verify", run).returncode == 0
    # every rank's step time by cause, in every record, drawn at the end; no straggler in a run with none
    assert all([row["rank"] for row in r["ranks"]] == [0, 1] for r in train)
    assert (run / "step_times.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "straggler:" not in proc.stderr
    report = run_lockstep("report", run).stdout
    assert "means over 60 log windows (steps 1-60)" in report and " of 6 |" in report
    assert [
        line.split(" | ")[0]
        for line in report.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    ] == ["| 0", "| 1"]


def test_only_rank0_writes_checkpoints_under_torchrun(tmp_path, corpus, token_cache):
    run, audit = tmp_path / "run", tmp_path / "audit"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(Path(__file__).parents[1] / "audit_worker.py"),
        str(audit),
        "train",
        "--data",
        str(corpus),
        "--output-dir",
        str(run),
        *TINY,
        "--global-batch-size",
        "8",
        "--max-steps",
        "6",
        "--save-interval",
        "2",
        "--set",
        f"data.cache_dir={token_cache}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    ckpt = str(run / "checkpoints")
    rank0 = [
        w for w in json.loads(Path(f"{audit}.rank0.json").read_text()) if w[1].startswith(ckpt)
    ]
    rank1 = [
        w for w in json.loads(Path(f"{audit}.rank1.json").read_text()) if w[1].startswith(ckpt)
    ]
    assert rank1 == [], rank1
    assert any(event == "os.rename" for event, _ in rank0) and any(
        p.endswith("manifest.json") for _, p in rank0
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest",
        "step_00000002",
        "step_00000004",
        "step_00000006",
    ]


def _train_args(run: Path, corpus: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(corpus),
        "--output-dir",
        str(run),
        *TINY,
        "--hidden-size",
        "64",
        "--max-seq-length",
        "64",
        "--global-batch-size",
        "16",
        "--max-steps",
        "60",
        "--save-interval",
        "4",
        "--eval-interval",
        "0",
        "--set",
        f"data.cache_dir={cache}",
        *extra,
    ]


# fp32 (what "auto" is on a CPU without AVX-512), every rank's samples recorded, 40 steps: the
# uninterrupted run both tests below compare with
STRAIGHT = ("--mixed-precision", "no", "--set", "train.record_samples=true", "--max-steps", "40")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus, token_cache) -> Path:
    """The uninterrupted 2-process run (read only: the tests resume runs of their own)."""
    run = tmp_path_factory.mktemp("straight") / "straight"
    run_lockstep(*_train_args(run, corpus, token_cache, "--world-size", "2", *STRAIGHT))
    return run


def test_killed_and_resumed_run_equals_uninterrupted(tmp_path, corpus, token_cache, straight):
    args = lambda run: _train_args(  # noqa: E731
        run, corpus, token_cache, "--world-size", "2", *STRAIGHT
    )
    broken = tmp_path / "broken"

    proc = start_lockstep(*args(broken), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = broken / "checkpoints" / "latest"
    wait_for(
        lambda: latest.exists() and int(latest.read_text().strip()[5:]) >= 20,
        240,
        "a checkpoint at step 20",
        proc,
    )
    kill_tree(proc)  # SIGKILL to the agent and every worker: nothing gets to clean up
    killed_at = int(latest.read_text().strip()[5:])
    assert 20 <= killed_at < 40, killed_at

    resumed = run_lockstep(*args(broken))
    assert f"resumed from {broken / 'checkpoints' / f'step_{killed_at:08d}'}" in resumed.stderr
    a, b = final_weights(straight), final_weights(broken)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after kill + resume"


def _pid_of_rank(run: Path, rank: int) -> int:
    first = (run / "logs" / f"rank{rank}.log").read_text().splitlines()[0]
    return int(first.split("(pid ")[1].split(")")[0])


def _samples(run: Path) -> dict[int, list[int]]:
    """step -> the sorted global batch, from what every rank recorded it consumed."""
    steps: dict[int, list[int]] = {}
    for path in sorted((run / "samples").glob("rank*.jsonl")):
        for rec in map(json.loads, path.read_text().splitlines()):
            steps.setdefault(rec["step"], []).extend(i for mb in rec["micro_batches"] for i in mb)
    return {s: sorted(v) for s, v in steps.items()}


def test_sigterm_on_one_rank_then_resume_at_world_size_1(tmp_path, corpus, token_cache, straight):
    """SIGTERM to rank 1 alone stops both ranks after a commit; resuming on 1 process (same global batch)
    consumes exactly the same samples per step, and the losses match the uninterrupted 2-process run."""
    common = STRAIGHT
    broken = tmp_path / "broken"

    proc = start_lockstep(
        *_train_args(broken, corpus, token_cache, "--world-size", "2", *common),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_for(
        lambda: (broken / "metrics.jsonl").exists() and len(metrics(broken)) >= 12,
        240,
        "step 12",
        proc,
    )
    os.kill(_pid_of_rank(broken, 1), signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise
    stopped_at = int((broken / "checkpoints" / "latest").read_text().strip()[5:])
    assert proc.returncode == 0, err[-3000:]
    assert 12 <= stopped_at < 40
    logs = [(broken / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert "stop requested (signal 15): checkpoint committed" in logs[1]
    # rank 0 got no signal itself but learns which one stopped the run (it is not a finished run)
    assert "stop requested (signal 15, received by another rank): checkpoint committed" in logs[0]

    run_lockstep(
        *_train_args(broken, corpus, token_cache, "--world-size", "1", "--grad-accum", "2", *common)
    )
    a, b = _samples(straight), _samples(broken)
    # every step, same global batch, on 2 ranks and then 1
    assert sorted(b) == list(range(1, 41)) and a == b
    la = {r["step"]: r["loss"] for r in metrics(straight)}
    lb = {r["step"]: r["loss"] for r in metrics(broken)}
    for step in range(1, 41):
        # fp32; after the switch to 1 process only the summation order of the gradients differs
        assert abs(la[step] - lb[step]) <= 1e-4 * la[step], (step, la[step], lb[step])


def test_hand_started_ranks_join_one_group(tmp_path, corpus, token_cache):
    """The GPT team's way: every process started by hand with --world-size, --rank,
    --master-addr/--master-port. First with a model whose step fits no machine: rank 0 runs the
    plan's check before the group is up, and both ranks stop with its refusal before building
    anything."""
    run = tmp_path / "run"

    def args(rank: int, port: int, *more: str) -> list[str]:  # hang_seconds 0: the watchdog off
        return [
            "train", "--data", str(corpus), "--output-dir", str(run), *TINY, "--global-batch-size", "8",
            "--max-steps", "4", "--world-size", "2", "--rank", str(rank), "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--set", f"data.cache_dir={token_cache}",
            "--set", "distributed.hang_seconds=0", *more,
        ]  # fmt: skip

    def ranks(*more: str) -> tuple[list[int], list[str]]:
        port = free_port()
        out = subprocess.PIPE
        procs = [start_lockstep(*args(r, port, *more), stdout=out, stderr=out) for r in (0, 1)]
        outs = [p.communicate(timeout=180) for p in procs]
        return [p.returncode for p in procs], [o + e for o, e in outs]

    # ~26B parameters (tests/unit/plan/test_check.py's HUGE), checked on this CPU's memory
    huge = ("--hidden-size", "32768", "--attention-heads", "256", "--max-seq-length", "16")
    codes, outs = ranks(*huge, "--set", "train.plan_check=refuse")
    assert codes == [2, 2], outs
    for rank, out in enumerate(outs):
        assert f"rank {rank} " in out and "lockstep plan: a step of this run needs " in out, out
        assert "to start anyway: --set train.plan_check=warn (or off)" in out
    assert not (run / "checkpoints").exists()

    codes, outs = ranks()
    assert codes == [0, 0], outs
    assert "launcher manual" in (run / "logs" / "rank1.log").read_text()
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


def test_frozen_rank_is_named_by_the_watchdog(tmp_path, corpus, token_cache):
    """A rank that stops making progress (here: frozen with SIGSTOP, as a process stuck on a dead filesystem
    would be) stops the whole run within the limit, with a report that names it."""
    run = tmp_path / "run"
    proc = start_lockstep(
        *_train_args(
            run,
            corpus,
            token_cache,
            "--world-size",
            "2",
            "--max-steps",
            "100000",
            "--set",
            "distributed.hang_seconds=4",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(
            lambda: (run / "metrics.jsonl").exists() and len(metrics(run)) >= 5, 180, "step 5", proc
        )
        frozen = _pid_of_rank(run, 1)
        os.kill(frozen, signal.SIGSTOP)
        report = run / "hang" / "report.txt"
        wait_for(report.exists, 90, "the hang report", proc)
        os.kill(frozen, signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 1, err[-3000:]
    # the launcher's last line says how the run ended and what it left on disk
    said = [line for line in err.splitlines() if line.startswith("lockstep train:")]
    assert (
        len(said) == 1
        and "was stopped by the hang watchdog (exit code 124; see the run's hang/report.txt)"
        in said[0]
    ), said
    latest = (run / "checkpoints" / "latest").read_text().strip()
    step = int(latest[5:])
    assert f"; this run committed checkpoint {latest} (step {step}, " in said[0], said
    assert said[0].endswith(
        f"; to resume, run the same command again: --resume auto takes {latest} (step {step}) and "
        "verifies its checksums before loading it"
    ), said
    text = report.read_text()
    first = text.splitlines()[0]
    assert "behind: rank 1" in first and "rank 0 " not in first.split("behind:")[1], text
    assert (run / "hang" / "rank0.txt").read_text().count(
        "File "
    ) > 3  # rank 0's stacks, with its waiting line
    assert "hang: no progress" in (run / "logs" / "rank0.log").read_text()
