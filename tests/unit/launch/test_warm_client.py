"""The stand-in torch's agent starts for each worker (lockstep/launch/warm_client.py), run for real:
with no warm server it becomes the worker itself; a server that refuses is reported; through a real
server it ends as its worker ends. Started as a module here, so that coverage measures it (the agent
starts it without site: lockstep.launch.warm_start.CLIENT). With torch's agent:
tests/unit/launch/test_warm_start.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

from lockstep.launch.warm_client import SOCKET_ENV
from lockstep.launch.warm_start import WarmServer

PROBE = "import os, sys\nprint('worker', os.getpid(), sys.argv[1:])\nsys.exit(4)\n"


def _client(tmp_path, socket_path: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "lockstep_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", SOCKET_ENV)}
    if socket_path is not None:
        env[SOCKET_ENV] = socket_path
    return subprocess.run(
        [sys.executable, "-m", "lockstep.launch.warm_client", "lockstep_probe", "a", "b"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_a_server_the_client_becomes_the_worker(tmp_path):
    for path in (None, str(tmp_path / "gone.sock")):  # never set, or the server's socket is gone
        proc = _client(tmp_path, path)
        words = proc.stdout.split()
        assert (proc.returncode, words[0], words[2:]) == (4, "worker", ["['a',", "'b']"]), (
            proc.stderr
        )


def test_a_server_that_cannot_start_the_worker_is_reported(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s.sock"))
    listener.listen(1)
    received = {}

    def refuse():
        conn, _ = listener.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 4, 3)
        received["fds"] = len(fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(b"error fork failed: no memory\n")
        conn.close()

    thread = threading.Thread(target=refuse)
    thread.start()
    proc = _client(tmp_path, str(tmp_path / "s.sock"))
    thread.join(timeout=60)
    listener.close()
    assert received == {"fds": 3}  # stdin, stdout and stderr, sent with the request
    assert (proc.returncode, proc.stdout) == (1, "")
    assert (
        proc.stderr
        == "lockstep: the warm server did not start the worker: fork failed: no memory\n"
    )


# a worker that stops on SIGTERM with 7; it writes to fd 1 itself (the client's, which the server
# passed on): a fork of this pytest process would print to pytest's capture
WAITER = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: os._exit(7))
    os.write(1, f"ready {os.getpid()}\\n".encode())
    if sys.argv[1:]:
        sys.exit(int(sys.argv[1]))
    time.sleep(60)
""")


def test_through_a_real_server_the_client_ends_as_its_worker_ends(tmp_path, monkeypatch):
    (tmp_path / "lockstep_waiter.py").write_text(WAITER)
    monkeypatch.chdir(tmp_path)
    server = WarmServer()
    server.start(["lockstep_waiter"])  # the server's socket, in this process's environment

    def client(*args: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "lockstep.launch.warm_client", "lockstep_waiter", *args]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    try:
        done = client("5")
        out, err = done.communicate(timeout=60)
        assert (done.returncode, out.split()[0]) == (5, "ready"), err  # the worker's exit code
        stopped = client()
        assert stopped.stdout.readline().startswith("ready")
        stopped.send_signal(signal.SIGTERM)  # passed on to the worker, which stops with 7
        assert stopped.wait(timeout=60) == 7, stopped.stderr.read()
        killed = client()
        worker = int(killed.stdout.readline().split()[1])
        os.kill(worker, signal.SIGKILL)  # a worker killed by a signal: its client dies of it too
        assert killed.wait(timeout=60) == -signal.SIGKILL, killed.stderr.read()
    finally:
        server.close()
