"""Workers forked from one warm process instead of each importing torch again.

A worker started as torchrun starts it (`python -m lockstep train ...`) spends seconds before its
first line of training: importing torch, lockstep, and torch._dynamo (which every torch optimizer
imports when it is built). With N workers on a node that is N imports at once, and N again at each
elastic restart. Here the launcher starts one server per launch, which has those modules loaded, and
every worker is a fork of it: a worker (and a restart) costs a fork. BENCHMARKS.md, "Worker start",
has the numbers.

The server is a fork of the launcher itself when the launcher has one thread (a fork copies no other
thread, nor a lock one held); else a new interpreter that only imports. A launcher has more when
torch started OpenMP's (OMP_NUM_THREADS above 1), and once those have run a parallel op, a fork's
own first parallel op hangs (tests/unit/launch/test_warm_start.py runs that case). CUDA is never
initialised in the server. torch's agent still starts, watches and stops one plain process per
worker, as torchrun does: lockstep/launch/warm_client.py, which asks the server for the fork and
stands in for it (signals, exit status). A worker gets what `python -m` would give it: the client's
environment (the agent's RANK, LOCAL_RANK, ... included), working directory, standard streams,
sys.path and argv, the signal dispositions of a new process, its own session; and it dies with the
server, which dies with the launcher. LOCKSTEP_WORKER_START=fresh starts each worker as a new
interpreter instead, as a GPU build of torch does by default (worker_start). No library does this:
Python's forkserver start method needs a function entrypoint, which torch's agent then runs through
its multiprocessing context (one failed rank reported, not each).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import random
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import weakref

from lockstep.errors import ConfigError
from lockstep.launch import warm_client
from lockstep.launch.warm_client import FORWARDED, SOCKET_ENV
from lockstep.runtime.process_end import exit_process

START_ENV = "LOCKSTEP_WORKER_START"  # "auto" (the default), "warm" or "fresh"
# The client needs the standard library only, so it starts isolated (-I) and without site (-S):
# site's work (every .pth file of the environment: an editable install's finder, coverage's start
# in the test suite) would be part of every worker's start. An interpreter's start: 0.03-0.04 CPU-s
# with site, under 0.01 without; with the suite's coverage 0.15-0.2 (27 Nov, the Xeon).
CLIENT = ("-I", "-S", warm_client.__file__)
# what a lockstep worker (`lockstep train`, `lockstep doctor`) imports before its first step; the
# rest it imports itself. A server for another module preloads nothing: it has the launcher's.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "lockstep.cli",
    "lockstep.cli.train",
    "lockstep.train.run",
)
_SIGNALS_TO_DEFAULT = (*FORWARDED, signal.SIGCHLD)


def worker_start() -> str:
    """How workers start: 'warm' (forked from the server) or 'fresh' (each a new interpreter).

    'auto', the default: warm on Linux with a CPU build of torch. A GPU build starts them fresh: a
    fork of a process that has touched the CUDA driver cannot use it, and that the server's imports
    never do is not yet proved on a GPU (LOCKSTEP_WORKER_START=warm asks for it there)."""
    how = os.environ.get(START_ENV, "auto")
    if how not in ("auto", "warm", "fresh"):
        raise ConfigError(
            f"{START_ENV}={how!r}: workers start 'warm' (forked from a server that has imported "
            "torch), 'fresh' (each a new interpreter, as torchrun starts them) or 'auto' (warm "
            "with a CPU build of torch; the default); set one, or unset it"
        )
    if sys.platform != "linux" or how == "fresh":
        return "fresh"
    return "fresh" if how == "auto" and _gpu_build() else "warm"


def _gpu_build() -> bool:
    import torch

    return bool(torch.version.cuda or torch.version.hip)


class WarmServer:
    """The node's server of warm workers for one launch: start() before torch's agent, close()
    after it.

    start() returns the entrypoint arguments for the agent (`-I -S .../warm_client.py MODULE
    ARGS`) and puts the server's socket in this process's environment, which the agent gives every
    worker."""

    def __init__(self) -> None:
        self._dir: str | None = None
        self._control = -1  # our end of a pipe whose end (EOF) tells the server to stop
        self._pid: int | None = None
        self._proc: subprocess.Popen | _Forked | None = None

    def start(self, module_args: list[str]) -> list[str]:
        self._dir = tempfile.mkdtemp(prefix="lockstep-warm-")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(self._dir, "socket"))
        listener.listen(64)
        control_r, self._control = os.pipe()
        preload = PRELOAD if module_args[:1] == ["lockstep"] else ()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written twice
            stream.flush()
        if _threads() == 1 and not _gpu_build():  # the launcher may have asked CUDA for devices
            self._pid = os.fork()
            if self._pid == 0:
                os.close(self._control)
                _serve_and_exit(listener, control_r, os.getppid(), preload)
        else:  # a fork of a process with other threads may inherit a lock one of them held
            fds = (listener.fileno(), control_r)
            argv = [sys.executable, "-m", "lockstep.launch.warm_start", *map(str, fds)]
            self._proc = subprocess.Popen(
                [*argv, str(os.getpid()), *preload], pass_fds=fds, start_new_session=True
            )
        listener.close()
        os.close(control_r)
        os.environ[SOCKET_ENV] = os.path.join(self._dir, "socket")
        return [*CLIENT, *module_args]

    def close(self) -> None:
        """Stop the server (any worker still running is killed) and remove its socket."""
        os.environ.pop(SOCKET_ENV, None)
        if self._control >= 0:
            os.close(self._control)
            self._control = -1
        if self._pid is not None:  # a fork of ours: wait for it as Popen would
            self._proc, self._pid = _Forked(self._pid), None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # still importing (the launch failed at once)
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class _Forked:
    """A child made by os.fork, with the two calls of Popen that close() uses."""

    def __init__(self, pid: int):
        self.pid = pid

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 2  # cannot tell: do not fork


def _die_with(parent: int, name: str) -> None:
    """End when `parent` does; named `name` in ps, top and /proc/PID/comm (not the command line)."""
    libc = ctypes.CDLL(None)
    libc.prctl(15, name.encode()[:15])  # PR_SET_NAME
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: when the parent ends, so do we
    if os.getppid() != parent:  # it ended before that was set
        os._exit(1)


def _serve_and_exit(
    listener: socket.socket, control: int, launcher: int, preload: tuple[str, ...]
) -> None:
    """The server's life: it never returns to the launcher's code, nor runs its exit handlers."""
    code = 0
    try:
        # a Ctrl-C at the terminal goes to the launcher, which passes it on (a new interpreter is
        # a session leader already: Popen made it one)
        with contextlib.suppress(PermissionError):
            os.setsid()
        _die_with(launcher, "lockstep-warm")
        # Slurm signals every process of a step: the workers decide what to do, the server waits
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_IGN)
        gc.disable()  # imports make no garbage, only objects the workers keep (lockstep/__main__.py)
        for name in preload:
            importlib.import_module(name)
        gc.collect()
        gc.freeze()  # not garbage: each worker's collections skip it (and so do not copy it)
        gc.enable()
        _Server(listener, control).serve()
    except BaseException:  # noqa: BLE001 - the clients see the socket close and say so
        traceback.print_exc()
        code = 1
    os._exit(code)


class _Server:
    def __init__(self, listener: socket.socket, control: int):
        self.listener, self.control = listener, control
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)  # a SIGCHLD wakes select()
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel = selectors.DefaultSelector()
        for obj in (listener, control, self.wake_r):
            self.sel.register(obj, selectors.EVENT_READ)
        self.clients: dict[int, socket.socket] = {}  # worker pid -> its client's connection

    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.listener:
                    self._start_worker(self.listener.accept()[0])
                elif key.fileobj == self.control:
                    if not os.read(self.control, 64):  # the launcher is done (or gone)
                        self._kill_all()
                        return
                elif key.fileobj == self.wake_r:
                    os.read(self.wake_r, 512)
                else:
                    self._client_spoke(key.fileobj)
            self._reap()

    def _start_worker(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        try:
            head, fds, _, _ = socket.recv_fds(conn, 4, 3)
            size = struct.unpack("!I", head)[0]
            body = b""
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    raise ConnectionError("the client left mid-request")
                body += chunk
            request = json.loads(body)
        except (OSError, ValueError, struct.error) as e:
            with contextlib.suppress(OSError):
                conn.sendall(f"error {type(e).__name__}: {e}\n".encode())
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self._leave_in_child(conn)
            _run_worker(request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        self.clients[pid] = conn
        self.sel.register(conn, selectors.EVENT_READ)

    def _client_spoke(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if conn.recv(64):
                return
        # its client is gone (the agent killed it after the grace period): its worker goes too
        for pid, c in list(self.clients.items()):
            if c is conn:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.sel.unregister(conn)

    def _reap(self) -> None:
        while self.clients:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.clients.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {status}\n".encode())
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn)
            conn.close()

    def _kill_all(self) -> None:
        for pid in self.clients:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _leave_in_child(self, conn: socket.socket) -> None:
        signal.set_wakeup_fd(-1)
        self.sel.close()
        for obj in (self.listener, conn, *self.clients.values()):
            obj.close()
        for fd in (self.control, self.wake_r):
            os.close(fd)


def _run_worker(request: dict, fds: list[int]) -> None:
    """In the fork: become `python -m MODULE ARGS` as the client would have run it; run it; exit."""
    code = 1
    try:
        server = os.getppid()
        os.setsid()  # as torch's agent starts each worker: a session of its own
        _die_with(server, os.path.basename(sys.executable))
        for sig in _SIGNALS_TO_DEFAULT:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new interpreter has it
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # as `python -m` puts them: the working directory first, then PYTHONPATH (a user's modules)
        first = [request["cwd"], *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        sys.path[:] = first + [p for p in sys.path[1:] if p not in first]
        # what the launcher left to be done at its exit (its temporary directories) is not ours
        for finalizer in list(weakref.finalize._registry):
            finalizer.atexit = False
        random.seed()  # a new interpreter seeds from the OS; a fork shares the launcher's sequence
        if "OMP_NUM_THREADS" in os.environ:  # torch read the launcher's value when it was imported
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.argv = list(request["argv"])
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        traceback.print_exc()
    exit_process(code)


if __name__ == "__main__":  # a new interpreter: LISTENER_FD CONTROL_FD LAUNCHER_PID [PRELOAD ...]
    _fd, _control, _launcher = map(int, sys.argv[1:4])
    _serve_and_exit(socket.socket(fileno=_fd), _control, _launcher, tuple(sys.argv[4:]))
