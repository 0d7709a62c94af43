"""`lockstep slurm` against real Slurm clusters (Debian's slurmd + slurmctld + munge, installed by apt if missing):
a one-node cluster on this host, and a two-node cluster with one slurmd per network namespace. Both slow.

The two-node cluster: namespaces A and B joined by a veth pair on a private test subnet. Each daemon runs under
`nsenter --net=<ns> unshare --mount --uts`: its own host name (nodeA / nodeB), and a private mount namespace in
which a generated hosts file is bind-mounted on /etc/hosts (the other node by its address, its own name on
127.0.1.1 as on Debian). `ip netns exec` would remount /sys, hiding /sys/fs/cgroup, and slurmd then fails to
start. slurmctld runs on nodeA, which is also the "login node": sbatch / scontrol / scancel run in A's network
namespace. munged runs once on the host: its socket is a file, reachable from every network namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import netns
import pytest
import torch
from conftest import run_lockstep
from procs import descendants, held, pending, worker_pid
from safetensors.torch import load_file

from lockstep.cli import slurm as slurm_cli
from lockstep.errors import ConfigError

pytestmark = pytest.mark.slow

SLURM_PACKAGES = ["slurmd", "slurmctld", "slurm-client", "munge"]

# the parts of slurm.conf both clusters share: root daemons, no accounting, no cgroups
COMMON_CONF = """SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
"""


def cli(*argv: str) -> int:
    p = argparse.ArgumentParser()
    slurm_cli.add_arguments(p)
    return slurm_cli.run(p.parse_args(argv), list(argv))


def need_slurm() -> None:
    """Root, and Slurm's daemons and clients (apt-installed if missing, as on CI); skips otherwise."""
    if os.geteuid() != 0:
        pytest.skip("a real Slurm cluster needs root (daemons, munge user)")
    if not all(shutil.which(t) for t in ("slurmd", "slurmctld", "sbatch", "munged")):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", *SLURM_PACKAGES]
        apt = subprocess.run(install, capture_output=True, text=True, timeout=600, env=env)
        if apt.returncode:  # a new machine has no package lists yet
            subprocess.run(["apt-get", "update"], capture_output=True, timeout=600, env=env)
            apt = subprocess.run(install, capture_output=True, text=True, timeout=600, env=env)
        if apt.returncode:
            pytest.skip(
                f"could not install Slurm ({' '.join(SLURM_PACKAGES)}): {apt.stderr[-300:]}"
            )


def _start(cmd: list[str], log: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, **kw)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop the daemons we started, newest first: SIGTERM, then SIGKILL after 15 s."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=15)


def _munge_works() -> bool:
    return subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0


@contextlib.contextmanager
def munge(log_dir: Path):
    """A working munged on the host's default socket: a running one is reused, else ours (stopped at exit)."""
    if _munge_works():
        yield
        return
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    proc = _start(["/usr/sbin/munged", "-F"], log_dir / "munged.log", user="munge", group="munge")
    try:
        deadline = time.monotonic() + 10
        while not _munge_works():
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.skip(f"munged did not start: {(log_dir / 'munged.log').read_text()[-300:]}")
            time.sleep(0.2)
        yield
    finally:
        _stop([proc])


def _logs(log_dir: Path) -> str:
    return "\n".join(f"== {f.name}\n{f.read_text()[-800:]}" for f in sorted(log_dir.iterdir()))


