"""`lockstep slurm`: the rendered sbatch script, parsed and run per node with stand-in Slurm tools, and every
input it must refuse before submission. Jobs on real Slurm clusters (one node, two nodes): test_slurm_cluster.py."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.launch.slurm import SlurmSettings, render_sbatch


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(
        "model: {hidden_size: 32, attention_heads: 2, layers: 2, max_seq_length: 32}\n"
        "train: {max_steps: 4, batch_size: 16, sample_tokens: 0}\n"
    )
    return path


def render(config: Path, **kw) -> str:
    kw.setdefault("log_dir", str(config.parent / "logs"))
    return render_sbatch(SlurmSettings(config=str(config), **kw), load_config(config))


def directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            out[key] = value
    return out


def srun_tokens(script: str) -> list[str]:
    """The srun command as the batch shell sees it: one line (plus the quoted program), split like bash."""
    start = script.index("\nsrun ") + 1
    return shlex.split(script[start:].split("\nSRUN_PID")[0].rstrip(" &\n"))


def torchrun_args(program: str) -> list[str]:
    line = program[program.index("exec torchrun") :].replace("\\\n", " ")
    return shlex.split(line)[2:]


def test_render_gpu_job(config):
    script = render(
        config,
        nodes=2,
        gpus_per_node=8,
        cpus_per_task=64,
        time="04:00:00",
        partition="gpu",
        account="proj",
        job_name="gpt",
        env_setup="source .venv/bin/activate",
        extra_env={"HF_HOME": "$HOME/hf"},
        port=29600,
    )
    d = directives(script)
    assert d["--nodes"] == "2" and d["--ntasks-per-node"] == "1" and d["--gpus-per-node"] == "8"
    assert d["--cpus-per-task"] == "64" and d["--time"] == "04:00:00" and d["--partition"] == "gpu"
    assert d["--account"] == "proj" and d["--job-name"] == "gpt"
    assert d["--output"] == f"{config.parent / 'logs'}/%x-%j.out"
    assert "--requeue" not in d and "--signal" not in d
    assert 'export OMP_NUM_THREADS="8"' in script  # 64 CPUs / 8 processes
    assert 'export HF_HOME="$HOME/hf"' in script  # left for the job to expand
    assert "NCCL_DEBUG" in script and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in script
    assert script.index("source .venv/bin/activate") < script.index("\nsrun ")

    tokens = srun_tokens(script)
    assert tokens[:4] == [
        "srun",
        "--ntasks-per-node=1",
        "--cpus-per-task=64",
        "--kill-on-bad-exit=1",
    ]
    i = tokens.index("bash")
    assert tokens[i + 1] == "-c"
    program, worker = tokens[i + 2], tokens[i + 4 :]
    assert worker == ["-m", "lockstep", "train", "--config", str(config.resolve())]
    args = torchrun_args(program)
    pairs = dict(zip(args[0::2], args[1::2]))
    # inside the single-quoted program the job's variables are still literal: each task expands them itself
    assert pairs["--nnodes"] == "$SLURM_NNODES" and pairs["--nproc-per-node"] == "8"
    assert pairs["--rdzv-backend"] == "c10d" and pairs["--rdzv-id"] == "$SLURM_JOB_ID"
    assert pairs["--rdzv-endpoint"] == "$LOCKSTEP_HEAD_ADDR:29600"
    assert pairs["--rdzv-conf"] == "is_host=$IS_HOST" and pairs["--local-addr"] == "$LOCAL_ADDR"
    assert '"$SLURM_NODEID" = 0' in program
    # per-node variables never appear outside the per-task program
    outside = script.replace(f"'{program}'", "")
    assert "SLURM_NODEID" not in outside and "$SLURM_JOB_ID" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_render_cpu_job_with_overrides(config):
    script = render(
        config, nodes=2, procs_per_node=2, cpus_per_task=4, overrides={"train.max_steps": "8"}
    )
    d = directives(script)
    assert "--gpus-per-node" not in d and d["--nodes"] == "2"
    assert 'export OMP_NUM_THREADS="2"' in script and "NCCL_DEBUG" not in script
    tokens = srun_tokens(script)
    program = tokens[tokens.index("-c") + 1]
    assert (
        dict(zip(torchrun_args(program)[0::2], torchrun_args(program)[1::2]))["--nproc-per-node"]
        == "2"
    )
    assert tokens[-2:] == ["--set", "train.max_steps=8"]


def test_render_elastic_job(config, tmp_path):
    """nodes 1..2: Slurm keeps the allocation and the step when a node fails, torchrun re-forms the group on the
    nodes left (MIN:$SLURM_NNODES, restarts), and every worker keeps the global batch at either world size."""
    script = render(
        config,
        nodes=2,
        min_nodes=1,
        procs_per_node=2,
        rdzv_conf={"last_call_timeout": "5"},
        cpus_per_task=4,
    )
    d = directives(script)
    # not 1-2: Slurm 22.05 then gave one node of two idle ones
    assert d["--nodes"] == "2" and "--no-kill" in d
    tokens = srun_tokens(script)
    assert tokens[:5] == [
        "srun",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",
        "--no-kill",
        "--kill-on-bad-exit=0",
    ]
    assert tokens[-6:] == [
        "--set",
        "train.batch_size=16",
        "--set",
        "train.micro_batch_size=4",
        "--set",
        "train.grad_accum=none",
    ]
    # the batch plan at each world size, in the script for whoever reads it later
    assert (
        "#   4 ranks: global batch 16 = 4 replicas x micro-batch 4 x 1 accumulation step" in script
    )
    assert (
        "#   2 ranks: global batch 16 = 2 replicas x micro-batch 4 x 2 accumulation steps" in script
    )
    assert "\nexport TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in script

    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(
        ["bash", "-c", script],
        env=fake_tools(tmp_path / "bin", out, getent_addr="192.0.2.9"),
        check=True,
        timeout=60,
    )
    for n in (0, 1):
        args, _ = node_args(out, n)
        pairs = dict(zip(args[0:16:2], args[1:16:2]))
        # MIN:the nodes Slurm gave
        assert pairs["--nnodes"] == "1:2" and pairs["--max-restarts"] == "3"
        assert pairs["--rdzv-conf"] == f"is_host={int(n == 0)},last_call_timeout=5"


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(nodes=1, min_nodes=2), "--nnodes 2:1: MIN(2) must be at least 1 and at most MAX(1)"),
        (dict(nodes=2, min_nodes=1, max_restarts=0), "--nnodes 1:2 with --max-restarts 0"),
        (
            dict(nodes=4, min_nodes=2, procs_per_node=2),
            "global batch 16 (micro-batch 2, fixed at the largest world size, 8) cannot be kept",
        ),
        (
            dict(nodes=2, min_nodes=1, rdzv_conf={"last_call_timeout": "5 s"}),
            "--rdzv-conf last_call_timeout='5 s'",
        ),
        (dict(nodes=2, min_nodes=1, rdzv_conf={"is_host": "1"}), "lockstep sets it per node"),
    ],
)
def test_elastic_refused(config, kw, message):
    with pytest.raises(ConfigError) as e:
        render(config, **kw)
    assert message in str(e.value)


def test_elastic_with_a_fixed_world_size(config):
    cfg = load_config(config, {"distributed.world_size": 2})
    with pytest.raises(
        ConfigError,
        match=r"distributed.world_size = 2 fixes the world size, but nodes 1:2 x 1 "
        r"process\(es\) runs at 1..2 ranks; drop distributed.world_size",
    ):
        render_sbatch(SlurmSettings(config=str(config), nodes=2, min_nodes=1), cfg)


def fake_tools(bin_dir: Path, out: Path, getent_addr: str, srun_sleep: float = 0) -> dict[str, str]:
    """Stand-ins for scontrol / scancel / getent / srun / torchrun: srun runs its task once per node, in turn,
    with that node's SLURM_NODEID, then waits `srun_sleep` s for its step (a sleep) to end; torchrun records its
    arguments and interface variables. scancel, like Slurm, signals the step, not srun; every srun / scancel /
    scontrol action is logged, in order, to out/events."""
    bin_dir.mkdir()
    scripts = {
        "scontrol": f'if [ "$1" = show ]; then printf "nodeA\\nnodeB\\n"; else echo "scontrol $*" >> {out}/events; fi',
        "scancel": f'echo "scancel $*" >> {out}/events; kill -TERM "$(cat {out}/step.pid)"',
        "getent": f'echo "{getent_addr} STREAM $2"',
        "srun": (
            f'trap "echo srun got TERM >> {out}/events; exit 143" TERM\n'
            f'echo "srun started" >> {out}/events\n'
            'while [ "${1#--}" != "$1" ]; do shift; done\n'
            f'for n in 0 1; do SLURM_NODEID=$n "$@" > {out}/node$n 2>&1; done\n'
            f"sleep {srun_sleep} & echo $! > {out}/step.pid; wait $!\n"
            f'echo "srun step ended ($?)" >> {out}/events'
        ),
        "torchrun": (
            'echo "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}"; '
            'echo "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-}"; '
            'printf "%s\\n" "$@"'
        ),
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[A-B]",
    }


def node_args(out: Path, n: int) -> tuple[list[str], str]:
    lines = (out / f"node{n}").read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("GLOO_SOCKET_IFNAME="))
    # every torchrun: a fresh store per round
    assert lines[i + 1] == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    return lines[i + 2 :], lines[i].partition("=")[2]


def test_script_expands_per_node(config, tmp_path):
    """Run the script's body: each node's task must derive its own is_host / local address at run time."""
    script = render(config, nodes=2, procs_per_node=2)
    out = tmp_path / "out"
    out.mkdir()
    host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    env = fake_tools(tmp_path / "bin", out, getent_addr=host_ip)
    subprocess.run(["bash", "-c", script], env=env, check=True, timeout=60)
    for n in (0, 1):
        args, _ = node_args(out, n)
        pairs = dict(zip(args[0:14:2], args[1:14:2]))
        assert pairs["--nnodes"] == "2" and pairs["--rdzv-id"] == "4242"
        assert pairs["--rdzv-endpoint"] == f"{host_ip}:29500"
        assert pairs["--rdzv-conf"] == f"is_host={int(n == 0)}"
        assert not pairs["--local-addr"].startswith("127.") and pairs["--local-addr"]
        assert args[14:] == ["-m", "lockstep", "train", "--config", str(config.resolve())]


def test_a_store_node_of_its_own_is_a_heterogeneous_job(config, tmp_path):
    """--rdzv-store external: the store's node first (the batch script runs there, one task, one CPU, its
    own partition), `hetjob`, then the workers'; the script serves the store at the batch host's address,
    and every worker node joins it as a client (is_host=0), the first one included."""
    script = render(
        config,
        nodes=2,
        min_nodes=1,
        procs_per_node=1,
        cpus_per_task=2,
        rdzv_store="external",
        partition="gpu",
        store_partition="cpu",
        time="10",
    )
    lines = [
        line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")
    ]
    store, workers = lines[: lines.index("hetjob")], lines[lines.index("hetjob") + 1 :]
    assert {"--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--partition=cpu", "--no-kill"} <= set(
        store
    )
    assert {"--job-name=lockstep", "--time=10"} <= set(store)
    assert workers == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        "--partition=gpu",
        "--time=10",
    ]
    assert "srun --het-group=1 --ntasks-per-node=1 --cpus-per-task=2 " in script
    assert "The batch host serves the rendezvous store and runs no worker" in script
    out = tmp_path / "out"
    out.mkdir()
    host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    env = fake_tools(tmp_path / "bin", out, getent_addr=host_ip)
    (tmp_path / "bin" / "python").write_text(f'#!/bin/bash\necho "python $*" >> {out}/store\n')
    (tmp_path / "bin" / "python").chmod(0o755)
    subprocess.run(["bash", "-c", script], env=env, check=True, timeout=60)
    assert (out / "store").read_text() == (
        f"python -m lockstep rendezvous --host {host_ip} --port 29500\n"
    )
    for n in (0, 1):
        args, _ = node_args(out, n)
        pairs = dict(zip(args[0:16:2], args[1:16:2]))
        assert pairs["--rdzv-endpoint"] == f"{host_ip}:29500" and pairs["--nnodes"] == "1:2"
        assert pairs["--rdzv-conf"] == "is_host=0"


def test_head_name_resolving_to_loopback(config, tmp_path):
    """The pitfall: the first node's name resolves to 127.0.0.1; the endpoint must be a reachable address,
    and the head must still know it is the host (is_host=1 rather than torch's host-name matching)."""
    script = render(config, nodes=2, procs_per_node=1)
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(
        ["bash", "-c", script],
        env=fake_tools(tmp_path / "bin", out, getent_addr="127.0.0.1"),
        check=True,
        timeout=60,
    )
    args, iface = node_args(out, 0)
    pairs = dict(zip(args[0:14:2], args[1:14:2]))
    endpoint = pairs["--rdzv-endpoint"].rsplit(":", 1)[0]
    assert not endpoint.startswith("127.") and pairs["--local-addr"] == endpoint
    assert pairs["--rdzv-conf"] == "is_host=1"
    assert iface and iface != "lo"


def test_requeue_stops_the_step_then_requeues(config, tmp_path):
    """USR1 (the time limit's warning) -> SIGTERM to the step through scancel, never to srun itself (Slurm 22.05's
    srun answers SIGTERM by SIGKILLing its tasks, before they commit) -> srun ends -> the job is requeued."""
    script = render(config, nodes=2, procs_per_node=1, requeue=True)
    d = directives(script)
    assert d["--signal"] == "B:USR1@120" and "--requeue" in d and d["--open-mode"] == "append"
    # torchrun's grace for the commit, not 30 s
    assert "\nexport TORCH_ELASTIC_SHUTDOWN_TIMEOUT=100\n" in script
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        ["bash", "-c", script], env=fake_tools(tmp_path / "bin", out, "192.0.2.9", srun_sleep=30)
    )
    deadline = time.monotonic() + 20
    while not (out / "step.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=20) == 0
    events = (out / "events").read_text().splitlines()
    assert events == [
        "srun started",
        "scancel --signal=TERM 4242",
        "srun step ended (143)",
        "scontrol requeue 4242",
    ], events


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(nodes=2, gpus_per_node=8, world_size=12),
            "nodes(2) x gpus_per_node(8) = 16 != distributed.world_size(12)",
        ),
        (
            dict(nodes=3, procs_per_node=2, world_size=4),
            "nodes(3) x procs_per_node(2) = 6 != distributed.world_size(4)",
        ),
        (dict(nodes=2, gpus_per_node=8, procs_per_node=4), "procs_per_node(4) != gpus_per_node(8)"),
        (
            dict(nodes=1, gpus_per_node=8, cpus_per_task=4),
            "cpus_per_task(4) < processes per node(8)",
        ),
        (dict(nodes=2, procs_per_node=1, time="4h"), "time = '4h' is not a Slurm time"),
        (
            dict(nodes=2, extra_env={"NODE_RANK": "$SLURM_NODEID"}),
            "--env NODE_RANK uses $SLURM_NODEID",
        ),
        (dict(nodes=2, env_setup="export R=${SLURM_PROCID}"), "--env-setup uses $SLURM_PROCID"),
        (
            dict(nodes=2, sbatch_args=["--ntasks-per-node=8"]),
            "sets --ntasks-per-node, which lockstep derives",
        ),
        (dict(nodes=2, sbatch_args=["-N4"]), "sets -N"),
        (dict(nodes=2, env_setup='echo "unclosed'), "not valid bash"),
        (dict(nodes=3, procs_per_node=2), "global batch 16 is not divisible by world_size(6)"),
    ],
)
def test_refused_before_submission(config, kw, message):
    world = kw.pop("world_size", None)
    cfg = load_config(config, {"distributed.world_size": world} if world else None)
    with pytest.raises(ConfigError) as e:
        render_sbatch(SlurmSettings(config=str(config), **kw), cfg)
    assert message in str(e.value)
