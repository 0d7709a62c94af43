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


def test_until_closed_ends_when_the_jobs_agents_close_its_rendezvous():
    """--until-closed: the store serves while torch's rendezvous of that id is open (or not made yet, or
    another job's closes), and ends once it is closed, written as torch's agents write it."""
    import pickle

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    port, stop, ready = free_port(), threading.Event(), []
    server = threading.Thread(
        target=serve_store,
        args=("127.0.0.1", port, stop, ready.append),
        kwargs={"until_closed": "job1"},
        daemon=True,
    )
    server.start()
    while not ready:
        server.join(0.01)

    def write(run_id: str, closed: bool) -> None:
        backend = C10dRendezvousBackend(_client(port), run_id)
        state = _RendezvousState()
        state.closed = closed
        token = backend.get_state()[1] if backend.get_state() else None
        backend.set_state(pickle.dumps(state), token)

    server.join(2.5)
    assert server.is_alive()  # no rendezvous yet
    write("job1", closed=False)
    write("job2", closed=True)
    server.join(2.5)
    assert server.is_alive()  # job1's is open; job2's is another job's
    write("job1", closed=True)
    server.join(10)
    assert not server.is_alive() and not stop.is_set()
