"""Render, check and submit an sbatch script that runs `lockstep train` on a Slurm allocation.

Shape of the job: one srun task per node; each task runs torchrun, which starts one worker per GPU
(or `procs_per_node` CPU workers) and joins a c10d rendezvous hosted on the allocation's first node.
The batch script resolves that node to an address the other nodes can reach; each task then works
out, at run time and on its own node, whether it hosts the rendezvous (`is_host=1` on SLURM_NODEID 0,
so a host name that resolves to 127.0.0.1 cannot make torch miss that it is the host), its own
address (`--local-addr`) and the interface that carries it (GLOO_SOCKET_IFNAME). Everything that
differs per node therefore sits inside one single-quoted `bash -c` program, expanded by each task,
never by the batch shell.

An elastic job (`--nodes MIN:MAX`) asks Slurm for MAX nodes and keeps training on the nodes that are left
when one of them fails: ELASTIC_NOTE says what Slurm and torchrun each do then. With `requeue`, a
preemption or the time limit stops the workers at a step boundary with a committed checkpoint and
requeues the job, which resumes from it: REQUEUE_TRAP and the facts above it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.config import Config
from lockstep.errors import ConfigError
from lockstep.launch.options import check_elastic, elastic_plan, procs_per_node
from lockstep.launch.slurm_cpus import build_cpus_per_task, load_node_kinds
from lockstep.launch.slurm_store import check_store, serve_store, store_component
from lockstep.launch.slurm_text import ELASTIC_NOTE, REQUEUE_TRAP, STORE_NOTE

# Variables that differ per node or task: the batch shell runs once, on the first node, and would expand
# them to that node's values for every node. They may only appear in the per-task program.
PER_TASK_VARS = (
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_STEP_ID",
    "SLURMD_NODENAME",
)
# Variables the rendered script must hold literally, for the job (not the renderer) to expand.
JOB_VARS = ("$SLURM_JOB_ID", "$SLURM_NNODES", "$SLURM_JOB_NODELIST", "$SLURM_NODEID")
# Directives lockstep writes itself; a second value in sbatch_args would contradict the job's shape.
OWNED_DIRECTIVES = (
    "--nodes",
    "-N",
    "--ntasks",
    "-n",
    "--ntasks-per-node",
    "--gpus",
    "--gpus-per-node",
    "--gres",
    "--cpus-per-task",
    "-c",
    "--output",
    "-o",
    "--signal",
    "--requeue",
    "--no-requeue",
)
SIGNAL_LEAD_SECONDS = 120  # the time-limit / preemption warning: long enough to commit a checkpoint
# torchrun's grace between the SIGTERM it passes on and SIGKILL (its default is 30 s): most of the signal's lead,
# so a checkpoint that takes longer than 30 s to write still commits before the time limit
SHUTDOWN_SECONDS = SIGNAL_LEAD_SECONDS - 20
TIME_RE = re.compile(r"\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}")


@dataclass
class SlurmSettings:
    # training config (YAML) the workers load, made absolute; None = the overrides say it all
    config: str | None
    nodes: int = 1  # nodes in the allocation (the most, for an elastic job); one srun task (one torchrun) per node
    # elastic: the fewest nodes the job trains on (`--nodes MIN:MAX`); None = fixed
    min_nodes: int | None = None
    # torchrun's group restarts on a failure; None = 0, or 3 for an elastic job
    max_restarts: int | None = None
    # more c10d rendezvous settings, e.g. last_call_timeout
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    # GPUs per node; 0 = a CPU cluster (then procs_per_node sets the processes)
    gpus_per_node: int = 0
    # worker processes per node; None = gpus_per_node (or 1 without GPUs)
    procs_per_node: int | None = None
    # CPUs of each node's task, shared by its workers; None = slurm_cpus.py's default
    cpus_per_task: int | None = None
    time: str | None = None  # wall-clock limit in Slurm's format: MM, HH:MM:SS, D-HH:MM ...
    partition: str | None = None  # partition (queue); None = the cluster's default
    account: str | None = None  # account charged for the job
    job_name: str = "lockstep"  # job name; also names the log file
    # shell line that activates the environment: `source .venv/bin/activate`, `conda activate x`
    env_setup: str | None = None
    # exported before srun; `$VARS` expand when the job runs
    extra_env: dict[str, str] = field(default_factory=dict)
    log_dir: str = "slurm-logs"  # directory of the job's log file (<job_name>-<job id>.out)
    # on preemption / time limit: signal -> workers commit a checkpoint -> job requeued
    requeue: bool = False
    port: int = 29500  # rendezvous port (on the first node, or on the store's)
    # elastic: who serves the c10d store: node0 (the first node's torchrun) or external (a node of
    # its own that runs the batch script and `lockstep rendezvous`: lockstep.launch.slurm_store)
    rdzv_store: str = "node0"
    store_partition: str | None = None  # external: the store node's partition; None = --partition
    # config overrides passed to every worker as --set
    overrides: dict[str, str] = field(default_factory=dict)
    # further directives, e.g. --qos=high, --mem=200G
    sbatch_args: list[str] = field(default_factory=list)
    workdir: str = "."  # directory the job runs in (made absolute)


def check_settings(s: SlurmSettings, cfg: Config) -> int:
    """Every rule that can be checked before submission; returns the processes per node."""
    check_elastic(s.min_nodes, s.nodes, s.max_restarts, s.rdzv_conf)
    nproc = procs_per_node(s.nodes, s.gpus_per_node, s.procs_per_node, cfg)
    # a batch some world size in the range cannot keep
    elastic_plan(cfg, s.min_nodes or s.nodes, s.nodes, nproc)
    if s.cpus_per_task is not None and s.cpus_per_task < nproc:
        raise ConfigError(
            f"cpus_per_task({s.cpus_per_task}) < processes per node({nproc}): each worker needs a "
            f"CPU; set --cpus-per-task to at least {nproc}"
        )
    if s.time is not None and not TIME_RE.fullmatch(s.time):
        raise ConfigError(
            f"time = {s.time!r} is not a Slurm time; use MM, HH:MM:SS, D-HH or D-HH:MM:SS (e.g. 2-00:00:00)"
        )
    if not 0 < s.port < 65536:
        raise ConfigError(f"port = {s.port} must be in 1..65535")
    check_store(s.rdzv_store, s.min_nodes, s.nodes)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", s.job_name):
        raise ConfigError(f"job_name = {s.job_name!r} may only hold letters, digits, '_', '.', '-'")
    for key in s.extra_env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(
                f"--env {key!r}: not a shell variable name; use KEY=VALUE with KEY like NCCL_DEBUG"
            )
    for arg in s.sbatch_args:
        name = (arg.removeprefix("#SBATCH").split() or [""])[0].split("=")[0]
        name = name[:2] if re.fullmatch(r"-[A-Za-z].+", name) else name  # -N2 -> -N
        if name in OWNED_DIRECTIVES:
            raise ConfigError(
                f"--sbatch-arg {arg!r} sets {name}, which lockstep derives from its own settings; "
                "use the matching lockstep flag instead"
            )
    # a per-task variable written outside the per-task program is expanded once, on node 0, for every node
    for where, text in [
        ("--env-setup", s.env_setup or ""),
        *((f"--env {k}", v) for k, v in s.extra_env.items()),
    ]:
        for var in PER_TASK_VARS:
            if re.search(rf"\${{?{var}\b", text):
                raise ConfigError(
                    f"{where} uses ${var}, which the batch shell would expand once on the first node, giving "
                    "every node node 0's value; per-node values are set by lockstep's per-task program"
                )
    return nproc


def _dq(value: str) -> str:
    """Double-quote for bash, leaving `$VAR` to expand when the job runs (backslash, quote, backtick escaped)."""
    return '"' + re.sub(r'(["\\`])', r"\\\1", value) + '"'


def task_program(
    nproc: int,
    port: int,
    min_nodes: int | None = None,
    max_restarts: int = 0,
    rdzv_conf: dict[str, str] | None = None,
    external: bool = False,
) -> str:
    """The per-task program run by `srun bash -c '...'` on every node; `"$@"` is the worker command.

    Holds no single quote (it sits inside one). LOCKSTEP_HEAD_ADDR comes from the batch shell. An elastic job
    (`min_nodes` set) passes torchrun the range MIN:$SLURM_NNODES (the allocation's MAX nodes); with
    `external`, every task joins the store at LOCKSTEP_HEAD_ADDR as a client.
    """
    nnodes = f'"{min_nodes}:$SLURM_NNODES"' if min_nodes is not None else '"$SLURM_NNODES"'
    conf = ",".join(["is_host=$IS_HOST", *(f"{k}={v}" for k, v in (rdzv_conf or {}).items())])
    restarts = f" --max-restarts {max_restarts}" if max_restarts else ""
    # external: no task hosts the store (the batch host serves it); else node 0's torchrun
    host_test = "false" if external else '[ "$SLURM_NODEID" = 0 ]'
    program = f"""
if {host_test}; then
  IS_HOST=1; LOCAL_ADDR=$LOCKSTEP_HEAD_ADDR
else
  IS_HOST=0; LOCAL_ADDR=$(ip -4 route get "$LOCKSTEP_HEAD_ADDR" 2>/dev/null | sed -n "s/.* src \\([0-9.]*\\).*/\\1/p")
fi
[ -n "$LOCAL_ADDR" ] || read -r LOCAL_ADDR _ < <(hostname -I)
IFACE=$(ip -4 -o addr show to "$LOCAL_ADDR" 2>/dev/null | while read -r _ dev _; do echo "$dev"; break; done)
if [ -n "$IFACE" ]; then
  export GLOO_SOCKET_IFNAME=${{GLOO_SOCKET_IFNAME:-$IFACE}} NCCL_SOCKET_IFNAME=${{NCCL_SOCKET_IFNAME:-$IFACE}}
fi
echo "lockstep: node $SLURM_NODEID ($(hostname)) addr $LOCAL_ADDR iface ${{IFACE:-?}} rendezvous $LOCKSTEP_HEAD_ADDR:{port} is_host=$IS_HOST"
exec torchrun --nnodes {nnodes} --nproc-per-node {nproc}{restarts} --rdzv-backend c10d \\
  --rdzv-endpoint "$LOCKSTEP_HEAD_ADDR:{port}" --rdzv-id "$SLURM_JOB_ID" --rdzv-conf "{conf}" \\
  --local-addr "$LOCAL_ADDR" "$@"
"""
    assert "'" not in program
    return program


def resolve_cpus_per_task(s: SlurmSettings, nproc: int, cfg: Config) -> tuple[int, str]:
    """--cpus-per-task for each node's task, and where it comes from: the user's, or the default (sinfo at render
    time when it answers; lockstep/launch/slurm_cpus.py)."""
    if s.cpus_per_task is not None:
        return s.cpus_per_task, "--cpus-per-task"
    return build_cpus_per_task(
        nproc, s.gpus_per_node, cfg.data.num_workers, s.partition, load_node_kinds(s.partition)
    )


def _directives(s: SlurmSettings, log_dir: Path, cpus: int) -> list[str]:
    if s.rdzv_store == "external":  # a heterogeneous job: the store's node, then the workers'
        return _het_directives(s, log_dir, cpus)
    # An elastic job still asks for MAX nodes, not the range MIN-MAX: Slurm 22.05 gave `--nodes=1-2` one node
    # while two were idle, and an allocation never grows. --no-kill: a failed node does not end the allocation.
    directives = [f"--job-name={s.job_name}", f"--nodes={s.nodes}", "--ntasks-per-node=1"]
    if s.min_nodes is not None and s.min_nodes < s.nodes:
        directives.append("--no-kill")
    if s.gpus_per_node:
        directives.append(f"--gpus-per-node={s.gpus_per_node}")
    directives.append(f"--cpus-per-task={cpus}")
    directives += [f"--time={s.time}"] * bool(s.time) + [f"--partition={s.partition}"] * bool(
        s.partition
    )
    directives += [f"--account={s.account}"] * bool(s.account)
    directives += [f"--chdir={Path(s.workdir).resolve()}", f"--output={log_dir}/%x-%j.out"]
    if s.requeue:
        # B: signal the batch shell only (its trap stops the step); append: a requeued run keeps the first log
        directives += [f"--signal=B:USR1@{SIGNAL_LEAD_SECONDS}", "--requeue", "--open-mode=append"]
    return directives + [a.removeprefix("#SBATCH").strip() for a in s.sbatch_args]


def _het_directives(s: SlurmSettings, log_dir: Path, cpus: int) -> list[str]:
    """The job-wide settings and the store's node, `hetjob`, then the worker nodes (slurm_store)."""
    job = [f"--job-name={s.job_name}", "--no-kill"]
    job += [f"--time={s.time}"] * bool(s.time) + [f"--account={s.account}"] * bool(s.account)
    job += [f"--chdir={Path(s.workdir).resolve()}", f"--output={log_dir}/%x-%j.out"]
    if s.requeue:
        job += [f"--signal=B:USR1@{SIGNAL_LEAD_SECONDS}", "--requeue", "--open-mode=append"]
    workers = [f"--nodes={s.nodes}", "--ntasks-per-node=1"]
    workers += [f"--gpus-per-node={s.gpus_per_node}"] * bool(s.gpus_per_node)
    workers += [f"--cpus-per-task={cpus}"] + [f"--partition={s.partition}"] * bool(s.partition)
    workers += [f"--time={s.time}"] * bool(s.time)
    return [
        *store_component(job, s.store_partition or s.partition),
        *workers,
        *(a.removeprefix("#SBATCH").strip() for a in s.sbatch_args),
    ]


def render_sbatch(s: SlurmSettings, cfg: Config) -> str:
    """The sbatch script for these settings; raises ConfigError for anything that cannot work."""
    nproc = check_settings(s, cfg)
    restarts = check_elastic(s.min_nodes, s.nodes, s.max_restarts, s.rdzv_conf)
    external = s.rdzv_store == "external"
    low = s.min_nodes if s.min_nodes is not None else s.nodes
    plan_sets, plan_lines = elastic_plan(cfg, low, s.nodes, nproc)
    log_dir = Path(s.log_dir).resolve()
    cpus, cpus_from = resolve_cpus_per_task(s, nproc, cfg)

    # torchrun would set 1 for more than one worker; each worker gets its share of the task's CPUs instead
    env = {"OMP_NUM_THREADS": str(max(1, cpus // nproc))}
    if s.gpus_per_node:
        # fail a stuck NCCL collective with an error instead of hanging the job until its time limit
        env |= {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "${NCCL_DEBUG:-WARN}"}
    env |= s.extra_env
    worker = [
        "-m",
        "lockstep",
        "train",
        *(["--config", str(Path(s.config).resolve())] if s.config else []),
    ]
    plan_sets = {
        k: "none" if v is None else str(v) for k, v in plan_sets.items()
    }  # as --set reads them back
    for key, value in {**s.overrides, **plan_sets}.items():
        worker += ["--set", f"{key}={value}"]

    span = f"{s.nodes}" if low == s.nodes else f"{low} to {s.nodes}"
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in _directives(s, log_dir, cpus)), ""]
    lines.append(f"# rendered by `lockstep slurm`: {span} node(s) x {nproc} process(es)")
    lines.append(
        f"# --cpus-per-task={cpus}: {cpus_from}; OMP_NUM_THREADS={env['OMP_NUM_THREADS']} per process"
    )
    if plan_lines:
        lines += [
            ELASTIC_NOTE.format(
                low=low, high=s.nodes, restarts=restarts, store=STORE_NOTE[s.rdzv_store]
            ),
            "# batch plan at each world size:",
            *(f"#   {line}" for line in plan_lines),
        ]
    # a failed activation would run the workers with some other python: stop instead
    if s.env_setup:
        fail = shlex.quote(f"lockstep: environment setup failed: {s.env_setup}")
        lines += ["{", f"  {s.env_setup}", f"}} || {{ echo {fail} >&2; exit 1; }}"]
    lines += [f"export {k}={_dq(v)}" for k, v in env.items()]
    lines += [
        "# torch's agents would share one rendezvous TCP store across every restart of the group, and a node",
        "# that rejoins has another restart count than the survivors: with this set, rank 0's worker hosts a",
        "# fresh store for each rendezvous round (lockstep's runtime then joins with env://)",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
    ]
    # torchrun's grace for the workers after SIGTERM (older torch ignores the variable)
    if s.requeue:
        lines.append(f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={SHUTDOWN_SECONDS}")
    lines += [
        "",
        "# the rendezvous host: the allocation's first node, where this script runs. Its name may resolve to",
        "# 127.0.0.1 (network namespaces, /etc/hosts), useless to the other nodes: then take its first address.",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "LOCKSTEP_HEAD_ADDR=$(getent ahostsv4 \"$HEAD_NODE\" | awk '$1 !~ /^127\\./ {print $1; exit}')",
        '[ -n "$LOCKSTEP_HEAD_ADDR" ] || read -r LOCKSTEP_HEAD_ADDR _ < <(hostname -I)',
        'if [ -z "$LOCKSTEP_HEAD_ADDR" ]; then',
        '  echo "lockstep: no address for the first node $HEAD_NODE that other nodes can reach" >&2; exit 1',
        "fi",
        "export LOCKSTEP_HEAD_ADDR",
        *(serve_store(s.port) if external else []),
        "",
    ]
    # --cpus-per-task again on srun: Slurm 22.05-23.02 steps do not inherit it and would pin torchrun and all
    # its workers to one CPU. --kill-on-bad-exit=1 for a fixed job: a failed node ends the step instead of leaving
    # the rest waiting; an elastic one keeps the step on the nodes left (--no-kill: also when a node is lost).
    group = " --het-group=1" if external else ""  # the workers' component
    srun = f"srun{group} --ntasks-per-node=1 --cpus-per-task={cpus}"
    srun += " --no-kill --kill-on-bad-exit=0" if low < s.nodes else " --kill-on-bad-exit=1"
    program = task_program(
        nproc, s.port, low if low < s.nodes else None, restarts, s.rdzv_conf, external
    )
    srun += f" bash -c '{program}' lockstep-task {shlex.join(worker)}"
    if s.requeue:
        lines += [
            REQUEUE_TRAP.format(lead=SIGNAL_LEAD_SECONDS),
            f"{srun} &",
            "SRUN_PID=$!",
            'wait "$SRUN_PID"',
        ]
    else:
        lines.append(srun)
    script = "\n".join(lines) + "\n"
    check_script(script)
    return script


def check_script(script: str) -> None:
    """The rendered text still holds the job's variables literally, and bash can parse it."""
    missing = [v for v in JOB_VARS if v not in script]
    assert not missing, f"rendered sbatch script lost {missing}: expanded at render time?"
    if shutil.which("bash"):
        proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        if proc.returncode:
            raise ConfigError(
                f"the rendered sbatch script is not valid bash ({proc.stderr.strip()}); check "
                "--env-setup and --env values for unbalanced quotes"
            )
