"""Joining the job: a rendezvous port another program holds is refused before anything waits on it."""

from __future__ import annotations

import pytest

from conftest import busy_port
from lockstep.errors import ConfigError
from lockstep.runtime import check_port_free


def test_port_in_use_message():
    sock, port = busy_port()
    with (
        sock,
        pytest.raises(ConfigError, match=rf"master port {port} on 127.0.0.1 is already in use"),
    ):
        check_port_free("127.0.0.1", port)
