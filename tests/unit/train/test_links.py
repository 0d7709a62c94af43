"""The ring's links (lockstep/train/links.py) and the doctor's row of them, fed the facts of clusters this machine does not have: a
link much slower than the others of its kind warns, named, with the fix; links within a host and links
between hosts are compared with their own kind only; a difference under the floor stays ok. The probe
runs on a real 2-rank group in test_probes.py, and across two namespace nodes whose link one way is
slowed with tc in tests/e2e/test_launch.py."""

from __future__ import annotations

from lockstep.doctor.checks import check_ring
from lockstep.train.links import SLOW_LINK_FIX, KiB, slow_links
from unit.doctor.facts import fact


def ring(hosts: str, seconds: list[float]) -> list[dict]:
    """A ring over one rank per letter of `hosts`, rank r receiving rank r-1's 512 KiB in
    seconds[r]."""
    n = len(hosts)
    return [
        {
            **fact(r, host=h),
            "ring": {"ok": True, "from": (r - 1) % n, "seconds": s, "bytes": 512 * KiB},
        }
        for r, (h, s) in enumerate(zip(hosts, seconds))
    ]


def test_a_slow_link_between_hosts_is_named_with_the_fix():
    # 2 hosts x 2 ranks: 3 -> 0 and 1 -> 2 cross; 3 -> 0 takes 21 ms (an egress shaped to 100 Mbit/s)
    c = check_ring(ring("aabb", [0.021, 0.0003, 0.0009, 0.0003]))
    assert c.status == "warn" and c.ok and c.fix == SLOW_LINK_FIX
    assert c.detail == (
        "rank 3 -> rank 0 (host b -> host a) took 21.0 ms for 524 kB (25 MB/s), the other links "
        "between hosts: median 0.9 ms (583 MB/s)"
    )


def test_links_within_a_host_are_not_held_against_links_between_hosts():
    # the network 13x slower than shared memory, evenly: nothing to warn about
    c = check_ring(ring("aabb", [0.004, 0.0003, 0.004, 0.0003]))
    assert c.status == "ok" and c.detail.endswith("(slowest 4.0 ms)")
    # a link alone of its kind (0 -> 1, the one within host a) has nothing to be compared with
    assert slow_links(ring("aab", [0.004, 0.050, 0.004])) == []
    # but two links within one host are: 1 -> 2 slow
    assert slow_links(ring("aaa", [0.0003, 0.0003, 0.009])) == [
        (
            2,
            "rank 1 -> rank 2 (host a) took 9.0 ms for 524 kB (58.3 MB/s), the other links "
            "within a host: median 0.3 ms (1.75 GB/s)",
        )
    ]


def test_a_difference_under_the_floor_is_noise():
    # 1.5x the other link and 5 ms more, both needed: 3.2 ms against 0.6 ms was a busy host's delay
    assert check_ring(ring("ab", [0.0006, 0.0032])).status == "ok"
    assert check_ring(ring("ab", [0.0006, 0.0060])).status == "warn"
    assert check_ring(ring("ab", [0.040, 0.064])).status == "ok"  # 1.6x, but under 1.5x + 5 ms
    assert check_ring(ring("ab", [0.040, 0.066])).status == "warn"
