"""Bad input, as a user would type it: one clear message (value, rule, fix), no worker started, and the
last good checkpoint untouched.

Here in real processes: the CLI entry point's refusal (exit code, one line, no traceback),
damaged or mismatched checkpoints, and hand-started ranks that cannot meet. What the launching
command refuses before any worker starts is checked in-process beside the function that refuses
it: tests/unit (data/test_text.py, config/test_overrides.py, parallel/test_mesh.py,
runtime/test_device.py, runtime/test_group.py)."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path

import pytest
from conftest import TINY, busy_port, run_lockstep

from lockstep.runtime import free_port


def fails(*args: str, code: int | None = None) -> str:
    proc = run_lockstep(*args, check=False, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    if code is not None:
        assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "starting 2 workers" not in proc.stdout, (
        "workers were started before the input was checked"
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def snapshot(run: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((run / "checkpoints").rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A finished 1-process run with checkpoints at steps 2 and 4."""
    cache = tmp_path_factory.mktemp("cache")
    run = tmp_path_factory.mktemp("trained") / "run"
    args = [
        "--data",
        str(corpus),
        "--output-dir",
        str(run),
        *TINY,
        "--global-batch-size",
        "8",
        "--max-steps",
        "4",
        "--save-interval",
        "2",
        "--set",
        f"data.cache_dir={cache}",
    ]
    run_lockstep("train", *args)
    return run, args


def test_missing_corpus(tmp_path):
    # the entry point's proof (`python -m lockstep`): exit 1, the message, no worker, no traceback
    err = fails(
        "train",
        "--world-size",
        "2",
        "--data",
        str(tmp_path / "nope.txt"),
        "--output-dir",
        str(tmp_path),
        code=1,
    )
    assert f"data.path '{tmp_path / 'nope.txt'}' does not exist" in err and "omit --data" in err


@pytest.mark.slow  # starts training processes
def test_truncated_weights(trained, tmp_path):
    run, args = trained
    good = {k: v for k, v in snapshot(run).items() if k.startswith("step_00000002")}
    weights = run / "checkpoints" / "step_00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])

    report = run_lockstep("verify", str(run), check=False)
    assert (
        report.returncode == 1
        and "model.safetensors" in report.stdout
        and "truncated" in report.stdout
    )
    err = fails("train", *args, "--resume", str(run / "checkpoints" / "step_00000004"), code=1)
    assert "model.safetensors" in err and "--resume" in err
    assert {k: v for k, v in snapshot(run).items() if k.startswith("step_00000002")} == good

    # auto: falls back to the newest checkpoint that verifies and trains on from there
    proc = run_lockstep("train", *args, "--max-steps", "6")
    assert "falling back to step_00000002" in proc.stderr and "at step 2" in proc.stderr
    assert run_lockstep("verify", str(run)).returncode == 0


@pytest.mark.slow  # starts training processes
def test_resume_with_another_model_shape(trained):
    run, args = trained
    before = snapshot(run)
    err = fails("train", *args, "--hidden-size", "48", "--max-steps", "8", code=1)
    assert "shape" in err and "(256, 32)" in err and "(256, 48)" in err and "--resume none" in err
    assert snapshot(run) == before


RENDEZVOUS_TIMEOUT = [
    "--set",
    "distributed.timeout_seconds=3",
    "--set",
    "distributed.hang_seconds=1",
]


def hand_started_rank(rank: int, port: int, corpus: Path, out: Path) -> tuple[str, float]:
    start = time.monotonic()
    err = fails(
        "train",
        "--world-size",
        "2",
        "--rank",
        str(rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--data",
        str(corpus),
        "--output-dir",
        str(out),
        *RENDEZVOUS_TIMEOUT,
        code=2,
    )
    # no C++ frames, no torch traceback
    assert "frame #" not in err and "DistNetworkError" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err, time.monotonic() - start


@pytest.mark.slow  # starts training processes
def test_rank_with_nothing_listening_at_the_master(tmp_path, corpus):
    port = free_port()
    err, took = hand_started_rank(1, port, corpus, tmp_path / "r")
    assert (
        f"rank 1 found nothing listening at 127.0.0.1:{port}" in err and "after waiting 3 s" in err
    )
    assert "start rank 0 first" in err and "the same --master-addr and --master-port" in err
    assert took < 60


@pytest.mark.slow  # starts training processes
def test_rank_0_alone_names_the_missing_ranks(tmp_path, corpus):
    err, _ = hand_started_rank(0, free_port(), corpus, tmp_path / "r")
    assert (
        "rank 0 waited 3 s" in err
        and "1/2 clients joined" in err
        and "start rank 1 with the same" in err
    )


@pytest.mark.slow  # starts training processes
def test_rank_with_another_program_on_the_master_port(tmp_path, corpus):
    # one that accepts and never answers (torch's client alone waits forever), one that answers garbage
    sock, port = busy_port()
    with sock:
        err, took = hand_started_rank(1, port, corpus, tmp_path / "r")
    assert (
        f"reached 127.0.0.1:{port}, but what answers there is not rank 0's torch.distributed store"
        in err
    )
    assert "did not answer" in err and f"is another program using port {port}?" in err and took < 60

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def answer_http():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                try:
                    conn.recv(64)
                    conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
                # lockstep's reachability check connects and closes at once: serve the next one
                except OSError:
                    continue

    threading.Thread(target=answer_http, daemon=True).start()
    with server:
        err, _ = hand_started_rank(1, server.getsockname()[1], corpus, tmp_path / "r2")
    # torch's own reason varies with timing ("Ping failed", or a reset when the stub closes on unread bytes)
    assert "is not rank 0's torch.distributed store (torch: " in err and "another program" in err, (
        err
    )
