"""Two "nodes" on one machine: network namespaces joined by a veth pair, optionally rate-limited (test and bench helper).

    with two_nodes(rate="100mbit") as link:        # raises LinkUnavailable where namespaces or tc are not allowed
        ... ip netns exec link.a.ns <cmd> ...      # link.a.addr / link.b.addr: each node's address on the pair
        sent = link.sent_bytes()                   # bytes each end has sent so far, (a -> b, b -> a)
        with ByteMeter(link) as meter: ...         # then meter.bytes_at(t): traffic up to a time.time() t
        measure_rate(link)                         # bytes/s one TCP stream gets from a to b

A rate puts a token-bucket filter (`tc qdisc ... tbf`) on both veth ends, so each direction gets that rate, as
a full-duplex link does (netem is missing from the kernels we run on; tbf works). Used by the multi-node tests
(tests/e2e/test_launch.py, test_compression_link.py) and by bench/bench_compression.py; tests/e2e/test_netns.py
checks the rate and the counters.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_links = itertools.count()
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class LinkUnavailable(RuntimeError):
    """This machine does not let us make namespaces, veth pairs or qdiscs (a container without CAP_NET_ADMIN)."""


@dataclass
class Node:
    ns: str  # network namespace name: run commands in it with `ip netns exec NS ...`
    addr: str  # its address on the veth pair
    dev: str  # its veth end
    holder: int = 0  # a process that sits in the namespace: /proc/PID/net/dev shows its counters without a fork


@dataclass(frozen=True)
class Link:
    a: Node
    b: Node
    rate: str | None  # tc rate on each end ("100mbit"), None = unlimited

    def sent_bytes(self) -> tuple[int, int]:
        """Bytes sent so far by each end (a -> b, b -> a), from the kernel's interface counters."""
        return _tx_bytes(self.a), _tx_bytes(self.b)

    def total_sent(self) -> int:
        return sum(self.sent_bytes())


