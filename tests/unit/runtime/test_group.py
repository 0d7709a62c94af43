"""Joining the job: a rendezvous port another program listens on is refused before anything waits on it; a
port held only by a dead process's closing connections (TIME_WAIT) is not, as torch's own store binds it."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import busy_port, run_main

from lockstep.errors import ConfigError
from lockstep.launch.elastic import RDZV_PORT_FIX
from lockstep.runtime import check_port_free, free_port


def _states(port: int) -> list[str]:
    """The kernel's TCP states (hex codes: 06 TIME_WAIT, 0A LISTEN) of the sockets whose local port is `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                out.append(fields[3])
    return out


def test_port_in_use_message():
    sock, port = busy_port()
    with sock, pytest.raises(ConfigError) as info:
        check_port_free("127.0.0.1", port)
    assert str(info.value) == (
        f"master port {port} on 127.0.0.1 is already in use (Address already in use): a "
        "program listens there; choose another with --master-port, or omit it and lockstep "
        "picks a free one"
    )


def test_the_cli_refuses_a_master_port_in_use(tmp_path, corpus, capsys):
    """`lockstep train` checks --master-port before it starts workers; a hand-started rank 0 checks
    it (init_runtime) before it waits for the others."""
    sock, port = busy_port()
    with sock:
        code, out, err = run_main(
            capsys, "train", "--world-size", "2", "--master-port", port, "--data", corpus
        )
        assert code == 2 and "Traceback" not in err, err
        assert "starting 2 workers" not in out, "workers were started before the input was checked"
        assert f"master port {port}" in err and "already in use" in err and "--master-port" in err
        code, out, err = run_main(
            capsys,
            "train",
            "--world-size",
            "2",
            "--rank",
            "0",
            "--master-port",
            port,
            "--data",
            corpus,
            "--output-dir",
            tmp_path / "r",
        )
        assert code == 2 and "Traceback" not in err, err
        assert "starting 2 workers" not in out, "workers were started before the input was checked"
        assert "already in use" in err


def test_a_port_in_time_wait_only_is_free_and_a_listener_is_not():
    """The server side closes first (as a killed launcher's store does), so its end lands in TIME_WAIT; the server
    set SO_REUSEADDR, as torch's TCPStore does."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    with pytest.raises(
        ConfigError,
        match=rf"^rendezvous port {port} on 127.0.0.1 is already in use .* listens "
        r"there; stop that program .*--rdzv-endpoint HOST:PORT and give every "
        r"node the same$",
    ):
        # a live listener
        check_port_free("127.0.0.1", port, fix=RDZV_PORT_FIX, what="rendezvous port")
    server.close()
    accepted.close()  # the server side closes first ...
    assert client.recv(1) == b""  # ... the client sees the end and closes too
    client.close()
    # TIME_WAIT, no listener
    assert "06" in _states(port) and "0A" not in _states(port), _states(port)
    check_port_free("127.0.0.1", port, fix=RDZV_PORT_FIX, what="rendezvous port")  # passes
    check_port_free("127.0.0.1", port)


HOST_A_STORE = """
import sys, time, torch.distributed as d
store = d.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("up", flush=True)
time.sleep(300)
"""


def test_the_port_of_a_killed_store_host_passes_and_torch_binds_it():
    """A launcher that hosts the rendezvous is killed while a node is connected: its port is in TIME_WAIT for about
    a minute. The check passes at once, and a new torch store binds the same port, as the restart does."""
    port = free_port()
    host = subprocess.Popen(
        [sys.executable, "-c", HOST_A_STORE, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert host.stdout.readline() == "up\n"
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        client.set("k", "v")
        with pytest.raises(
            ConfigError, match=rf"^master port {port} on 127.0.0.1 is already in use"
        ):
            check_port_free("127.0.0.1", port)  # the store is live
    finally:
        host.kill()
        host.wait()
    # no listener: the dead host's connections are closing (FIN_WAIT)
    check_port_free("127.0.0.1", port)
    del client  # this end closes too: the dead host's side, which closed first, waits in TIME_WAIT
    deadline = time.monotonic() + 10
    while "06" not in _states(port):
        assert time.monotonic() < deadline, _states(port)
        time.sleep(0.05)
    check_port_free("127.0.0.1", port)
    again = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    assert again.port == port


def test_an_address_of_another_host_is_said_so():
    with pytest.raises(ConfigError) as info:
        check_port_free("192.0.2.1", 29500)  # TEST-NET-1: never an address of this host
    assert str(info.value) == (
        "192.0.2.1 is not an address of this host (Cannot assign requested address), and "
        "master port 29500 is opened on the host that runs the rendezvous; start rank 0 "
        "(node rank 0) on 192.0.2.1's host, or name an address of this one"
    )
