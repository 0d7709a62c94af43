"""Workers forked from the launch's warm server (lockstep/launch/warm_start.py), launched for real
through torch's agent by a launcher process: what each worker receives (the environment, working
directory, sys.path, streams and thread count a new interpreter would have), how its end reaches the
agent, and that it ends with its launcher. Both ways the server starts: a fork of a one-thread
launcher, a new interpreter for one with threads (OpenMP's, once they have run)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from procs import descendants, kill_tree, wait_for

from lockstep.errors import ConfigError
from lockstep.launch import warm_start

# a user's worker module, found as `python -m` finds it (the working directory first)
PROBE = textwrap.dedent("""
    import gc, os, random, signal, sys, time
    warm = "torch" in sys.modules  # a fork of a server that has it, or a new interpreter
    import torch
    rank, how = os.environ["RANK"], sys.argv[1]
    server = open(f"/proc/{os.getppid()}/cmdline").read()
    a = torch.randn(600, 600)
    (a @ a).sum()  # a parallel op on 2 threads: it hangs in a fork of a process whose OpenMP ran
    # one write: print's text and its newline are two, and the other rank's line once came between
    sys.stderr.write(f"probe {rank}/{os.environ['WORLD_SIZE']} env={os.environ.get('SET_BEFORE_LAUNCH')} "
                     f"threads={torch.get_num_threads()} path0={sys.path[0]} ppid={os.getppid()} "
                     f"warm={warm} fresh_server={'lockstep.launch.warm_start' in server} "
                     f"random={random.random():.12f} collector={gc.isenabled()}\\n")
    sys.stderr.flush()
    open(f"printed-{how}-{rank}", "w").close()  # each launch its own how
    if rank == "1":  # rank 1 ends first only once rank 0 has printed: the agent then stops rank 0
        while not os.path.exists(f"printed-{how}-0"):
            time.sleep(0.01)
    if how == "term":
        def stop(*_):
            print(f"rank {rank} got SIGTERM", file=sys.stderr, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        open(f"ready{rank}", "w").close()
        signal.pause()
    if rank == "1" and how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == "1" and how == "raise":
        raise ValueError("the probe's own error")
    if rank == "1" and how == "message":
        sys.exit("the probe's own message")
    sys.exit(int(how) if rank == "1" and how.isdigit() else 0)
""")

# the launcher: what a lockstep launcher does, a launch per argument; "omp" first runs a parallel
# op on the threads torch started with (OpenMP's threads: the launcher has more than one then)
LAUNCHER = textwrap.dedent("""
    import os, sys, tempfile
    from lockstep.launch import elastic
    import torch
    os.environ["SET_BEFORE_LAUNCH"] = "seen"
    os.environ["OMP_NUM_THREADS"] = "2"
    keep = tempfile.TemporaryDirectory(dir=".")  # the launcher's: no worker's exit may remove it
    open(os.path.join(keep.name, "report"), "w").close()
    for how in sys.argv[1:]:
        if how == "omp":
            a = torch.randn(600, 600)
            (a @ a).sum()
            continue
        try:
            elastic.launch_workers(["lockstep_probe", how], 2)
            print(how, "ended well", flush=True)
        except elastic.WorkerFailed as e:
            print(how, "failed:", e.failed, flush=True)
        except elastic.LaunchStopped as e:
            print(how, "stopped:", e, flush=True)
        kept = os.path.exists(os.path.join(keep.name, "report"))
        print(how, "keeps its directory:", kept, flush=True)
""")


def _launcher(tmp_path: Path, *launches: str, env: dict | None = None, **popen) -> subprocess.Popen:
    (tmp_path / "lockstep_probe.py").write_text(PROBE)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", warm_start.START_ENV)}
    return subprocess.Popen(
        [sys.executable, str(tmp_path / "launcher.py"), *launches],
        cwd=tmp_path,
        env={**environ, "OMP_NUM_THREADS": "1", **(env or {})},  # torch starts no thread: a fork
        text=True,
        **popen,
    )


def _both_ready(tmp_path: Path, proc: subprocess.Popen) -> None:
    """Wait until both "term" workers have set their SIGTERM handler."""
    ready = [tmp_path / f"ready{rank}" for rank in (0, 1)]
    wait_for(lambda: all(p.exists() for p in ready), 120, "both workers", proc)


def _ranks(stderr: str) -> list[dict[str, str]]:
    lines = [line.split() for line in stderr.splitlines() if line.startswith("probe ")]
    return [{"rank": words[1], **dict(w.split("=", 1) for w in words[2:])} for words in lines]


@pytest.mark.parametrize("server", ["fork", "fresh"])
def test_workers_are_forks_with_what_a_new_interpreter_would_have(tmp_path, server):
    # torch imported on 2 threads starts one of OpenMP's, and "omp" runs a parallel op on them: the
    # launcher has threads, and its fork would hang at a worker's first parallel op. Its server is a
    # new interpreter, which imports torch at each launch: fewer launches there.
    launches = ["0", "3", "kill", "raise", "message"] if server == "fork" else ["omp", "3", "kill"]
    threads = {"OMP_NUM_THREADS": "1" if server == "fork" else "2"}
    proc = _launcher(
        tmp_path, *launches, env=threads, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    expected = {
        "0": "ended well",
        "3": "rank 1 exited with an error (exit code 3)",
        "kill": "rank 1 was killed by SIGKILL",
        "raise": "rank 1 exited with an error (exit code 1)",
        "message": "rank 1 exited with an error (exit code 1)",
    }
    ran = [how for how in launches if how != "omp"]
    lines = out.splitlines()
    assert lines[1::2] == [f"{how} keeps its directory: True" for how in ran]
    for how, line in zip(ran, lines[::2]):
        said = line.removeprefix(f"{how} failed: ").removeprefix(f"{how} ").split("; ")
        # how rank 1 ended; rank 0 ends at the same moment, and when the agent saw rank 1 fail
        # first, it stopped rank 0 (with SIGTERM, which the agent lists too)
        assert expected[how] in said and set(said) - {expected[how]} <= {
            "rank 0 was killed by SIGTERM"
        }, line
    ranks = _ranks(err)
    assert len(ranks) == 2 * len(ran)
    # the launcher's environment at the launch, torch's threads from it, `python -m`'s sys.path
    seen = {
        (r["env"], r["threads"], r["path0"], r["warm"], r["fresh_server"], r["collector"])
        for r in ranks
    }  # the collector on, as in a new interpreter (the server's imports ran without)
    assert seen == {("seen", "2", str(tmp_path), "True", str(server == "fresh"), "True")}
    # each a fork of the server, not a child of the launcher's agent; each seeded anew
    assert str(proc.pid) not in {r["ppid"] for r in ranks}
    assert len({r["random"] for r in ranks}) == len(ranks)
    if "raise" in launches:  # a worker's traceback, or its exit message, on its stderr
        assert "ValueError: the probe's own error" in err
        assert "\nthe probe's own message\n" in err


def test_a_signal_to_the_launcher_reaches_every_worker(tmp_path):
    proc = _launcher(tmp_path, "term", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _both_ready(tmp_path, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert "rank 0 got SIGTERM" in err and "rank 1 got SIGTERM" in err, err
    assert out.splitlines()[0] == "term stopped: stopped by signal 15 (SIGTERM)"


def test_workers_end_with_their_launcher(tmp_path):
    # a lost node: the launcher dies with SIGKILL, and nothing of the launch may train on
    proc = _launcher(tmp_path, "term", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _both_ready(tmp_path, proc)
        below = descendants(proc.pid)
        names = sorted(_name(pid) for pid in below)
        # the server, 2 clients, 2 workers
        assert names.count("lockstep-warm") == 1 and len(below) == 5, names
        proc.kill()
        proc.wait(timeout=30)
        wait_for(
            lambda: not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in below),
            30,
            "every process of the launch to end",
        )
    finally:
        kill_tree(proc)


def test_fresh_workers_on_request_and_a_bad_setting_refused(tmp_path, monkeypatch):
    proc = _launcher(
        tmp_path,
        "0",
        env={warm_start.START_ENV: "fresh"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.splitlines()[0] == "0 ended well", err
    # each a new interpreter, which imports torch itself
    assert {rank["warm"] for rank in _ranks(err)} == {"False"}
    monkeypatch.setenv(warm_start.START_ENV, "cold")
    with pytest.raises(ConfigError, match=r"LOCKSTEP_WORKER_START='cold': workers start 'warm' "):
        warm_start.worker_start()


def test_workers_start_warm_with_a_cpu_build_of_torch_and_fresh_with_a_gpu_build(monkeypatch):
    import torch

    monkeypatch.delenv(warm_start.START_ENV, raising=False)
    assert torch.version.cuda is None and warm_start.worker_start() == "warm"  # this machine's
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # what a CUDA build of torch says
    assert warm_start.worker_start() == "fresh"
    # asked for: a server that is a new interpreter
    monkeypatch.setenv(warm_start.START_ENV, "warm")
    assert warm_start.worker_start() == "warm" and warm_start._gpu_build()


def test_the_server_refuses_a_bad_request_and_kills_a_worker_whose_client_was_killed(tmp_path):
    # torch's agent ends a worker that ignores SIGTERM with SIGKILL, which reaches only the client
    (tmp_path / "lockstep_sleeper.py").write_text(
        "import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(300)\n"
    )
    threading.Thread(target=threading.Event().wait, daemon=True).start()  # a server of its own
    server = warm_start.WarmServer()
    args = server.start(["lockstep_sleeper", str(tmp_path / "pid")])
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:  # not what a client sends
            bad.connect(os.environ[warm_start.SOCKET_ENV])
            socket.send_fds(bad, [struct.pack("!I", 5) + b"{oops"], [0, 1, 2])
            assert bad.makefile("r").readline().startswith("error JSONDecodeError: ")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        client = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=env)
        wait_for(
            lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(),
            120,
            "the worker",
            client,
        )
        worker = int((tmp_path / "pid").read_text())
        client.send_signal(signal.SIGTERM)  # passed on, and ignored
        assert client.poll() is None and _alive(worker)
        client.kill()
        client.wait(timeout=30)
        wait_for(lambda: not _alive(worker), 30, "the worker to end")
    finally:
        server.close()
    assert warm_start.SOCKET_ENV not in os.environ


def _name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