def rate_bits(rate: str) -> int:
    """'100mbit' -> 100_000_000 (tc's decimal units, bits per second)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?bit)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r} is not a tc rate in bits; write e.g. '100mbit' or '1gbit'")
    return int(float(m[1]) * _UNITS[m[2]])


def tbf_args(rate: str) -> list[str]:
    """tbf settings for `rate`: a bucket of ~2 ms at the rate (at least 256 kB: a 64 kB GSO packet must fit, and
    a timer tick at HZ=100 is 10 ms) and 50 ms of queue, so TCP is paced, not dropped."""
    burst = max(256_000, rate_bits(rate) // 8 // 500)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LinkUnavailable(f"{' '.join(cmd)!r}: {proc.stderr.strip() or proc.returncode}")


def _tx_bytes(node: Node) -> int:
    for line in Path(f"/proc/{node.holder}/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == node.dev:
            return int(counters.split()[8])  # receive has 8 columns, then transmit bytes
    raise RuntimeError(f"{node.dev} is not in namespace {node.ns} (/proc/{node.holder}/net/dev)")


@contextmanager
def two_nodes(rate: str | None = None):
    """Two fresh namespaces on a private subnet joined by a veth pair (each end limited to `rate` when given);
    both removed afterwards, which removes the pair too."""
    n = next(_links)
    tag = f"{os.getpid() % 10000}{'' if n == 0 else f'x{n}'}"  # interface names stay within 15 characters
    subnet = f"10.213.{(os.getpid() + n) % 200 + 20}"
    a = Node(f"lsA{tag}", f"{subnet}.1", f"va{tag}")
    b = Node(f"lsB{tag}", f"{subnet}.2", f"vb{tag}")
    setup = [
        ["ip", "netns", "add", a.ns],
        ["ip", "netns", "add", b.ns],
        ["ip", "link", "add", a.dev, "type", "veth", "peer", "name", b.dev],
    ]
    for node in (a, b):
        setup += [
            ["ip", "link", "set", node.dev, "netns", node.ns],
            ["ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", node.dev],
            ["ip", "-n", node.ns, "link", "set", node.dev, "up"],
            ["ip", "-n", node.ns, "link", "set", "lo", "up"],
        ]
        if rate:
            setup.append(
                [
                    "ip",
                    "netns",
                    "exec",
                    node.ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    node.dev,
                    "root",
                    *tbf_args(rate),
                ]
            )
    holders: list[subprocess.Popen] = []
    try:
        for cmd in setup:
            _run(cmd)
        for node in (a, b):  # `ip netns exec` execs in place: the pid is the sleeper's
            holders.append(subprocess.Popen(["ip", "netns", "exec", node.ns, "sleep", "infinity"]))
            node.holder = holders[-1].pid
            _wait_in(node)
        yield Link(a, b, rate)
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
        for node in (a, b):
            subprocess.run(["ip", "netns", "del", node.ns], capture_output=True)


@contextmanager
def switched_nodes(count: int):
    """`count` fresh namespaces on one private subnet, each joined by a veth pair to a bridge that lives in a
    namespace of its own (a switch: a fresh namespace's empty firewall forwards what the host's might drop);
    all removed afterwards. Node i's address is SUBNET.(i + 1)."""
    n = next(_links)
    tag = f"{os.getpid() % 10000}{'' if n == 0 else f'x{n}'}"
    subnet = f"10.214.{(os.getpid() + n) % 200 + 20}"
    switch = f"lsW{tag}"
    nodes = [Node(f"lsN{i}_{tag}", f"{subnet}.{i + 1}", f"n{i}{tag}") for i in range(count)]
    setup = [
        ["ip", "netns", "add", switch],
        ["ip", "-n", switch, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", switch, "link", "set", "br0", "up"],
    ]
    for i, node in enumerate(nodes):
        port = f"s{i}{tag}"
        setup += [
            ["ip", "netns", "add", node.ns],
            ["ip", "link", "add", node.dev, "type", "veth", "peer", "name", port],
            ["ip", "link", "set", port, "netns", switch],
            ["ip", "-n", switch, "link", "set", port, "master", "br0"],
            ["ip", "-n", switch, "link", "set", port, "up"],
            ["ip", "link", "set", node.dev, "netns", node.ns],
            ["ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", node.dev],
            ["ip", "-n", node.ns, "link", "set", node.dev, "up"],
            ["ip", "-n", node.ns, "link", "set", "lo", "up"],
        ]
    holders: list[subprocess.Popen] = []
    try:
        for cmd in setup:
            _run(cmd)
        for node in nodes:
            holders.append(subprocess.Popen(["ip", "netns", "exec", node.ns, "sleep", "infinity"]))
            node.holder = holders[-1].pid
            _wait_in(node)
        yield nodes
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
        for ns in [node.ns for node in nodes] + [switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def node_argv(ns: str, argv: list[str], host: str | None = None, memory=None) -> list[str]:
    """`argv` run in namespace `ns` as a node of its own: with `host`, under that host name (a UTS namespace);
    with `memory`, over a fresh tmpfs at that path (a mount namespace), gone with the node's last process."""
    if host is None and memory is None:
        return ["ip", "netns", "exec", ns, *argv]
    steps = ([f"hostname {host}"] if host else []) + (
        [f"mount -t tmpfs tmpfs {memory}"] if memory else []
    )
    script = " && ".join([*steps, "exec " + " ".join(argv)])
    return ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "sh", "-c", script]


def two_nodes_or_skip(rate: str | None = None):
    """two_nodes for a pytest fixture (`yield from`): the test is skipped where namespaces or tc are not permitted."""
    import pytest

    try:
        with two_nodes(rate) as link:
            yield link
    except LinkUnavailable as e:
        pytest.skip(f"network namespaces or tc qdiscs are not permitted here ({e})")


def _wait_in(node: Node, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    # until it has entered
    while f"{node.dev}:" not in Path(f"/proc/{node.holder}/net/dev").read_text():
        if time.monotonic() > deadline:
            raise LinkUnavailable(
                f"`ip netns exec {node.ns} sleep` did not enter the namespace within {timeout} s"
            )
        time.sleep(0.01)


class ByteMeter:
    """Samples a link's total sent bytes every `every` s in a thread; bytes_at(t) interpolates at a time.time() t.

    Lets a caller attribute traffic to the steps between two metrics.jsonl records (their `time` field), which
    leaves out start-up (rendezvous, DDP's parameter broadcast) and the end (eval, checkpoint)."""

    def __init__(self, link: Link, every: float = 0.02):
        self.link, self.every = link, every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "ByteMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            self.samples.append((time.time(), self.link.total_sent()))
            if self._stop.wait(self.every):
                self.samples.append((time.time(), self.link.total_sent()))
                return

    def bytes_at(self, t: float) -> float:
        times = [s[0] for s in self.samples]
        i = bisect.bisect_left(times, t)
        if i == 0 or i == len(times):
            raise ValueError(
                f"time {t:.3f} is outside the metered span {times[0]:.3f}..{times[-1]:.3f}"
            )
        (t0, b0), (t1, b1) = self.samples[i - 1], self.samples[i]
        return b0 + (b1 - b0) * (t - t0) / max(t1 - t0, 1e-9)


# a receiver in b that counts what it reads; the sender in a writes for `seconds` and prints bytes/s at the receiver
_SINK = """import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1); print("ready", flush=True); c, _ = s.accept(); n = 0
while chunk := c.recv(1 << 20):
    n += len(chunk)
print(n, flush=True)"""
_SOURCE = """import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = bytes(1 << 16); end = time.monotonic() + float(sys.argv[3])
start = time.monotonic()
while time.monotonic() < end:
    c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); print(time.monotonic() - start, flush=True)"""


def measure_rate(link: Link, seconds: float = 2.0, port: int = 5201) -> float:
    """Bytes per second one TCP stream moves from a to b (what arrived over the time the sender took)."""
    sink = subprocess.Popen(
        ["ip", "netns", "exec", link.b.ns, sys.executable, "-c", _SINK, link.b.addr, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout.readline().strip() == "ready"
        took = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                link.a.ns,
                sys.executable,
                "-c",
                _SOURCE,
                link.b.addr,
                str(port),
                str(seconds),
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=True,
        ).stdout
        received = int(sink.communicate(timeout=30)[0])
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    return received / float(took)


def run_on_both(
    link: Link,
    commands: tuple[list[str], list[str]],
    timeout: float,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run commands[0] in namespace a and commands[1] in b at once; both outputs (stdout + stderr). A pair that
    is not done within `timeout` s is killed, workers included, and raises; so does a non-zero exit."""
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", node.ns, *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for node, cmd in zip((link.a, link.b), commands)
    ]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_tree(proc)
    if any(p.returncode for p in procs):
        raise RuntimeError(
            f"exit codes {[p.returncode for p in procs]}:\n" + "\n".join(o[-3000:] for o in outs)
        )
    return outs


def _kill_tree(proc: subprocess.Popen) -> None:
    # torch elastic starts its workers in sessions of their own, so a process group kill misses them
    sys.path.insert(0, str(Path(__file__).parent))
    from procs import descendants

    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
