"""The stand-in torch's agent starts for each worker (lockstep/launch/warm_client.py), run for real:
with no warm server it becomes the worker itself; a server that refuses is reported. Through a real
server and torch's agent: tests/unit/launch/test_warm_start.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

from lockstep.launch.warm_client import SOCKET_ENV

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
