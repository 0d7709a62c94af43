"""tests/netns.py, the test helper behind the two-namespace links: its rate parsing and tbf settings
(no namespace needed). The link itself: tests/e2e/test_netns.py."""

from __future__ import annotations

import netns
import pytest


def test_rate_and_tbf_settings():
    assert netns.rate_bits("100mbit") == 10**8 and netns.rate_bits("1gbit") == 10**9
    assert netns.tbf_args("10gbit")[4] == str(10**10 // 8 // 500)  # the bucket grows with the rate
    with pytest.raises(ValueError, match="'100MB' is not a tc rate in bits"):
        netns.rate_bits("100MB")
