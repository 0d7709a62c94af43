"""Workers forked from the warm server (lockstep/launch/warm_start.py) on a CUDA machine: can a fork
of a server that imported what a lockstep worker imports (torch, torch._dynamo, lockstep.train.run)
still use CUDA, after the launcher asked CUDA for its devices? With a GPU build of torch lockstep
starts workers fresh unless LOCKSTEP_WORKER_START=warm, because this was not proved; this test is
the proof, or the reason to keep it so. Two workers share the one GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from lockstep.launch import warm_start

PROBE = textwrap.dedent("""
    import os, sys
    warm = "torch._dynamo" in sys.modules  # the server's preload, or a new interpreter's nothing
    import torch
    x = torch.ones(1024, device="cuda:0") * (int(os.environ["RANK"]) + 1)
    print(f"probe rank={os.environ['RANK']} warm={warm} sum={x.sum().item():.0f}", flush=True)
""")

# as lockstep's launcher does: it asks CUDA for its devices, then starts the server for a lockstep
# command (which preloads); two clients, as torch's agent starts them, ask it for their workers
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, torch
    from lockstep.launch.warm_start import WarmServer
    assert torch.cuda.is_available()
    server = WarmServer()
    client = server.start(["lockstep", "train"])[:-2]  # ["-I", "-S", ".../warm_client.py"]
    try:
        procs = [subprocess.Popen([sys.executable, *client, "lockstep_probe"],
                                  env={**os.environ, "RANK": str(r)}) for r in (0, 1)]
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        server.close()
    print("codes", codes, flush=True)
""")


def test_forked_workers_use_cuda(tmp_path):
    (tmp_path / "lockstep_probe.py").write_text(PROBE)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    # the environment as it is: PYTHONPATH is where the GPU tier finds lockstep (used in place)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "launcher.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = sorted(x for x in proc.stdout.splitlines() if x.startswith("probe "))
    assert lines == [f"probe rank={r} warm=True sum={1024 * (r + 1)}" for r in (0, 1)], proc.stderr
    assert proc.stdout.splitlines()[-1] == "codes [0, 0]"


def test_a_gpu_build_starts_workers_fresh_unless_asked(monkeypatch):
    monkeypatch.delenv(warm_start.START_ENV, raising=False)
    assert warm_start.worker_start() == "fresh"
    monkeypatch.setenv(warm_start.START_ENV, "warm")
    assert warm_start.worker_start() == "warm"
