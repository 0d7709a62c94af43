"""`lockstep ARGS` as a process a test holds while it runs (to signal it, kill it, read its output
as it goes), alone or as a node of its own on this machine: in one of tests/netns.py's network
namespaces, with its own host name (a UTS namespace) and, when asked, its own memory (a tmpfs at a
path, in a mount namespace of its own: gone with the node's last process).

    proc = start_lockstep("launch", cfg, "--nproc", "2")
    node = start_lockstep("launch", cfg, ..., ns=ns, host="node0", memory=tmp_path / "shm")
    out = node.communicate(timeout=180)[0]       # stdout and stderr together, as text
    kill_tree(node)                              # tests/procs.py: the process and all below it

The process is a fork of the suite's warm server (tests/conftest.py, run_lockstep); a node's joins
its namespaces itself, as `ip netns exec NS unshare --uts --mount sh -c 'hostname H && mount -t
tmpfs tmpfs PATH && exec python -m lockstep ...'` does (setns, unshare, mount, sethostname). Then it
runs `lockstep ARGS` with the environment, working directory and sys.path that command would have,
in a session of its own. A new interpreter would import torch and lockstep first: 1.4-2.2 CPU-s of
each of the ~45 such commands of the suite (28 Nov 2026, 2-core EPYC, coverage on). Where the suite
starts every command as a new interpreter (conftest.forks_warm: a GPU build of torch, or `env` sets
a variable read at import), it is that command line, started by subprocess (netns.node_argv for a
node). The handle offers the parts of subprocess.Popen the tests use: pid (the `lockstep` process
itself), stdout and stderr (text), poll, wait, communicate, returncode, send_signal, kill.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import netns
from conftest import (
    RANK_PRELOAD,
    _forked,
    _Inherited,
    _lockstep_main,
    forks_warm,
    lockstep_cmd,
)
from procs import kill_tree

# <sched.h>, <sys/mount.h>
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
PR_SET_PDEATHSIG = 1
_STDERR = (subprocess.STDOUT, subprocess.PIPE, subprocess.DEVNULL, None)


def start_lockstep(
    *args,
    ns: str | None = None,
    host: str | None = None,
    memory: Path | None = None,
    env: dict | None = None,
    stdout: int = subprocess.PIPE,
    stderr: int | None = subprocess.STDOUT,
) -> LockstepProcess | subprocess.Popen:
    """`lockstep ARGS`, in namespace `ns` if given (host name `host`, a fresh tmpfs at `memory`), in
    a session of its own; stdout PIPE or DEVNULL, stderr STDOUT, PIPE, DEVNULL or None (this
    process's), as subprocess.Popen takes them."""
    if ns is None and (host or memory):
        raise ValueError("a host name or a memory of its own is for a node: give its namespace")
    if stdout not in (subprocess.PIPE, subprocess.DEVNULL) or stderr not in _STDERR:
        raise ValueError(
            f"stdout={stdout!r}, stderr={stderr!r}: stdout is PIPE or DEVNULL, stderr one of "
            "STDOUT, PIPE, DEVNULL or None"
        )
    argv = [str(a) for a in args]
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if not forks_warm(env):
        cmd = lockstep_cmd(*argv)
        return subprocess.Popen(
            cmd if ns is None else netns.node_argv(ns, cmd, host, memory),
            stdout=stdout,
            stderr=stderr,
            text=True,
            env=environ,
            start_new_session=True,
        )
    node = None if ns is None else (ns, host, None if memory is None else str(memory))
    return LockstepProcess(argv, environ, node, (stdout, stderr))


class LockstepProcess:
    """`lockstep ARGS` forked from the warm server, handled as a subprocess.Popen with text pipes.
    `node`: (namespace, host name, memory) or None; `streams`: (stdout, stderr) as Popen's."""

    def __init__(self, argv: list[str], environ: dict, node: tuple | None, streams: tuple):
        self.args = lockstep_cmd(*argv)
        self.returncode: int | None = None
        out_r, out_w = _stream(streams[0])
        err_r, err_w = (None, out_w) if streams[1] == subprocess.STDOUT else _stream(streams[1])
        multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts
        self._proc = multiprocessing.get_context("forkserver").Process(
            target=_forked,
            name="lockstep",
            args=(
                0,
                environ,
                (_Inherited(out_w), _Inherited(err_w)),
                _node_main,
                (argv, os.getcwd(), node),
            ),
        )
        try:
            self._proc.start()
        finally:
            for fd in {out_w, err_w}:
                os.close(fd)
        self.pid = self._proc.pid
        self.stdout = None if out_r is None else open(out_r, errors="replace")
        self.stderr = None if err_r is None else open(err_r, errors="replace")
        self._read: dict[str, str] = {}
        self._readers: list[threading.Thread] = []

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._proc.exitcode  # negative: the signal that ended it, as Popen
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Everything the node writes until it ends; TimeoutExpired leaves it running, as Popen."""
        if not self._readers:
            streams = {"out": self.stdout, "err": self.stderr}
            for name, stream in streams.items():
                if stream is not None:
                    thread = threading.Thread(target=self._drain, args=(name, stream), daemon=True)
                    thread.start()
                    self._readers.append(thread)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._readers:
            thread.join(_left(deadline))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(_left(deadline))
        return self._read.get("out"), self._read.get("err")

    def _drain(self, name: str, stream) -> None:
        self._read[name] = stream.read()
        stream.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _stream(kind: int | None) -> tuple[int | None, int]:
    """(our end to read, or None; the child's end) for a stream given as Popen takes it."""
    if kind == subprocess.PIPE:
        return os.pipe()
    if kind == subprocess.DEVNULL:
        return None, os.open(os.devnull, os.O_WRONLY)
    return None, os.dup(2)  # None: where this process writes its own


def _node_main(rank: int, argv: list[str], cwd: str, node: tuple | None) -> None:
    """In the fork: a session of its own that ends with the warm server (the suite's worker), the
    node's namespaces if it is one, then `lockstep ARGS`."""
    server = os.getppid()
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:  # the server ended before that was set
        os._exit(1)
    if node is not None:
        _enter(libc, *node)
    _lockstep_main(rank, argv, cwd)


def _enter(libc, ns: str, host: str | None, memory: str | None) -> None:
    """Join network namespace `ns` (`ip netns add` made it: /run/netns/NS), then a mount and a UTS
    namespace of our own, mounts private (nothing we mount is seen outside), as `unshare --uts
    --mount` makes them."""

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), f"setns to network namespace {ns}")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare the mount and UTS namespaces")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    if host:
        socket.sethostname(host)
    if memory:
        check(libc.mount(b"tmpfs", os.fsencode(memory), b"tmpfs", 0, None), f"tmpfs at {memory}")


def run_pair(link: netns.Link, args: tuple[list, list], timeout: float) -> list[str]:
    """`lockstep ARGS[0]` on node a and ARGS[1] on node b at once; both outputs (stdout + stderr). A
    pair not done within `timeout` s is killed, workers included, and raises; so does a non-zero
    exit (netns.run_on_both, for lockstep commands)."""
    nodes = [start_lockstep(*a, ns=node.ns) for node, a in zip((link.a, link.b), args)]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for node in nodes:
            outs.append(node.communicate(timeout=max(1.0, _left(deadline)))[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node)
    if any(node.returncode for node in nodes):
        raise RuntimeError(
            f"exit codes {[n.returncode for n in nodes]}:\n" + "\n".join(o[-3000:] for o in outs)
        )
    return outs
