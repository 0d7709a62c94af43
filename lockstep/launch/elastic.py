"""Start this node's workers through torchrun's elastic agent (not a spawner of our own).

The agent gives workers the environment torchrun would (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_*), forwards SIGTERM/SIGINT to them, restarts the group on
failure when asked, and reports which rank failed; workers join the group through
`lockstep.runtime.init_runtime` exactly as they do under torchrun.

For several nodes it also works out what torchrun leaves to the user and what makes
multi-node launches hang when wrong (DESIGN.md, "Facts about the machines"): whether
this node hosts the c10d rendezvous (`is_host`), the address other nodes reach it at
(`local_addr`), and the network interface gloo should use (GLOO_SOCKET_IFNAME).
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import struct
import sys
import time
import uuid
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from lockstep.errors import ConfigError
from lockstep.runtime import check_port_free
from lockstep.watchdog import HANG_EXIT_CODE


class LaunchStopped(RuntimeError):
    """The workers ended before their job was done. Only the caller knows what they leave behind (a training
    run's checkpoint): it sets `note`, which the message then ends with."""

    note: str | None = None

    def __str__(self) -> str:
        return f"{super().__str__()}; {self.note}" if self.note else super().__str__()


class WorkerFailed(LaunchStopped):
    """One or more workers exited with an error; the message names the ranks and how each ended."""

    def __init__(self, failed: str):
        super().__init__(f"{failed}; the ranks' own messages are above, and a run's logs/ hold each rank's")
        self.failed = failed


class LaunchInterrupted(LaunchStopped):
    """The launcher got SIGTERM / SIGINT and passed it to the workers. Whether they committed a checkpoint first
    is not known here: a worker stuck in a collective never runs its handler and is killed after the grace period."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum} ({signal.Signals(signum).name})")
        self.signum = signum


def describe_exit(rank: int, exitcode: int) -> str:
    """How a worker ended, for a person: its exit code, the signal that killed it, or the hang watchdog."""
    if exitcode == HANG_EXIT_CODE:
        return f"rank {rank} was stopped by the hang watchdog (exit code {exitcode}; see the run's hang/report.txt)"
    if exitcode < 0:  # torch elastic reports death by signal N as -N
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with an error (exit code {exitcode})"


@dataclass(frozen=True)
class NodePlan:
    """How this node joins a multi-node rendezvous."""

    endpoint: str  # HOST:PORT of the c10d rendezvous
    is_host: bool  # this node runs the rendezvous store
    local_addr: str  # the address the other nodes reach this node at
    interface: str | None  # the interface that carries that address (for GLOO_SOCKET_IFNAME)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"rendezvous endpoint {endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
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
        raise ConfigError(f"rendezvous host {host!r} does not resolve on this node; use an IP address or fix DNS") from None
    local = local_ipv4_addresses()
    is_host = node_rank == 0 if node_rank is not None else host_ip in local
    # the source address of the route to the endpoint is the one the other nodes can reach us at
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host_ip, port))  # UDP: picks the route, sends nothing
        local_addr = s.getsockname()[0]
    if local_addr.startswith("127.") and not host_ip.startswith("127."):
        raise ConfigError(f"the route to {endpoint} leaves from {local_addr} (loopback); other nodes cannot reach "
                          "this node there: check the node's network configuration")
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


def launch_workers(module_args: list[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None,
                   node_rank: int | None = None, max_restarts: int = 0, rdzv_timeout: float = 120.0,
                   rdzv_id: str | None = None) -> None:
    """Run `python -m <module_args...>` as `nproc` workers on this node of an `nnodes`-node job."""
    rdzv_configs: dict = {}
    local_addr = None
    if nnodes == 1 and rdzv_endpoint is None:
        endpoint = "127.0.0.1:0"  # port 0: the agent binds a free port itself, as `torchrun --standalone` does
    elif rdzv_endpoint is None:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (an address of node rank 0)")
    else:
        node = plan_node(rdzv_endpoint, node_rank)
        endpoint, local_addr = node.endpoint, node.local_addr
        rdzv_configs["is_host"] = node.is_host
        if node.is_host:
            check_port_free(*parse_endpoint(endpoint))
        else:
            wait_for_endpoint(endpoint, rdzv_timeout)
        if node.interface and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = node.interface  # inherited by the workers
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        # every node of a job must name the same run; one node alone can take a fresh one
        run_id=rdzv_id or os.environ.get("SLURM_JOB_ID") or (f"lockstep-{uuid.uuid4().hex[:8]}" if nnodes == 1 else "lockstep"),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        rdzv_timeout=int(rdzv_timeout),
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        local_addr=local_addr,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", *module_args)
    except ChildFailedError as e:
        raise WorkerFailed("; ".join(describe_exit(r, f.exitcode) for r, f in sorted(e.failures.items()))) from None
    except SignalException as e:  # the agent already forwarded the signal and waited for the workers to exit
        raise LaunchInterrupted(int(e.sigval)) from None


def launch_local(module_args: list[str], nproc: int, master_port: int | None = None, max_restarts: int = 0) -> None:
    """`nproc` workers of a one-node job on this machine."""
    if master_port is None:
        launch_workers(module_args, nproc, max_restarts=max_restarts)
        return
    launch_workers(module_args, nproc, rdzv_endpoint=f"127.0.0.1:{master_port}", node_rank=0,
                   max_restarts=max_restarts)
