"""What torch's agent starts for each worker: `python -I -S .../warm_client.py MODULE ARGS`.

It asks the node's warm server (lockstep/launch/warm_start.py) for a fork that runs `python -m
MODULE ARGS` with this process's environment, working directory and standard streams, and then
stands in for that worker: a signal it gets (the agent's SIGTERM to its process group) goes on to
the worker, and it ends as the worker ended, with the same exit code or killed by the same signal.
So torch's agent keeps starting, watching and stopping plain processes, as torchrun does. With no
server to ask (LOCKSTEP_WARM_SOCKET unset, or gone), it becomes the worker itself: `exec python -m
MODULE ARGS`.

Only the standard library here: this module's own start is part of every worker's, and it runs
without site (lockstep.launch.warm_start.CLIENT). Its tests start it with `-m`, as a module.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "LOCKSTEP_WARM_SOCKET"
# what the agent or a person may send a worker; SIGKILL cannot be passed on: the server sees this
# process go and kills the worker
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def main(module_args: list[str]) -> None:
    path = os.environ.get(SOCKET_ENV)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.connect(path or "")
    except OSError:  # no server: the worker starts as torchrun would start it
        server.close()
        os.execv(sys.executable, [sys.executable, "-m", *module_args])
    request = json.dumps(
        {"argv": module_args, "env": dict(os.environ), "cwd": os.getcwd()}
    ).encode()
    worker: list[int] = []
    pending: list[int] = []

    def forward(signum, frame):
        if not worker:  # before the server said which process it is
            pending.append(signum)
            return
        try:
            os.kill(worker[0], signum)
        except ProcessLookupError:  # it has just ended: the server is telling us how
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    socket.send_fds(server, [struct.pack("!I", len(request)) + request], [0, 1, 2])
    reply = server.makefile("r")
    first = reply.readline().split()
    if first[:1] != ["pid"]:
        sys.stderr.write(
            f"lockstep: the warm server did not start the worker: {' '.join(first[1:])}\n"
        )
        sys.exit(1)
    worker.append(int(first[1]))
    for signum in pending:
        forward(signum, None)
    last = reply.readline().split()  # "exit STATUS" (os.waitpid's), or nothing: the server is gone
    worker.clear()
    status = int(last[1]) if last[:1] == ["exit"] else None
    code = 1 if status is None else os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: end the same way, so that the agent reports that signal
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
