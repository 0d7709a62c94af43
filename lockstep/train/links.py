"""The ring of links between neighbouring ranks, checked and timed: by `lockstep doctor` before a job
(its "p2p ring" row, lockstep.doctor.checks) and by the straggler watch during one, when
communication is most of the step (lockstep.train.stragglers).

    probe_ring  each rank times its incoming link, rank-1 -> rank: it asks rank-1 for 512 KiB and
                receives them, a few rounds, keeping the fastest; alternate links at a time
    slow_links  the links much slower than the others of their kind, each a line naming it

Links are compared with links of their own kind only: within a host (shared memory or loopback)
and between hosts (the network) differ by design. A link warns when its time is more than
LINK_MARGIN above the median of the other links of its kind and more than LINK_FLOOR_S above it:
the margin is the straggler margin measured on these shared machines (0.5: BENCHMARKS.md,
"Straggler margin: fault-free runs"), and the fastest of ROUNDS rounds, with the floor, keeps a
busy host's scheduling delays from reading as a slow link: under this project's test suite on 2
cores, the fastest of 5 rounds over loopback once took 3.2 ms against 0.6 ms the other way. So a link
is named only when 512 KiB take 5 ms more than on its peers: slower than about 0.8 Gbit/s where
they are fast; a 1 Gbit/s link among 10 Gbit/s ones goes unnamed here (the bandwidth table shows
it). What a slow link costs a training run shows in its exposed communication
(lockstep.train.stragglers).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from lockstep.runtime import Runtime
from lockstep.runtime.cuda import synchronize
from lockstep.train.comm_estimate import format_bytes

ROUNDS, LINK_MARGIN, LINK_FLOOR_S = 7, 0.5, 0.005
KiB = 1 << 10
SLOW_LINK_FIX = (
    "a slow link holds every collective back: check the sender's interface speed (`ethtool IFACE`), "
    "a traffic shaper on it (`tc qdisc show dev IFACE`), errors and drops (`ip -s link`), and that "
    "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name the fast interface on every node; gradient "
    "compression (ddp.compression) sends fewer bytes over it meanwhile"
)


def _phase(link: int, n: int) -> int:
    """The phase link `link` (rank link -> link+1) is timed in: alternate links, so that no rank is in
    two at once; with an odd world the last link (into rank 0) has a third phase of its own."""
    return 2 if n % 2 and link == n - 1 else link % 2


def probe_ring(rt: Runtime, numel: int = 64 * KiB) -> dict:
    """The link rank-1 -> rank, timed by this rank: it sends rank-1 a one-element go and receives
    the payload back, ROUNDS times, and keeps the fastest. One link at a time per rank (_phase):
    the time is the payload's over that link plus the go's latency the other way, and no barrier's
    skew between two ranks' clocks enters it."""
    n, r = rt.world_size, rt.rank
    src, dst = (r - 1) % n, (r + 1) % n
    payload = torch.arange(numel, dtype=torch.int64, device=rt.device) * (r + 1)
    got, go = torch.empty_like(payload), torch.zeros(1, dtype=torch.int64, device=rt.device)
    times, ok = [], True
    for phase in range(3 if n % 2 else 2):
        dist.barrier()
        for _ in range(ROUNDS):
            if _phase(src, n) == phase:  # receive on my incoming link
                got.zero_()
                t0 = time.perf_counter()
                dist.send(go, src)
                dist.recv(got, src)
                synchronize(rt.device)
                times.append(time.perf_counter() - t0)
                expected = torch.arange(numel, dtype=torch.int64) * (src + 1)
                ok = ok and torch.equal(got.cpu(), expected)
            if _phase(r, n) == phase:  # send on my outgoing link
                dist.recv(go, dst)
                dist.send(payload, dst)
    return {"ok": bool(ok), "from": src, "seconds": min(times), "bytes": payload.nbytes}


def _link(facts: list[dict], r: int) -> str:
    src = facts[r]["ring"]["from"]
    a, b = facts[src]["host"], facts[r]["host"]
    return f"rank {src} -> rank {r}" + (f" (host {a} -> host {b})" if a != b else f" (host {a})")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{format_bytes(nbytes / seconds)}/s"


def slow_links(facts: list[dict]) -> list[tuple[int, str]]:
    """(receiving rank, line) per link more than LINK_MARGIN (and LINK_FLOOR_S) slower than the
    median of the other links of its kind (within a host, between hosts)."""
    kinds: dict[bool, list[int]] = {}
    for f in facts:
        kinds.setdefault(facts[f["ring"]["from"]]["host"] == f["host"], []).append(f["rank"])
    lines = []
    for within, ranks in kinds.items():
        for r in ranks if len(ranks) > 1 else []:
            ring = facts[r]["ring"]
            others = statistics.median(facts[o]["ring"]["seconds"] for o in ranks if o != r)
            if ring["seconds"] > (1 + LINK_MARGIN) * others + LINK_FLOOR_S:
                nbytes = ring.get("bytes", 512 * KiB)
                lines.append(
                    (
                        r,
                        f"{_link(facts, r)} took {ring['seconds'] * 1e3:.1f} ms for "
                        f"{format_bytes(nbytes)} ({_rate(nbytes, ring['seconds'])}), the other "
                        f"{'links within a host' if within else 'links between hosts'}: median "
                        f"{others * 1e3:.1f} ms ({_rate(nbytes, others)})",
                    )
                )
    return lines
