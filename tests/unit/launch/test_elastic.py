"""Workers started through torchrun's elastic agent (lockstep/launch/elastic.py): how a worker's end is described,
the stop errors, rendezvous endpoints and the node plan, and short real launches of stdlib modules.
Training launched on one and two nodes: tests/e2e/test_launch.py."""

from __future__ import annotations

import signal
import time

import pytest

from conftest import busy_port
from lockstep.errors import ConfigError
from lockstep.launch.elastic import (LaunchInterrupted, LaunchStopped, WorkerFailed, describe_exit, launch_local,
                                     launch_workers, local_ipv4_addresses, parse_endpoint, plan_node,
                                     wait_for_endpoint)
from lockstep.runtime import free_port
from lockstep.watchdog import HANG_EXIT_CODE


def test_describe_exit():
    assert describe_exit(3, 1) == "rank 3 exited with an error (exit code 1)"
    assert describe_exit(0, -signal.SIGKILL) == "rank 0 was killed by SIGKILL"  # elastic reports signal N as -N
    assert describe_exit(0, -200) == "rank 0 was killed by signal 200"
    assert describe_exit(1, HANG_EXIT_CODE) == (f"rank 1 was stopped by the hang watchdog (exit code {HANG_EXIT_CODE}; "
                                                "see the run's hang/report.txt)")


def test_stop_errors_end_with_what_the_caller_knows():
    failed = WorkerFailed("rank 1 was killed by SIGKILL")
    assert isinstance(failed, LaunchStopped) and failed.failed == "rank 1 was killed by SIGKILL"
    assert str(failed) == "rank 1 was killed by SIGKILL; the ranks' own messages are above, and a run's logs/ hold " \
                          "each rank's"
    failed.note = "the run committed step_00000010; the same command resumes from it"
    assert str(failed).endswith("each rank's; the run committed step_00000010; the same command resumes from it")
    stopped = LaunchInterrupted(signal.SIGTERM)
    assert stopped.signum == 15 and str(stopped) == "stopped by signal 15 (SIGTERM)"


@pytest.mark.parametrize("endpoint", ["10.0.0.1", "10.0.0.1:", ":29500", "10.0.0.1:http", "10.0.0.1:0",
                                      "10.0.0.1:65536"])
def test_an_endpoint_is_host_and_port(endpoint):
    with pytest.raises(ConfigError, match=rf"^rendezvous endpoint {endpoint!r} is not HOST:PORT \(e.g. 10.0.0.1:29500\)$"):
        parse_endpoint(endpoint)


def test_endpoints_that_parse():
    assert parse_endpoint("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert parse_endpoint("node-0.cluster:1") == ("node-0.cluster", 1)


def test_node_plan_on_this_host():
    assert local_ipv4_addresses()["127.0.0.1"] == "lo"
    plan = plan_node("127.0.0.1:29500", None)  # no node rank: hosting is decided by the address being ours
    assert (plan.endpoint, plan.is_host, plan.local_addr, plan.interface) == ("127.0.0.1:29500", True, "127.0.0.1", "lo")
    assert plan_node("127.0.0.1:29500", 1).is_host is False  # a node rank says it outright
    with pytest.raises(ConfigError, match=r"rendezvous host 'no-such-host.invalid' does not resolve on this node; use "
                                          r"an IP address or fix DNS"):
        plan_node("no-such-host.invalid:29500", None)


def test_waiting_for_the_rendezvous_is_bounded():
    sock, port = busy_port()
    with sock:
        wait_for_endpoint(f"127.0.0.1:{port}", timeout=5)  # answers: returns at once
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"rendezvous endpoint 127.0.0.1:{port} did not answer within 1 s .*start "
                                          "node rank 0 with the same --rdzv-endpoint first"):
        wait_for_endpoint(f"127.0.0.1:{port}", timeout=1)
    assert time.monotonic() - started < 10


def test_launch_settings_refused_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"^--nnodes 2 needs --rdzv-endpoint HOST:PORT \(an address of node rank 0\)$"):
        launch_workers(["json.tool", "--help"], 1, nnodes=2)
    sock, port = busy_port()
    with sock, pytest.raises(ConfigError, match=rf"master port {port} on 127.0.0.1 is already in use"):
        launch_local(["json.tool", "--help"], 1, master_port=port)


def test_real_launches_report_how_each_worker_ended(tmp_path, monkeypatch):
    launch_workers(["json.tool", "--help"], 1)  # exit 0: returns
    with pytest.raises(WorkerFailed) as info:
        launch_workers(["json.tool", str(tmp_path / "missing.json")], 1)  # argparse exits 2
    assert info.value.failed == "rank 0 exited with an error (exit code 2)"
    (tmp_path / "lockstep_kill_self.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the workers inherit it
    with pytest.raises(WorkerFailed) as info:
        launch_workers(["lockstep_kill_self"], 1)
    assert info.value.failed == "rank 0 was killed by SIGKILL"