def wait_idle(
    nodes: int,
    procs: list[subprocess.Popen],
    log_dir: Path,
    env: dict | None = None,
    prefix: tuple[str, ...] = (),
) -> None:
    """Until sinfo shows `nodes` idle nodes; fails with the daemons' logs when a daemon exits or 30 s pass."""
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(
            [*prefix, "sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=env
        ).stdout
        if out.split().count("idle") == nodes:
            return
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(
                f"the {nodes}-node Slurm cluster did not come up (sinfo: {out.split()}):\n{_logs(log_dir)}"
            )
        time.sleep(0.5)


def job_state(job_id: str, env: dict | None = None, prefix: tuple[str, ...] = ()) -> str:
    out = subprocess.run(
        [*prefix, "scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env
    ).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "UNKNOWN"


def wait_job(
    job_id: str, log: Path, timeout: float, env: dict | None = None, prefix: tuple[str, ...] = ()
) -> str:
    """The job's final state; cancels it and fails with its log after `timeout` s."""
    deadline = time.monotonic() + timeout
    while (state := job_state(job_id, env, prefix)) in (
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
    ):
        if time.monotonic() > deadline:
            subprocess.run([*prefix, "scancel", job_id], env=env)
            pytest.fail(
                f"job {job_id} still {state} after {timeout} s; log:\n"
                f"{log.read_text()[-3000:] if log.exists() else '(no log)'}"
            )
        time.sleep(1)
    return state


def train_config(tmp_path: Path, corpus: Path, run_dir: Path, steps: int = 4) -> Path:
    config = tmp_path / "train.yaml"
    config.write_text(f"""model: {{hidden_size: 32, attention_heads: 2, layers: 2, max_seq_length: 32}}
train: {{max_steps: {steps}, batch_size: 8, sample_tokens: 0, log_interval: 1, peak_flops: 1.0e+12,
        plots: false}}
data: {{num_workers: 0, path: {corpus}, cache_dir: {tmp_path / "cache"}}}
checkpoint: {{output_dir: {run_dir}}}
""")
    return config


VENV = Path(os.environ.get("VIRTUAL_ENV", Path(__file__).resolve().parents[2] / ".venv"))
REPO = Path(__file__).resolve().parents[2]


# --- one node: this host ---


@contextlib.contextmanager
def one_node_cluster(root: Path):
    """slurmctld + slurmd in the foreground (so this module owns and stops them), munged as the
    munge user."""
    host = socket.gethostname()
    for d in ("state", "spool", "log"):
        (root / d).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=lockstep
SlurmctldHost={host}
SlurmctldPort=16817
SlurmdPort=16818
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
{COMMON_CONF}NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    procs: list[subprocess.Popen] = []
    env_before = os.environ.get("SLURM_CONF")
    with munge(root / "log"):
        os.environ["SLURM_CONF"] = str(conf)
        try:
            procs.append(
                _start(["slurmctld", "-D", "-f", str(conf)], root / "log" / "slurmctld.log")
            )
            procs.append(_start(["slurmd", "-D", "-f", str(conf)], root / "log" / "slurmd.log"))
            yield root, lambda: wait_idle(1, procs, root / "log")
        finally:
            _stop(procs)
            if env_before is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = env_before


class Clusters:
    """The module's two clusters, each started once for the tests that use it, one at a time:
    starting one stops the other (the two never run at the same time: both use munged, and the
    one-node cluster sets SLURM_CONF while it runs). A test gets a cluster whose nodes are all
    idle again (the previous test's job has left them)."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.kind, self.value, self.ready = None, None, None
        self.stack = contextlib.ExitStack()

    def get(self, kind: str, start):
        if self.kind != kind:
            self.close()
            self.stack = contextlib.ExitStack()
            root = self.tmp_path_factory.mktemp(kind)
            self.value, self.ready = self.stack.enter_context(start(root))
            self.kind = kind
        self.ready()
        return self.value

    def close(self) -> None:
        self.kind = None
        self.stack.close()


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    held = Clusters(tmp_path_factory)
    try:
        yield held
    finally:
        held.close()


@pytest.fixture
def slurm_cluster(clusters):
    need_slurm()
    return clusters.get("slurm", one_node_cluster)


def test_real_slurm_job_trains(slurm_cluster, tmp_path, corpus, monkeypatch, capsys):
    """Submit the rendered script to a real slurmctld: torchrun's c10d rendezvous on a host whose name resolves
    to 127.0.0.1 (this machine), two CPU workers, a committed checkpoint at the end."""
    run_dir = tmp_path / "run"
    config = train_config(tmp_path, corpus, run_dir)
    monkeypatch.chdir(REPO)  # the job runs `python -m lockstep` from the repo
    with pytest.raises(
        ConfigError, match="partition 'gpu' is not one of this cluster's partitions: debug"
    ):
        cli(str(config), "--partition", "gpu", "--log-dir", str(tmp_path / "logs"))
    assert (
        cli(
            str(config),
            "--nodes",
            "1",
            "--procs-per-node",
            "2",
            "--cpus-per-task",
            "2",
            "--partition",
            "debug",
            "--time",
            "5",
            "--env-setup",
            f"source {VENV}/bin/activate",
            "--log-dir",
            str(tmp_path / "logs"),
            "--job-name",
            "tiny",
            "--requeue",
        )
        == 0
    )
    out = capsys.readouterr().out
    m = re.match(r"submitted job (\d+); log: (\S+)", out)
    assert m, out
    job_id, log = m.group(1), Path(m.group(2))
    state = wait_job(job_id, log, timeout=120)
    text = log.read_text() if log.exists() else "(no log)"
    assert state == "COMPLETED", f"job {job_id} ended {state}; log:\n{text[-4000:]}"
    assert "is_host=1" in text and "rendezvous 127." not in text
    assert "launcher torchrun" in text and "rank 0/2" in text
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004", text[-3000:]


# loaded by every Python process of the job: a worker (LOCAL_RANK set) records what it was given and exits at once
PROBE = """import json, os
if "LOCAL_RANK" in os.environ:
    keys = ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS", "LOCAL_RANK")
    with open(os.path.join(os.environ["PROBE_DIR"], "worker" + os.environ["LOCAL_RANK"] + ".json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    os._exit(0)
"""


def test_real_slurm_default_cpus_per_task(slurm_cluster, tmp_path, corpus, monkeypatch, capsys):
    """No --cpus-per-task: the real sinfo gives the node's CPUs at render time; the step's task gets them
    (SLURM_CPUS_PER_TASK) and the worker runs OMP_NUM_THREADS = CPUs / processes threads."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    config = train_config(tmp_path, corpus, tmp_path / "run")
    monkeypatch.chdir(REPO)
    assert (
        cli(
            str(config),
            "--nodes",
            "1",
            "--procs-per-node",
            "1",
            "--partition",
            "debug",
            "--time",
            "5",
            "--env-setup",
            f"source {VENV}/bin/activate",
            "--env",
            f"PYTHONPATH={probe}",
            "--env",
            f"PROBE_DIR={probe}",
            "--log-dir",
            str(tmp_path / "logs"),
            "--job-name",
            "cpus",
        )
        == 0
    )
    m = re.match(r"submitted job (\d+); log: (\S+)", capsys.readouterr().out)
    job_id, log = m.group(1), Path(m.group(2))
    cpus = os.cpu_count()  # the cluster's node: CPUs=os.cpu_count()
    script = (tmp_path / "logs" / "cpus.sbatch").read_text()
    assert (
        f"#SBATCH --cpus-per-task={cpus}\n" in script
        and "the smallest node of partition debug (sinfo)" in script
    )
    state = wait_job(job_id, log, timeout=60)
    assert state == "COMPLETED", (
        f"job {job_id} ended {state}; log:\n{log.read_text()[-3000:] if log.exists() else ''}"
    )
    seen = json.loads((probe / "worker0.json").read_text())
    assert seen == {
        "SLURM_CPUS_PER_TASK": str(cpus),
        "OMP_NUM_THREADS": str(cpus),
        "LOCAL_RANK": "0",
    }


# --- two nodes: one slurmd per network namespace ---


def _netns(name: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{name}"]


def _kill_namespace(name: str) -> None:
    """SIGKILL whatever still runs in our namespace (slurmstepd, torchrun, workers of a job that did not end)."""
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while subprocess.run(
        ["ip", "netns", "pids", name], capture_output=True, text=True
    ).stdout.split():
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)


class Cluster(NamedTuple):
    env: dict  # the environment with SLURM_CONF
    on_a: tuple[str, ...]  # command prefix that enters nodeA's network (the "login node")
    addr: dict[str, str]  # node name -> address
    # node name -> network namespace (`ip netns pids` lists what runs on that node)
    netns: dict[str, str]


@contextlib.contextmanager
def two_nodes(root: Path):
    """nodeA (slurmctld + slurmd) and nodeB (slurmd), each in its own network, mount and UTS namespace."""
    for d in ("state", "log"):
        (root / d).mkdir()
    tag = f"{os.getpid() % 10000}"
    ns = {"nodeA": f"lsSA{tag}", "nodeB": f"lsSB{tag}"}
    veth = {"nodeA": f"sa{tag}", "nodeB": f"sb{tag}"}
    subnet = f"10.213.{os.getpid() % 200 + 20}"
    addr = {"nodeA": f"{subnet}.1", "nodeB": f"{subnet}.2"}
    procs: list[subprocess.Popen] = []
    try:
        setup = [
            ["ip", "netns", "add", ns["nodeA"]],
            ["ip", "netns", "add", ns["nodeB"]],
            ["ip", "link", "add", veth["nodeA"], "type", "veth", "peer", "name", veth["nodeB"]],
        ]
        for node, name in ns.items():
            setup += [
                ["ip", "link", "set", veth[node], "netns", name],
                ["ip", "-n", name, "addr", "add", f"{addr[node]}/24", "dev", veth[node]],
                ["ip", "-n", name, "link", "set", veth[node], "up"],
                ["ip", "-n", name, "link", "set", "lo", "up"],
            ]
        for cmd in setup:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                pytest.skip(
                    f"network namespaces are not permitted here ({' '.join(cmd)!r}: {proc.stderr.strip()})"
                )

        yield from _slurm_daemons(root, ns, addr, procs)
    finally:
        _stop(procs)
        for name in ns.values():
            _kill_namespace(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _slurm_daemons(root: Path, ns: dict[str, str], addr: dict[str, str], procs: list):
    """slurmctld on the first node of `ns` (node name -> network namespace) and slurmd on each, every
    daemon in the node's own mount and UTS namespaces; yields (Cluster, ready) while they run."""
    log_dir, names = root / "log", list(ns)
    # Debian's layout: a node's own name resolves to 127.0.1.1, the other node's to its address. So the
    # batch script cannot take the head's address from its name: it must fall back to its interface address.
    for node in ns:
        (root / f"hosts-{node}").write_text(
            "127.0.0.1 localhost\n"
            + "".join(f"{'127.0.1.1' if n == node else a} {n}\n" for n, a in addr.items())
        )
    conf = root / "slurm.conf"
    cpus = os.cpu_count()
    # cred_expire: a requeued job waits the job credential's lifetime (120 s by default) before it may start
    # again; starting it sooner (scontrol update StartTime=now) failed 2 runs of 6 with "Killing non-startable
    # batch JobId=1: Job credential revoked" (the old run's revocation and the new credential fell in the same
    # second). 5 s keeps the requeue tests short without going around that rule. sched_interval: a job that
    # becomes eligible by the clock waits for the main scheduler's next pass (every 60 s by default);
    # bf_interval: a heterogeneous job is started by the backfill scheduler alone (every 30 s by default).
    nodes = "".join(f"NodeName={n} NodeAddr={addr[n]} CPUs={cpus} State=UNKNOWN\n" for n in names)
    conf.write_text(f"""ClusterName=lockstep{len(names)}
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=2,bf_interval=1
SlurmctldHost={names[0]}({addr[names[0]]})
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
{COMMON_CONF}{nodes}PartitionName=debug Nodes={",".join(names)} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    head = tuple(_netns(ns[names[0]]))

    def on_node(node: str, cmd: list[str], log: str) -> None:
        # the shell sets the node's host name and hosts file in its private namespaces, then becomes the daemon
        program = f'hostname {node} && mount --bind {root}/hosts-{node} /etc/hosts && exec "$@"'
        unshared = ["unshare", "--mount", "--uts", "sh", "-c", program, "sh", *cmd]
        procs.append(_start([*_netns(ns[node]), *unshared], log_dir / log, env=env))

    with munge(log_dir):
        on_node(names[0], ["slurmctld", "-D", "-f", str(conf)], "slurmctld.log")
        for node in ns:
            on_node(node, ["slurmd", "-D", "-N", node, "-f", str(conf)], f"slurmd-{node}.log")
        try:
            yield (
                Cluster(env, head, addr, ns),
                lambda: wait_idle(len(names), procs, log_dir, env, head),
            )
        finally:
            _stop(procs)  # while munged still runs


@contextlib.contextmanager
def three_nodes(root: Path):
    """nodeA (slurmctld + slurmd), nodeB and nodeC (slurmd), each in its own namespaces, on one switch
    (tests/netns.py): enough for a heterogeneous job whose first component is a node of its own."""
    for d in ("state", "log"):
        (root / d).mkdir()
    procs: list[subprocess.Popen] = []
    try:
        with netns.switched_nodes(3) as nodes:
            names = ("nodeA", "nodeB", "nodeC")
            ns = {n: node.ns for n, node in zip(names, nodes)}
            try:
                yield from _slurm_daemons(
                    root, ns, {n: nd.addr for n, nd in zip(names, nodes)}, procs
                )
            finally:
                _stop(procs)
                for name in ns.values():
                    _kill_namespace(name)
    except netns.LinkUnavailable as e:
        pytest.skip(f"network namespaces are not permitted here ({e})")


def _namespace_cluster(clusters: Clusters, kind: str, start) -> Cluster:
    need_slurm()
    for tool in ("ip", "nsenter", "unshare"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not found: cannot build network-namespace nodes")
    return clusters.get(kind, start)


@pytest.fixture
def two_node_cluster(clusters):
    return _namespace_cluster(clusters, "slurm2", two_nodes)


@pytest.fixture
def three_node_cluster(clusters):
    return _namespace_cluster(clusters, "slurm3", three_nodes)


def _throttle_rank_on(host: str, run_dir: Path, group: Path, timeout: float = 120) -> int:
    """Move the worker that runs on `host` into cgroup `group` (tests/throttle.py) as soon as its
    log names its pid (before its first step: it builds the model and data first); its rank."""
    from throttle import join

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in (run_dir / "logs").glob("rank*.log"):
            m = re.search(rf"rank (\d+)/\d+ on {host} \(pid (\d+)\)", log.read_text())
            if m:
                join(group, int(m.group(2)))
                return int(m.group(1))
        time.sleep(0.05)
    pytest.fail(f"no rank on {host} said its pid in {timeout} s")


def test_real_two_node_slurm_job_trains(two_node_cluster, tmp_path, corpus, monkeypatch):
    """A 2-node sbatch job: one torchrun per node, rendezvous on the first node's address, two ranks on two nodes
    training one model; a committed checkpoint at the last step. torchrun's node rank may differ
    from SLURM's. nodeB's worker runs at a tenth of one CPU (a cgroup quota, where this machine has
    one): rank 0 names it, its node and the cause (issue 29's straggler watch under Slurm, across
    nodes)."""
    from throttle import Unavailable, cpu_quota

    env, on_a, addr, _ = two_node_cluster
    run_dir, log_dir = tmp_path / "run", tmp_path / "logs"
    config = train_config(tmp_path, corpus, run_dir, steps=45)
    quota = contextlib.ExitStack()
    try:
        group = quota.enter_context(cpu_quota(0.1))
    except Unavailable:
        group = None
    # the job's working directory (--chdir) is where the script was rendered
    monkeypatch.chdir(REPO)
    script = run_lockstep(
        "slurm",
        config,
        "--nodes",
        "2",
        "--procs-per-node",
        "1",
        "--time",
        "5",
        "--env-setup",
        f"source {VENV}/bin/activate",
        "--log-dir",
        log_dir,
        "--job-name",
        "two",
        "--dry-run",
    ).stdout
    log_dir.mkdir()
    (tmp_path / "two.sbatch").write_text(script)
    sub = subprocess.run(
        [*on_a, "sbatch", "--parsable", str(tmp_path / "two.sbatch")],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        timeout=60,
    )
    assert sub.returncode == 0, f"sbatch refused the script: {sub.stderr}"
    job_id = sub.stdout.strip().split(";")[0]
    log = log_dir / f"two-{job_id}.out"
    with quota:
        slow = _throttle_rank_on("nodeB", run_dir, group) if group is not None else None
        state = wait_job(job_id, log, timeout=180, env=env, prefix=on_a)
    text = log.read_text() if log.exists() else "(no log)"
    assert state == "COMPLETED", f"job {job_id} ended {state}; log:\n{text[-4000:]}"

    # one srun task per SLURM node, each in its own namespace; node 0 hosts the rendezvous on its own address
    tasks = {
        int(n): (host, a, host_flag)
        for n, host, a, host_flag in re.findall(
            r"lockstep: node (\d) \((\w+)\) addr (\S+) iface \S+ rendezvous \S+ is_host=(\d)", text
        )
    }
    assert sorted(tasks) == [0, 1] and {t[0] for t in tasks.values()} == {"nodeA", "nodeB"}, text[
        -3000:
    ]
    for host, a, host_flag in tasks.values():
        assert a == addr[host]
    head = tasks[0][0]
    assert tasks[0][2] == "1" and tasks[1][2] == "0"
    assert f"rendezvous {addr[head]}:29500" in text and "rendezvous 127." not in text

    # two ranks of one world, on different nodes (in whichever order torchrun numbered the nodes)
    rank_hosts = {}
    for rank in (0, 1):
        rank_log = run_dir / "logs" / f"rank{rank}.log"
        assert rank_log.exists(), text[-3000:]
        m = re.search(rf"rank {rank}/2 on (\w+)", rank_log.read_text())
        assert m, rank_log.read_text()[-2000:]
        rank_hosts[rank] = m.group(1)
    assert sorted(rank_hosts.values()) == ["nodeA", "nodeB"], rank_hosts
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_00000045", text[-3000:]
    assert (run_dir / "checkpoints" / latest / "manifest.json").exists()
    # every log line's record holds both ranks, each with its node; a comparison every 10 steps,
    # the warning at the 3rd (step 30 when measured), one to spare
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert len(train) == 45 and all(
        {(t["rank"], t["host"]) for t in r["ranks"]} == set(rank_hosts.items()) for r in train
    )
    warnings = re.findall(r"WARNING straggler: (.*)", (run_dir / "logs" / "rank0.log").read_text())
    if slow is None:  # no cgroup quota here: no fault, and nobody named
        assert warnings == [], warnings
        return
    assert rank_hosts[slow] == "nodeB"
    assert warnings and warnings[0].startswith(f"rank {slow} (nodeB, local rank 0) is behind"), (
        text[-3000:]
    )
    assert "; compute " in warnings[0] and "a throttled, busy or different device" in warnings[0]


# --- preemption and a lost node on the two-node cluster: the run goes on, exactly ---

# a step takes ~20 ms here: each interruption holds the workers still until its signal is theirs (held),
# so a run need not outlast the signal's way through Slurm (300 steps once did)
STEPS = 100


def long_config(path: Path, corpus: Path, cache: Path, run_dir: Path) -> Path:
    """Memory snapshots in the test's own directory, not the machine's /dev/shm: a killed node's stay
    (no process of it is left to clear them)."""
    path.write_text(f"""model: {{hidden_size: 32, attention_heads: 2, layers: 2, max_seq_length: 32}}
train: {{max_steps: {STEPS}, batch_size: 8, sample_tokens: 0, log_interval: 10, peak_flops: 1.0e+12,
        record_samples: true, plots: false}}
data: {{num_workers: 0, path: {corpus}, cache_dir: {cache}}}
checkpoint: {{output_dir: {run_dir}, save_interval: 10, memory_dir: {run_dir.parent / "shm"}}}
""")
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> Path:
    """The same job without interruption, at the same world size (2 ranks), on this host: `lockstep launch
    --nproc 2`. gloo's sum of two ranks' gradients does not depend on where the ranks run, so its weights are
    those of an uninterrupted 2-node job bit for bit (test_launch.py checks that for `launch --nnodes 2`)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    run_lockstep(
        "launch",
        long_config(root / "c.yaml", corpus, root / "cache", root / "run"),
        "--nproc",
        "2",
        timeout=300,
    )
    return root / "run"


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{STEPS:08d}", latest
    return load_file(run / "checkpoints" / latest / "model.safetensors")


def recorded_samples(
    run: Path, lost_after: tuple[int, int] | None = None
) -> dict[tuple[int, int], list]:
    """{(step, rank): that rank's micro-batch indices} of the run's final timeline: a resumed attempt records its
    steps again, so the last record of each (step, rank) wins. lost_after = (S, W): after a resume at step S at
    world size W, the records of ranks >= W past step S belong to the abandoned attempt (no rank rewrote them)."""
    out = {}
    for path in sorted((run / "samples").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out[(r["step"], r["rank"])] = r["micro_batches"]
    if lost_after:
        out = {
            (step, rank): v
            for (step, rank), v in out.items()
            if step <= lost_after[0] or rank < lost_after[1]
        }
    return out


def samples_per_step(records: dict[tuple[int, int], list]) -> dict[int, list[int]]:
    """{step: every sample index consumed in that step, over all ranks and micro-batches, sorted}."""
    out: dict[int, list[int]] = {}
    for (step, _), micro_batches in records.items():
        out.setdefault(step, []).extend(i for mb in micro_batches for i in mb)
    return {step: sorted(v) for step, v in out.items()}


def job_info(job_id: str, cluster: Cluster) -> dict[str, str]:
    out = subprocess.run(
        [*cluster.on_a, "scontrol", "show", "job", "-o", job_id],
        capture_output=True,
        text=True,
        env=cluster.env,
        timeout=30,
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_until(predicate, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout} s waiting for {what}; job log:\n"
                f"{log.read_text()[-3000:] if log.exists() else '(no log)'}"
            )
        time.sleep(0.1)


def committed_step(run: Path) -> int:
    latest = run / "checkpoints" / "latest"
    return int(latest.read_text().strip()[5:]) if latest.exists() else 0


def submit(
    cluster: Cluster, tmp_path: Path, config: Path, name: str, *flags: str
) -> tuple[str, Path]:
    """Render with `lockstep slurm --dry-run` and submit with sbatch from nodeA; returns (job id, job log)."""
    log_dir = tmp_path / "logs"
    script = run_lockstep(
        "slurm",
        config,
        "--nodes",
        *flags,
        "--procs-per-node",
        "1",
        "--time",
        "10",
        "--env-setup",
        f"source {VENV}/bin/activate",
        "--log-dir",
        log_dir,
        "--job-name",
        name,
        "--dry-run",
    ).stdout
    log_dir.mkdir(exist_ok=True)
    (tmp_path / f"{name}.sbatch").write_text(script)
    sub = subprocess.run(
        [*cluster.on_a, "sbatch", "--parsable", str(tmp_path / f"{name}.sbatch")],
        capture_output=True,
        text=True,
        env={**cluster.env, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        timeout=60,
    )
    assert sub.returncode == 0, f"sbatch refused the script: {sub.stderr}"
    job_id = sub.stdout.strip().split(";")[0]
    return job_id, log_dir / f"{name}-{job_id}.out"


def wait_requeued(job_id: str, restarts: int, cluster: Cluster, log: Path) -> None:
    """Until Slurm has requeued the job `restarts` times. It starts again cred_expire + 1 s after the requeue
    (EligibleTime; 121 s with Slurm's default, 6 s on this cluster)."""
    wait_until(
        lambda: int(job_info(job_id, cluster).get("Restarts", 0)) >= restarts,
        90,
        f"job {job_id} requeued ({restarts})",
        log,
    )


def stops_and_resumes(run: Path) -> tuple[list[int], list[int]]:
    """The steps rank 0 committed a checkpoint at on a stop request, and the steps its runs resumed at."""
    text = (run / "logs" / "rank0.log").read_text()
    stops = [
        int(s)
        for s in re.findall(
            r"stop requested \(signal 15\): checkpoint committed at step (\d+)", text
        )
    ]
    resumes = [int(s) for s in re.findall(r"resumed from \S+/step_\d+ at step (\d+)", text)]
    return stops, resumes


def signalled(pid: int) -> bool:
    """Whether a held worker has SIGTERM pending, or was let go by Slurm (which sends SIGCONT before SIGTERM
    to a step it ends), or is gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in "Tt" or pending(pid, signal.SIGTERM)
    except (OSError, IndexError):
        return True


def test_preempted_two_node_job_resumes_exactly(
    two_node_cluster, tmp_path, corpus, monkeypatch, uninterrupted
):
    """A 2-node job rendered with --requeue is preempted twice while it trains: by `scontrol requeue` (what a
    preemption does: SIGTERM to every step, SIGKILL after KillWait), then by the USR1 that `--signal=B:USR1@120`
    sends ahead of the time limit (`scancel --batch --signal=USR1` sends the same). Each time the workers commit a
    checkpoint at the step they stop at, Slurm requeues the job, and the next run resumes from that checkpoint.
    The run ends with the weights and the per-step, per-rank samples of an uninterrupted run."""
    run = tmp_path / "run"
    config = long_config(tmp_path / "c.yaml", corpus, tmp_path / "cache", run)
    monkeypatch.chdir(REPO)
    job_id, log = submit(two_node_cluster, tmp_path, config, "pre", "2", "--requeue")
    on_a, env = two_node_cluster.on_a, two_node_cluster.env

    wait_until(lambda: committed_step(run) >= 10, 120, "a first committed checkpoint", log)
    workers = [worker_pid(run, rank) for rank in (0, 1)]
    with held(workers):
        subprocess.run([*on_a, "scontrol", "requeue", job_id], env=env, check=True, timeout=30)
        wait_until(lambda: all(map(signalled, workers)), 60, "SIGTERM at both workers", log)
    wait_requeued(job_id, 1, two_node_cluster, log)
    wait_until(
        lambda: (
            len(stops_and_resumes(run)[1]) == 1
            and committed_step(run) > stops_and_resumes(run)[0][0]
        ),
        120,
        "a checkpoint committed by the resumed run",
        log,
    )
    # the batch script's trap sends the workers SIGTERM
    workers = [worker_pid(run, rank) for rank in (0, 1)]
    with held(workers):
        subprocess.run(
            [*on_a, "scancel", "--batch", "--signal=USR1", job_id], env=env, check=True, timeout=30
        )
        wait_until(lambda: all(map(signalled, workers)), 60, "SIGTERM at both workers", log)
    wait_requeued(job_id, 2, two_node_cluster, log)
    state = wait_job(job_id, log, timeout=180, env=env, prefix=on_a)
    text = log.read_text()
    assert state == "COMPLETED", f"job {job_id} ended {state}; log:\n{text[-4000:]}"

    # three runs of the job, appended to one log (--open-mode=append); Slurm counted two restarts
    assert job_info(job_id, two_node_cluster)["Restarts"] == "2"
    assert text.count("lockstep: node 0 (") == 3, text[-4000:]
    assert "DUE TO JOB REQUEUE" in text  # scontrol requeue's SIGTERM
    assert f"lockstep: got USR1, stopping the workers and requeueing job {job_id}" in text
    # the trap never SIGTERMs srun
    assert "srun: forcing job termination" not in text.split("got USR1")[1]
    # each stop committed a checkpoint at the step it stopped at, on both ranks, and the next run resumed there
    stops, resumes = stops_and_resumes(run)
    assert len(stops) == 2 and stops == resumes and stops[0] < stops[1] < STEPS, (stops, resumes)
    rank1 = (run / "logs" / "rank1.log").read_text()
    for step in stops:
        assert f"checkpoint committed at step {step}, exiting" in rank1

    # exact: the same weights, bit for bit, and the same samples in every step on every rank
    ours, reference = final_weights(run), final_weights(uninterrupted)
    assert ours.keys() == reference.keys()
    for name in ours:
        assert torch.equal(ours[name], reference[name]), name
    got, want = recorded_samples(run), recorded_samples(uninterrupted)
    assert sorted(got) == sorted(want) == [(s, r) for s in range(1, STEPS + 1) for r in (0, 1)]
    assert got == want


def kill_node_processes(cluster: Cluster, node: str) -> list[str]:
    """SIGKILL the job's torchrun on `node` and everything below it (its workers): a node lost mid-step, as far as
    the other node's processes can tell (slurmd and slurmstepd there stay, so Slurm sees a failed task)."""
    killed = []
    out = subprocess.run(
        ["ip", "netns", "pids", cluster.netns[node]], capture_output=True, text=True
    ).stdout
    for pid in map(int, out.split()):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "/torchrun " in cmd:
                for victim in [pid, *descendants(pid)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGKILL)
                        killed.append(str(victim))
    return killed


def test_elastic_job_trains_on_when_a_node_is_lost(
    two_node_cluster, tmp_path, corpus, monkeypatch, uninterrupted
):
    """`lockstep slurm --nodes 1:2`: nodeB's torchrun and worker are killed mid-run. Slurm keeps the step on nodeA
    (--no-kill --kill-on-bad-exit=0), nodeA's torchrun restarts its worker, the rendezvous re-forms with nodeA
    alone, and the worker resumes from the last commit at world size 1 with twice the accumulation: the run
    reaches its last step, and every step consumed exactly the samples of the uninterrupted 2-rank run."""
    run = tmp_path / "run"
    config = long_config(tmp_path / "c.yaml", corpus, tmp_path / "cache", run)
    monkeypatch.chdir(REPO)
    # short rendezvous timings: a lost node's heartbeat expires after 3 x 1 s, then 3 s of waiting for more nodes
    job_id, log = submit(
        two_node_cluster,
        tmp_path,
        config,
        "el",
        "1:2",
        "--rdzv-conf",
        "keep_alive_interval=1",
        "--rdzv-conf",
        "last_call_timeout=3",
    )
    env, on_a = two_node_cluster.env, two_node_cluster.on_a
    wait_until(lambda: committed_step(run) >= 10, 120, "a first committed checkpoint", log)
    with held([worker_pid(run, rank) for rank in (0, 1)]):
        assert kill_node_processes(two_node_cluster, "nodeB"), "no torchrun of the job on nodeB"
    state = wait_job(job_id, log, timeout=180, env=env, prefix=on_a)
    text = log.read_text()
    rank0 = (run / "logs" / "rank0.log").read_text()
    # Slurm ends the job FAILED: the step's exit code is that of its worst task, nodeB's killed one (137)
    assert state == "FAILED" and job_info(job_id, two_node_cluster)["ExitCode"] == "137:0", text[
        -4000:
    ]
    assert "srun: error: nodeB: task 1: Killed" in text
    resumed = re.findall(r"resumed from \S+ at step (\d+) \(.*now (\d+)\)", rank0)
    assert len(resumed) == 1 and resumed[0][1] == "1", rank0[-3000:]
    step = int(resumed[0][0])
    assert "world size 2 -> 1" in rank0  # the membership change, logged
    assert committed_step(run) == STEPS
    got = samples_per_step(recorded_samples(run, lost_after=(step, 1)))
    want = samples_per_step(recorded_samples(uninterrupted))
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want


def test_elastic_job_with_a_store_node_of_its_own_loses_its_first_worker_node(
    three_node_cluster, tmp_path, corpus, monkeypatch, uninterrupted
):
    """`lockstep slurm --nodes 1:2 --rdzv-store external`: a heterogeneous job whose first node runs the batch
    script and `lockstep rendezvous`, and no worker. The first worker node (the one that would host the store
    by default) has its torchrun and worker killed mid-run; the other re-forms the group through the store,
    resumes at world size 1, and every step consumed the samples of the uninterrupted 2-rank run."""
    run = tmp_path / "run"
    config = long_config(tmp_path / "c.yaml", corpus, tmp_path / "cache", run)
    monkeypatch.chdir(REPO)
    job_id, log = submit(
        three_node_cluster,
        tmp_path,
        config,
        "st",
        "1:2",
        "--rdzv-store",
        "external",
        "--rdzv-conf",
        "keep_alive_interval=1",
        "--rdzv-conf",
        "last_call_timeout=3",
    )
    wait_until(lambda: committed_step(run) >= 10, 180, "a first committed checkpoint", log)
    text = log.read_text()
    tasks = re.findall(
        r"lockstep: node (\d) \((\w+)\) addr (\S+) iface \S+ rendezvous (\S+):\d+ is_host=(\d)",
        text,
    )
    assert len(tasks) == 2 and {t[4] for t in tasks} == {"0"}, text[
        -3000:
    ]  # no worker node hosts it
    store_addr = tasks[0][3]
    store_node = next(n for n, a in three_node_cluster.addr.items() if a == store_addr)
    first = next(t[1] for t in tasks if t[0] == "0")
    assert store_node not in {t[1] for t in tasks}  # the store's node runs no worker
    with held([worker_pid(run, rank) for rank in (0, 1)]):
        assert kill_node_processes(three_node_cluster, first), f"no torchrun of the job on {first}"
    state = wait_job(
        job_id, log, timeout=180, env=three_node_cluster.env, prefix=three_node_cluster.on_a
    )
    rank0 = (run / "logs" / "rank0.log").read_text()
    assert state == "FAILED", log.read_text()[
        -4000:
    ]  # the killed task's exit code, as without the store
    resumed = re.findall(r"resumed from \S+ at step (\d+) \(.*now (\d+)\)", rank0)
    assert len(resumed) == 1 and resumed[0][1] == "1", rank0[-3000:]
    assert "world size 2 -> 1" in rank0 and committed_step(run) == STEPS
    got = samples_per_step(recorded_samples(run, lost_after=(int(resumed[0][0]), 1)))
    assert got == samples_per_step(recorded_samples(uninterrupted))
