"""`lockstep rendezvous` (lockstep/cli/rendezvous.py) as a user runs it: it says where it serves and what to
give the nodes, serves a store a client reaches, and ends with 0 on SIGTERM."""

from __future__ import annotations

import datetime
import signal

from lockstep_process import start_lockstep
from torch.distributed import TCPStore

from lockstep.runtime import free_port


def test_it_serves_until_sigterm():
    port = free_port()
    proc = start_lockstep("rendezvous", "--host", "127.0.0.1", "--port", port)
    try:
        line = proc.stdout.readline()
        assert line == (
            f"lockstep rendezvous: serving the store at 127.0.0.1:{port}; start every node with "
            f"--rdzv-endpoint 127.0.0.1:{port} --rdzv-store external (Ctrl-C or SIGTERM ends it)\n"
        )
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        client.set("k", "v")
        assert client.get("k") == b"v"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
