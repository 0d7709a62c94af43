"""tests/lockstep_process.py: a command forked as a namespace node is in the node's network, UTS and
mount namespaces, with its host name and its own tmpfs, and its handle answers as subprocess.Popen
does (output, signals, exit status, timeouts)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import netns
import pytest
from conftest import forks_warm
from lockstep_process import LockstepProcess, start_lockstep

from lockstep.runtime import free_port


@pytest.fixture(scope="module")
def link():
    yield from netns.two_nodes_or_skip()


def _mounts(pid: int | str) -> list[tuple[str, str]]:
    """(mount point, file system type) of each mount process `pid` sees."""
    return [
        tuple(line.split()[1:3]) for line in Path(f"/proc/{pid}/mounts").read_text().splitlines()
    ]


def test_a_node_is_in_its_namespaces_with_its_host_name_and_memory(link, tmp_path):
    memory = tmp_path / "shm"
    memory.mkdir()
    port = free_port()
    # the node's address exists in its network namespace only: serving there proves it joined it
    node = start_lockstep(
        "rendezvous",
        "--host",
        link.a.addr,
        "--port",
        port,
        ns=link.a.ns,
        host="nodeA",
        memory=memory,
        stderr=subprocess.PIPE,  # c10d warns that it cannot resolve the host name nodeA
    )
    try:
        assert forks_warm() == isinstance(node, LockstepProcess)
        line = node.stdout.readline()
        assert line.startswith(f"lockstep rendezvous: serving the store at {link.a.addr}:{port}")
        ns = {kind: os.readlink(f"/proc/{node.pid}/ns/{kind}") for kind in ("net", "uts", "mnt")}
        assert ns["net"] == os.readlink(f"/proc/{link.a.holder}/ns/net")
        assert ns["uts"] != os.readlink("/proc/self/ns/uts")
        assert ns["mnt"] != os.readlink("/proc/self/ns/mnt")
        hostname = subprocess.run(
            ["nsenter", "-t", str(node.pid), "-u", "hostname"], capture_output=True, text=True
        )
        assert hostname.stdout.strip() == "nodeA", hostname.stderr
        assert (str(memory), "tmpfs") in _mounts(node.pid)
        assert (str(memory), "tmpfs") not in _mounts("self")  # private to the node
        with pytest.raises(subprocess.TimeoutExpired):
            node.communicate(timeout=0.5)  # it serves until it is told to stop
        assert node.poll() is None
        node.send_signal(signal.SIGTERM)
        out, err = node.communicate(timeout=30)
        assert node.returncode == 0 and out == "", err[-3000:]
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(timeout=30)


def test_a_plain_command_keeps_its_streams_apart_and_ends_as_a_process_does(tmp_path):
    proc = start_lockstep(
        "rendezvous", "--host", "127.0.0.1", "--port", free_port(), stderr=subprocess.PIPE
    )
    assert proc.stdout.readline().startswith("lockstep rendezvous: serving the store at")
    assert os.getsid(proc.pid) == proc.pid  # a session of its own, as start_new_session gives
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert proc.communicate(timeout=30) == ("", "")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="give its namespace"):
        start_lockstep("rendezvous", host="nodeA")
    with pytest.raises(ValueError, match="stdout is PIPE or DEVNULL"):
        start_lockstep("rendezvous", stdout=subprocess.STDOUT)
