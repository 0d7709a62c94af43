"""The job's rendezvous store served on its own (lockstep/launch/store.py): a real TCPStore clients reach, a
taken port refused with the fix, and the server gone once stopped."""

from __future__ import annotations

import datetime
import threading

import pytest
from conftest import busy_port
from torch.distributed import TCPStore

from lockstep.errors import ConfigError
from lockstep.launch.store import serve_store
from lockstep.runtime import free_port


def _client(port: int, seconds: float = 5) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=seconds))


def test_clients_share_the_store_until_it_is_stopped():
    port, stop, ready = free_port(), threading.Event(), []
    server = threading.Thread(
        target=serve_store, args=("127.0.0.1", port, stop, ready.append), daemon=True
    )
    server.start()
    while not ready:
        server.join(0.01)
    assert ready == [f"127.0.0.1:{port}"]
    a, b = _client(port), _client(port)
    a.set("round", "3")
    assert b.get("round") == b"3" and b.add("joined", 1) == 1 and a.add("joined", 1) == 2
    stop.set()
    server.join(10)
    assert not server.is_alive()
    with pytest.raises(RuntimeError):
        _client(port, 0.5)  # nobody serves it any more


def test_a_taken_port_is_refused_with_the_fix():
    sock, port = busy_port()
    with sock, pytest.raises(ConfigError) as e:
        serve_store("127.0.0.1", port, threading.Event())
    assert str(e.value).startswith(f"rendezvous port {port} on 127.0.0.1 is already in use")
    assert str(e.value).endswith(
        "stop that program, or choose another with --port and give every node the same"
    )
