"""The job's rendezvous store served by a process of its own, on a host that runs no worker.

By default node rank 0's launcher hosts the c10d rendezvous store (torch's agent, `is_host`), and an
elastic job cannot outlive that node: the other agents lose the store they re-form the group through.
`lockstep rendezvous` serves the same store (torch's TCPStore, which is all the c10d rendezvous
backend needs) from a process that trains nothing, and every node's launcher joins it as a client
(`--rdzv-store external`): the job then goes on after losing any node, node 0 included, as long as
this process runs. docs/architecture.md, "Facts the launch code relies on".

torch's etcd backend would do the same with an etcd cluster to run and its Python client to install;
one TCPStore process is what the c10d backend already speaks.
"""

from __future__ import annotations

import datetime
import pickle
import signal
import threading

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from lockstep.runtime.group import check_port_free

PORT_FIX = "stop that program, or choose another with --port and give every node the same"


def serve_store(
    host: str, port: int, stop: threading.Event, ready=None, until_closed: str | None = None
) -> None:
    """Serve a TCPStore at host:port until `stop` is set (SIGTERM / SIGINT set it in `run`), or,
    with `until_closed` (a rendezvous id), until torch's agents close that rendezvous: they do when
    the job finishes or its workers have failed for good (not when a signal stops them).
    ready(address) once it listens."""
    check_port_free(host, port, fix=PORT_FIX, what="rendezvous port")
    store = TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        if ready is not None:
            ready(f"{host}:{store.port}")
        while not stop.wait(1.0):
            if until_closed is not None and closed(store, until_closed):
                return
    finally:
        del store  # the server's threads end with it


def closed(store: TCPStore, run_id: str) -> bool:
    """Whether torch's c10d rendezvous `run_id` in `store` is closed (torch.distributed.launcher's
    launch_agent shuts it down unless a signal stopped the agent). Read through torch's own backend,
    as the agents read it."""
    state = C10dRendezvousBackend(store, run_id).get_state()
    return state is not None and bool(pickle.loads(state[0]).closed)


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop
