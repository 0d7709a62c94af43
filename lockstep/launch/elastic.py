"""Start this node's workers through torchrun's elastic agent (not a spawner of our own).

The agent gives workers the environment torchrun would (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_*), forwards SIGTERM/SIGINT to them, restarts the group on
failure when asked, and reports which rank failed; workers join the group through
`lockstep.runtime.init_runtime` exactly as they do under torchrun. With a CPU build of torch each
worker the agent starts stands in for a fork of this launch's warm server, which has torch imported
already (lockstep/launch/warm_start.py).

An elastic job (`--nnodes MIN:MAX`) is torch's own: min/max nodes for the c10d rendezvous, restarts when a
node dies or joins. lockstep adds a fresh worker store per rendezvous round, a timeout that says who came,
and a clear end when the node hosting the rendezvous is gone.

For several nodes it also works out what torchrun leaves to the user and what makes
multi-node launches hang when wrong (docs/architecture.md, "Facts the launch code relies on"): whether
this node hosts the c10d rendezvous (`is_host`), the address other nodes reach it at
(`local_addr`), and the network interface gloo should use (GLOO_SOCKET_IFNAME).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import fcntl
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from lockstep.errors import ConfigError
from lockstep.launch.console import CppFramesToLog
from lockstep.launch.options import check_rdzv_conf
from lockstep.launch.warm_start import WarmServer, worker_start
from lockstep.runtime.failures import describe_failures
from lockstep.runtime.group import MASTER_PORT_FIX, check_port_free


class LaunchStopped(RuntimeError):
    """The workers ended before their job was done. Only the caller knows what they leave behind (a training
    run's checkpoint): it sets `note`, which the message then ends with."""

    note: str | None = None

    def __str__(self) -> str:
        return f"{super().__str__()}; {self.note}" if self.note else super().__str__()


class WorkerFailed(LaunchStopped):
    """One or more workers exited with an error; the message names the ranks and how each ended."""

    def __init__(self, failed: str):
        super().__init__(
            f"{failed}; the ranks' own messages are above, and a run's logs/ hold each rank's"
        )
        self.failed = failed


class LaunchInterrupted(LaunchStopped):
    """The launcher got SIGTERM / SIGINT and passed it to the workers. Whether they committed a checkpoint first
    is not known here: a worker stuck in a collective never runs its handler and is killed after the grace period."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum} ({signal.Signals(signum).name})")
        self.signum = signum


class RendezvousLost(LaunchStopped):
    """The c10d store of the rendezvous stopped answering: the launcher of the node that hosts it ended
    (or, with --rdzv-store external, the `lockstep rendezvous` process)."""

    def __init__(self, endpoint: str, external: bool = False):
        if external:
            super().__init__(
                f"lost the rendezvous at {endpoint}: the store there (`lockstep rendezvous`) is gone; "
                "start it again, then the nodes, with the same commands"
            )
            return
        super().__init__(
            f"lost the rendezvous at {endpoint}: the launcher of node rank 0, which hosts it, is gone. "
            "A job goes on without any other node, but not without that one; start node rank 0 again, "
            "then this node, with the same commands (or serve the store elsewhere: `lockstep "
            "rendezvous`, and --rdzv-store external)"
        )


@dataclass(frozen=True)
class NodePlan:
    """How this node joins a multi-node rendezvous."""

    endpoint: str  # HOST:PORT of the c10d rendezvous
    is_host: bool  # this node runs the rendezvous store
    local_addr: str  # the address the other nodes reach this node at
    interface: str | None  # the interface that carries that address (for GLOO_SOCKET_IFNAME)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """`--rdzv-endpoint HOST:PORT` -> (HOST, PORT), PORT a TCP port (1-65535)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r} is not HOST:PORT; write the address of "
            "node rank 0 and a port, e.g. 10.0.0.1:29500"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r}: port {port!r} is not a TCP port; ports "
            f"are 1-65535, e.g. {host}:29500"
        )
    return host, int(port)


def local_ipv4_addresses() -> dict[str, str]:
    """address -> interface name, for every IPv4 address of this host (or network namespace)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address; the standard library has no direct call for it
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            out[socket.inet_ntoa(packed[20:24])] = name
    return out


def plan_node(endpoint: str, node_rank: int | None) -> NodePlan:
    host, port = parse_endpoint(endpoint)
    try:
        host_ip = socket.gethostbyname(host)
    except OSError:
        raise ConfigError(
            f"rendezvous host {host!r} does not resolve on this node; use an IP address or fix DNS"
        ) from None
    local = local_ipv4_addresses()
    is_host = node_rank == 0 if node_rank is not None else host_ip in local
    # the source address of the route to the endpoint is the one the other nodes can reach us at
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host_ip, port))  # UDP: picks the route, sends nothing
        local_addr = s.getsockname()[0]
    if local_addr.startswith("127.") and not host_ip.startswith("127."):
        raise ConfigError(
            f"the route to {endpoint} leaves from {local_addr} (loopback); other nodes cannot reach "
            "this node there: check the node's network configuration"
        )
    return NodePlan(f"{host_ip}:{port}", is_host, local_addr, local.get(local_addr))


def wait_for_endpoint(endpoint: str, timeout: float) -> None:
    """A node that does not host the rendezvous waits (bounded) for it to answer, instead of hanging in torchrun."""
    host, port = parse_endpoint(endpoint)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"rendezvous endpoint {endpoint} did not answer within {timeout:.0f} s ({e.strerror or e}); "
                    "start node rank 0 with the same --rdzv-endpoint first, and check that this node can reach "
                    "that address and port (firewall, the address of the right interface)"
                ) from None
            time.sleep(0.5)


def join_rendezvous(
    rdzv_endpoint: str,
    node_rank: int | None,
    external_store: bool,
    timeout: float,
    port_words: tuple[str, str],
) -> NodePlan:
    """How this node joins: the rendezvous host checks its port is free, the others wait (bounded) for it to
    answer, and gloo is told the interface the others reach this node on."""
    node = plan_node(rdzv_endpoint, None if external_store else node_rank)
    if external_store:  # `lockstep rendezvous` serves it: no node hosts it, whatever its address
        node = dataclasses.replace(node, is_host=False)
    if node.is_host:
        check_port_free(*parse_endpoint(node.endpoint), fix=port_words[1], what=port_words[0])
    else:
        wait_for_endpoint(node.endpoint, timeout)
    if node.interface and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = node.interface  # inherited by the workers
    return node


# what a launcher with --rdzv-endpoint (lockstep launch, lockstep doctor) says when node rank 0's
# port is taken
RDZV_PORT_FIX = (
    "stop that program (a launcher of an earlier run?), or choose another port in "
    "--rdzv-endpoint HOST:PORT and give every node the same"
)


def event_method_name(depth: int = 2) -> str:
    """What torch's rendezvous names each event it records by (a heartbeat, a sync, the close): the
    function `depth` frames up, as its own get_method_name finds it with inspect.stack(), twice an
    event, which reads every frame's source and walks every loaded module: 0.11-0.15 CPU-s of each
    launch here, 40 ms an event under the test suite's coverage, where the three launch test files
    took 138 and 149 CPU-s with torch's and 119 and 119 with this (28 Nov 2026, 2-core EPYC)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a shallower stack, as torch's answers it
        return "no_method_name"


def launch_workers(
    module_args: list[str],
    nproc: int,
    nodes: tuple[int, int] = (1, 1),
    rdzv_endpoint: str | None = None,
    node_rank: int | None = None,
    max_restarts: int = 0,
    rdzv_timeout: float = 120.0,
    rdzv_id: str | None = None,
    rdzv_conf: dict[str, str] | None = None,
    port_words: tuple[str, str] = ("rendezvous port", RDZV_PORT_FIX),
    console_log: Path | None = None,
    external_store: bool = False,
) -> None:
    """Run `python -m <module_args...>` as `nproc` workers on this node of a job of nodes = (MIN, MAX) nodes.

    MIN < MAX is an elastic job: torch's agent starts the workers once MIN nodes are there (after waiting
    last_call_timeout for more), re-forms the group without a node that died (a restart, counted against
    max_restarts) and grows it when a node joins (a restart that is not counted); the workers resume from the
    last committed checkpoint at the new world size. The node that hosts the rendezvous must stay up;
    with `external_store` no node hosts it: `lockstep rendezvous` serves it at rdzv_endpoint
    (lockstep.launch.store), and the job outlives any node.
    `port_words` (what, fix) name its port in a refusal as the calling command knows it
    (check_port_free). With `console_log`, the console shows no C++ stack frames while the
    workers run; that file gets the full text (CppFramesToLog).
    """
    low, high = nodes
    check_rdzv_conf(rdzv_conf or {})  # is_host is this function's to set
    rdzv_configs: dict = {"join_timeout": int(rdzv_timeout), **(rdzv_conf or {})}
    local_addr = None
    if high == 1 and rdzv_endpoint is None:
        endpoint = "127.0.0.1:0"  # port 0: the agent binds a free port itself, as `torchrun --standalone` does
    elif rdzv_endpoint is None:
        raise ConfigError(
            f"--nnodes {_spec(nodes)} needs --rdzv-endpoint HOST:PORT (an address of node rank 0)"
        )
    else:
        node = join_rendezvous(rdzv_endpoint, node_rank, external_store, rdzv_timeout, port_words)
        endpoint, local_addr, rdzv_configs["is_host"] = node.endpoint, node.local_addr, node.is_host
    if low < high:
        # torch's agents share one TCP store for the workers of every rendezvous round, and the restart count
        # (the runtime's key prefix on that store) is per node: after a node rejoins, its workers and the
        # survivors' would look under different prefixes, or under one the dead workers wrote. With this set,
        # rank 0's worker hosts a fresh store for every round (MASTER_PORT picked by its agent; env://). Fixed
        # jobs keep the shared store: their agents restart together, with the same count.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    run_id = (
        rdzv_id
        or os.environ.get("SLURM_JOB_ID")
        or (f"lockstep-{uuid.uuid4().hex[:8]}" if high == 1 else "lockstep")
    )
    config = LaunchConfig(
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=nproc,
        run_id=run_id,  # every node of a job must name the same run; one node alone can take a fresh one
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        rdzv_timeout=int(rdzv_timeout),
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr=local_addr,
    )
    # before any thread of ours starts (the server may be a fork of this process); it imports while
    # the agent meets the other nodes
    server = WarmServer() if worker_start() == "warm" else None
    entry_args = server.start(module_args) if server else ["-m", *module_args]
    watcher = RendezvousWatcher(endpoint, run_id) if high > 1 else None
    dynamic_rendezvous.get_method_name = event_method_name
    try:
        with CppFramesToLog(console_log) if console_log else contextlib.nullcontext():
            try:
                elastic_launch(config, entrypoint=sys.executable)(*entry_args)
            finally:  # here: the watcher's last read of a store that is gone logs C++ frames to the same place
                if watcher:
                    watcher.stop()
                if server:
                    server.close()
    except ChildFailedError as e:
        raise WorkerFailed(describe_failures(e.failures)) from None
    # the agent already forwarded the signal and waited for the workers to exit
    except SignalException as e:
        raise LaunchInterrupted(int(e.sigval)) from None
    except RendezvousConnectionError:
        raise RendezvousLost(endpoint, external_store) from None
    except RendezvousTimeoutError:
        arrived = watcher.arrived() if watcher else []
        raise ConfigError(
            f"waited {rdzv_timeout:.0f} s (--rdzv-timeout) for at least {low} node(s) (--nnodes {_spec(nodes)}) at "
            f"{endpoint}; {len(arrived)} arrived: {', '.join(arrived) or 'none seen'}. Start the other nodes with the "
            "same --rdzv-endpoint and --rdzv-id, or lower MIN"
        ) from None


def _spec(nodes: tuple[int, int]) -> str:
    return str(nodes[0]) if nodes[0] == nodes[1] else f"{nodes[0]}:{nodes[1]}"


class RendezvousWatcher:
    """Reads, once a second, which nodes have joined torch's c10d rendezvous, so that a rendezvous that times
    out can say who came. torch's timeout error names nobody, and by the time it is raised on the host node the
    store that held the answer may be gone; hence a reader of our own beside the agent (a client of the same
    store, reading the state torch keeps under torch.rendezvous.<run id>)."""

    def __init__(self, endpoint: str, run_id: str, interval: float = 1.0):
        self.endpoint, self.key, self.interval = endpoint, f"torch.rendezvous.{run_id}", interval
        self._seen: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="lockstep-rendezvous-watcher", daemon=True
        )
        self._thread.start()

    def arrived(self) -> list[str]:
        """The nodes (address, and the agent's pid) in the rendezvous when it was last read."""
        return list(self._seen)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)  # a read in flight ends within the store client's 5 s timeout

    def _watch(self) -> None:
        host, port = parse_endpoint(self.endpoint)
        store = None
        while not self._done.wait(self.interval):
            try:
                if store is None:
                    store = TCPStore(
                        host, port, is_master=False, timeout=datetime.timedelta(seconds=5)
                    )
                if store.check([self.key]):
                    # torch's own pickled _RendezvousState, from the job's own store (the agents unpickle it too)
                    state = pickle.loads(base64.b64decode(store.get(self.key)))
                    nodes = [*state.participants, *state.wait_list]
                    # a node that timed out leaves the state before it raises: keep who came
                    if nodes:
                        self._seen = sorted(f"{n.addr} (agent pid {n.pid})" for n in nodes)
            except Exception:  # not up yet, or gone: keep what was seen last  # noqa: BLE001
                store = None


def launch_local(
    module_args: list[str], nproc: int, master_port: int | None = None, max_restarts: int = 0
) -> None:
    """`nproc` workers of a one-node job on this machine."""
    if master_port is None:
        launch_workers(module_args, nproc, max_restarts=max_restarts)
        return
    launch_workers(
        module_args,
        nproc,
        rdzv_endpoint=f"127.0.0.1:{master_port}",
        node_rank=0,
        max_restarts=max_restarts,
        port_words=("master port", MASTER_PORT_FIX),
    )
