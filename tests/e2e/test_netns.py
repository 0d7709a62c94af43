"""tests/netns.py: the two-namespace link, throttled with tc tbf, moves what its rate says and counts what it sends.
Its rate parsing: tests/unit/test_netns_helper.py."""

from __future__ import annotations

import time

import netns
import pytest


@pytest.fixture
def slow_link():
    yield from netns.two_nodes_or_skip("40mbit")


def test_throttled_link_moves_its_rate_and_counts_the_bytes(slow_link):
    before = slow_link.total_sent()
    start = time.monotonic()
    with netns.ByteMeter(slow_link, every=0.05) as meter:
        rate = netns.measure_rate(slow_link, seconds=1.5)
    elapsed = time.monotonic() - start
    sent = slow_link.total_sent() - before
    # 40 Mbit/s on the wire is 5 MB/s; TCP payload is ~96% of a 1500-byte frame, and the 256 kB bucket adds a little
    assert 4.3e6 < rate < 5.3e6, rate
    # at most the rate for as long as the link was in use: the sender's 1.5 s, more on a loaded machine
    # (9.41 MB once, where 1.5 s would allow 9.40)
    assert 1.5 * 4.3e6 < sent < elapsed * 5.6e6 + 1e6, (sent, elapsed)
    assert (
        meter.samples[0][1]
        <= meter.bytes_at((meter.samples[0][0] + meter.samples[-1][0]) / 2)
        <= sent + before
    )
