"""Workers started through torchrun's elastic agent (lockstep/launch/elastic.py): how a worker's end is described,
the stop errors, rendezvous endpoints and the node plan, and short real launches of stdlib modules.
Training launched on one and two nodes: tests/e2e/test_launch.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import busy_port, run_main

from lockstep.errors import ConfigError
from lockstep.launch.elastic import (
    LaunchInterrupted,
    LaunchStopped,
    WorkerFailed,
    event_method_name,
    launch_local,
    launch_workers,
    local_ipv4_addresses,
    parse_endpoint,
    plan_node,
    wait_for_endpoint,
)
from lockstep.runtime import free_port


def test_stop_errors_end_with_what_the_caller_knows():
    failed = WorkerFailed("rank 1 was killed by SIGKILL")
    assert isinstance(failed, LaunchStopped) and failed.failed == "rank 1 was killed by SIGKILL"
    assert (
        str(failed)
        == "rank 1 was killed by SIGKILL; the ranks' own messages are above, and a run's logs/ hold "
        "each rank's"
    )
    failed.note = "the run committed step_00000010; the same command resumes from it"
    assert str(failed).endswith(
        "each rank's; the run committed step_00000010; the same command resumes from it"
    )
    stopped = LaunchInterrupted(signal.SIGTERM)
    assert stopped.signum == 15 and str(stopped) == "stopped by signal 15 (SIGTERM)"


@pytest.mark.parametrize("endpoint", ["10.0.0.1", ":29500"])
def test_an_endpoint_is_host_and_port(endpoint):
    with pytest.raises(
        ConfigError,
        match=rf"^--rdzv-endpoint {endpoint!r} is not HOST:PORT; write the address of "
        r"node rank 0 and a port, e.g. 10.0.0.1:29500$",
    ):
        parse_endpoint(endpoint)


@pytest.mark.parametrize("port", ["0", "65536", "99999", "abc", "", "-1"])
def test_an_endpoint_port_is_1_to_65535(port):
    with pytest.raises(ConfigError) as info:
        parse_endpoint(f"127.0.0.1:{port}")
    assert str(info.value) == (
        f"--rdzv-endpoint '127.0.0.1:{port}': port {port!r} is not a TCP port; ports are "
        "1-65535, e.g. 127.0.0.1:29500"
    )


def test_endpoints_that_parse():
    assert parse_endpoint("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert parse_endpoint("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_endpoint("node-0.cluster:1") == ("node-0.cluster", 1)
    assert parse_endpoint("node-0.cluster:65535") == ("node-0.cluster", 65535)


def test_node_plan_on_this_host():
    assert local_ipv4_addresses()["127.0.0.1"] == "lo"
    # no node rank: hosting is decided by the address being ours
    plan = plan_node("127.0.0.1:29500", None)
    assert (plan.endpoint, plan.is_host, plan.local_addr, plan.interface) == (
        "127.0.0.1:29500",
        True,
        "127.0.0.1",
        "lo",
    )
    assert plan_node("127.0.0.1:29500", 1).is_host is False  # a node rank says it outright
    with pytest.raises(
        ConfigError,
        match=r"rendezvous host 'no-such-host.invalid' does not resolve on this node; use "
        r"an IP address or fix DNS",
    ):
        plan_node("no-such-host.invalid:29500", None)


def test_waiting_for_the_rendezvous_is_bounded(tmp_path, corpus, token_cache, capsys):
    sock, port = busy_port()
    with sock:
        wait_for_endpoint(f"127.0.0.1:{port}", timeout=5)  # answers: returns at once
    port = free_port()
    started = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=rf"rendezvous endpoint 127.0.0.1:{port} did not answer within 1 s .*start "
        "node rank 0 with the same --rdzv-endpoint first",
    ):
        wait_for_endpoint(f"127.0.0.1:{port}", timeout=1)
    assert time.monotonic() - started < 10
    # `lockstep launch` on node rank 1, --rdzv-timeout 3: exit 2 and the message, in bounded time
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "\n".join(
            [
                "model: {hidden_size: 32, attention_heads: 2, layers: 2, max_seq_length: 32}",
                "train: {max_steps: 6, batch_size: 8, sample_tokens: 0, log_interval: 1, "
                "peak_flops: 1.0e12, plots: false}",
                f"data: {{num_workers: 0, path: '{corpus}', cache_dir: '{token_cache}'}}",
                f"checkpoint: {{output_dir: '{tmp_path / 'run'}', save_interval: 3}}",
            ]
        )
        + "\n"
    )
    started = time.monotonic()
    code, _, err = run_main(
        capsys,
        "launch",
        cfg,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-timeout",
        "3",
    )
    assert code == 2 and time.monotonic() - started < 45
    assert "did not answer within 3 s" in err and "start node rank 0" in err


def test_launch_settings_refused_before_any_worker_starts():
    with pytest.raises(
        ConfigError,
        match=r"^--nnodes 2 needs --rdzv-endpoint HOST:PORT \(an address of node rank 0\)$",
    ):
        launch_workers(["json.tool", "--help"], 1, nodes=(2, 2))
    with pytest.raises(ConfigError, match=r"^--nnodes 1:2 needs --rdzv-endpoint"):
        launch_workers(["json.tool", "--help"], 1, nodes=(1, 2))
    sock, port = busy_port()
    with (
        sock,
        pytest.raises(ConfigError, match=rf"master port {port} on 127.0.0.1 is already in use"),
    ):
        launch_local(["json.tool", "--help"], 1, master_port=port)


def test_rendezvous_events_are_named_as_torch_names_them():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torch_s = dynamic_rendezvous.get_method_name
    if torch_s is event_method_name:  # an earlier launch in this process installed ours
        import inspect

        torch_s = lambda depth=2: inspect.stack()[depth].function  # noqa: E731 - its body

    def record(name_of):  # as torch's _record calls it, from the method that records
        return name_of()

    def _keep_alive():
        return record(torch_s), record(event_method_name)

    theirs, ours = _keep_alive()
    assert theirs == ours == "_keep_alive"
    assert event_method_name(10_000) == "no_method_name"


def test_real_launches_report_how_each_worker_ended(tmp_path, monkeypatch):
    launch_workers(["json.tool", "--help"], 1)  # exit 0: returns
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    assert dynamic_rendezvous.get_method_name is event_method_name  # installed by the launch
    with pytest.raises(WorkerFailed) as info:
        launch_workers(["json.tool", str(tmp_path / "missing.json")], 1)  # argparse exits 2
    assert info.value.failed == "rank 0 exited with an error (exit code 2)"
    (tmp_path / "lockstep_kill_self.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the workers inherit it
    with pytest.raises(WorkerFailed) as info:
        launch_workers(["lockstep_kill_self"], 1)
    assert info.value.failed == "rank 0 was killed by SIGKILL"


def test_a_rendezvous_short_of_min_nodes_ends_in_bounded_time_naming_who_came(monkeypatch):
    """MIN 2 and only this node arrives: torch's timeout names nobody; lockstep's message says who was there."""
    # launch_workers sets them
    for name in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        launch_workers(
            ["json.tool", "--help"],
            1,
            nodes=(2, 3),
            rdzv_endpoint=f"127.0.0.1:{port}",
            node_rank=0,
            rdzv_timeout=10,
            rdzv_id="short",
        )  # 4 s: a loaded 2-core CI had not seen this node join yet
    assert time.monotonic() - started < 40
    assert str(info.value).startswith(
        f"waited 10 s (--rdzv-timeout) for at least 2 node(s) (--nnodes 2:3) at "
        f"127.0.0.1:{port}; 1 arrived: 127.0.0.1 (agent pid {os.getpid()}). Start the "
        "other nodes with the same --rdzv-endpoint and --rdzv-id, or lower MIN"
    ), info.value


def test_an_elastic_range_gives_each_rendezvous_round_a_fresh_worker_store(tmp_path, monkeypatch):
    """MIN < MAX: rank 0's worker hosts a new store each round (restart counts differ between nodes that rejoin);
    a fixed job keeps torch's shared agent store."""
    for name in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    (tmp_path / "lockstep_store_env.py").write_text(
        "import os, sys\nopen(sys.argv[1], 'w').write(os.environ['TORCHELASTIC_USE_AGENT_STORE'])\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    launch_workers(["lockstep_store_env", str(tmp_path / "fixed")], 1)
    launch_workers(
        ["lockstep_store_env", str(tmp_path / "elastic")],
        1,
        nodes=(1, 2),
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        node_rank=0,
        rdzv_conf={"last_call_timeout": "1"},
    )
    assert (tmp_path / "fixed").read_text() == "True" and (
        tmp_path / "elastic"
    ).read_text() == "False"


LOSE_THE_HOST = """
import os, sys
from pathlib import Path
from lockstep.launch.elastic import RendezvousLost, launch_workers
try:
    launch_workers(["lockstep_sleeper", sys.argv[2]], 1, nodes=(1, 2), rdzv_endpoint=sys.argv[1], node_rank=1,
                   rdzv_conf={"last_call_timeout": "1"}, console_log=Path(sys.argv[3]))
except RendezvousLost as e:
    print("LOST:", e, flush=True)
    os._exit(3)
"""


@pytest.mark.slow
def test_a_node_that_loses_the_rendezvous_host_says_so_and_how_to_go_on(tmp_path):
    """Node rank 0's launcher hosts the c10d store; when it is gone, another node's launcher ends with a message
    (not torch's RendezvousConnectionError traceback, nor C++'s abort at exit)."""
    port = free_port()
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, datetime, torch.distributed as d\n"
            f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
            "time.sleep(300)",
        ]
    )
    (tmp_path / "lockstep_sleeper.py").write_text(
        "import sys, time\nopen(sys.argv[1], 'w').close()\ntime.sleep(300)\n"
    )
    started = tmp_path / "started"
    log = tmp_path / "logs" / "launcher_node1.log"
    node = subprocess.Popen(
        [sys.executable, "-c", LOSE_THE_HOST, f"127.0.0.1:{port}", str(started), str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
    )
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert node.poll() is None and time.monotonic() < deadline, (
                node.stdout.read() if node.poll() else "slow"
            )
            time.sleep(0.2)
        host.kill()
        out = node.communicate(timeout=120)[0]
    finally:
        for p in (host, node):
            if p.poll() is None:
                p.kill()
    assert node.returncode == 3, out[-3000:]
    assert (
        f"LOST: lost the rendezvous at 127.0.0.1:{port}: the launcher of node rank 0, which hosts it, is gone. A "
        "job goes on without any other node, but not without that one; start node rank 0 again, then this node, "
        "with the same commands (or serve the store elsewhere: `lockstep rendezvous`, and --rdzv-store "
        "external)"
    ) in out
    # torch's C++ frames (its agent's lost-store errors) are in the node's log, not on its console
    assert "frame #" not in out and "frame #0: " in log.read_text()
    assert (
        f"C++ stack frames from torch were left off this console; the full text is in {log}" in out
    )
