"""Render, check and submit an sbatch script that runs `lockstep train` on a Slurm allocation.

Shape of the job: one srun task per node; each task runs torchrun, which starts one worker per GPU
(or `procs_per_node` CPU workers) and joins a c10d rendezvous hosted on the allocation's first node.
The batch script resolves that node to an address the other nodes can reach; each task then works
out, at run time and on its own node, whether it hosts the rendezvous (`is_host=1` on SLURM_NODEID 0,
so a host name that resolves to 127.0.0.1 cannot make torch miss that it is the host), its own
address (`--local-addr`) and the interface that carries it (GLOO_SOCKET_IFNAME). Everything that
differs per node therefore sits inside one single-quoted `bash -c` program, expanded by each task,
never by the batch shell.
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

# Variables that differ per node or task: the batch shell runs once, on the first node, and would expand
# them to that node's values for every node. They may only appear in the per-task program.
PER_TASK_VARS = ("SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_ID", "SLURMD_NODENAME")
# Variables the rendered script must hold literally, for the job (not the renderer) to expand.
JOB_VARS = ("$SLURM_JOB_ID", "$SLURM_NNODES", "$SLURM_JOB_NODELIST", "$SLURM_NODEID")
# Directives lockstep writes itself; a second value in sbatch_args would contradict the job's shape.
OWNED_DIRECTIVES = ("--nodes", "-N", "--ntasks", "-n", "--ntasks-per-node", "--gpus", "--gpus-per-node",
                    "--gres", "--cpus-per-task", "-c", "--output", "-o", "--signal", "--requeue", "--no-requeue")
SIGNAL_LEAD_SECONDS = 120  # the time-limit / preemption warning: long enough to commit a checkpoint
TIME_RE = re.compile(r"\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}")


class SubmitError(RuntimeError):
    """sbatch is missing or refused the script; the message says what to do."""


@dataclass
class SlurmSettings:
    config: str | None  # training config (YAML) the workers load, made absolute; None = the overrides say it all
    nodes: int = 1  # nodes in the allocation; one srun task (one torchrun) per node
    gpus_per_node: int = 0  # GPUs per node; 0 = a CPU cluster (then procs_per_node sets the processes)
    procs_per_node: int | None = None  # worker processes per node; None = gpus_per_node (or 1 without GPUs)
    cpus_per_task: int | None = None  # CPUs of each node's task, shared by its workers; OMP_NUM_THREADS = this / procs
    time: str | None = None  # wall-clock limit in Slurm's format: MM, HH:MM:SS, D-HH:MM ...
    partition: str | None = None  # partition (queue); None = the cluster's default
    account: str | None = None  # account charged for the job
    job_name: str = "lockstep"  # job name; also names the log file
    env_setup: str | None = None  # shell line that activates the environment: `source .venv/bin/activate`, `conda activate x`
    extra_env: dict[str, str] = field(default_factory=dict)  # exported before srun; `$VARS` expand when the job runs
    log_dir: str = "slurm-logs"  # directory of the job's log file (<job_name>-<job id>.out)
    requeue: bool = False  # on preemption / time limit: signal -> workers commit a checkpoint -> job requeued
    port: int = 29500  # rendezvous port on the first node
    overrides: dict[str, str] = field(default_factory=dict)  # config overrides passed to every worker as --set
    sbatch_args: list[str] = field(default_factory=list)  # further directives, e.g. --qos=high, --mem=200G
    workdir: str = "."  # directory the job runs in (made absolute)


def procs_per_node(nodes: int, gpus_per_node: int, procs: int | None, cfg: Config) -> int:
    """Worker processes per node, checked against the GPUs and the config's world size and batch."""
    if nodes < 1:
        raise ConfigError(f"nodes = {nodes} must be >= 1")
    if gpus_per_node < 0 or (procs is not None and procs < 1):
        raise ConfigError(f"gpus_per_node = {gpus_per_node} must be >= 0 and procs_per_node = {procs} >= 1")
    if gpus_per_node and procs is not None and procs != gpus_per_node:
        raise ConfigError(
            f"procs_per_node({procs}) != gpus_per_node({gpus_per_node}): lockstep runs one process per GPU; "
            "drop --procs-per-node, or use --gpus-per-node 0 for CPU workers")
    nproc = gpus_per_node or procs or 1
    dist = cfg.distributed
    if not gpus_per_node and (dist.device == "cuda" or dist.backend == "nccl"):
        key = "distributed.device = 'cuda'" if dist.device == "cuda" else "distributed.backend = 'nccl'"
        raise ConfigError(f"{key} but gpus_per_node = 0; pass --gpus-per-node N, or use device cpu / backend gloo")
    world = nodes * nproc
    label = "gpus_per_node" if gpus_per_node else "procs_per_node"
    if dist.world_size is not None and dist.world_size != world:
        raise ConfigError(
            f"nodes({nodes}) x {label}({nproc}) = {world} != distributed.world_size({dist.world_size}); "
            f"change --nodes / --{label.replace('_', '-')}, or set distributed.world_size to {world} (or drop it)")
    if dist.rank is not None:
        raise ConfigError(f"distributed.rank = {dist.rank} is for hand-started processes; drop it, torchrun sets ranks")
    from lockstep.parallel.mesh import check_layout

    check_layout(cfg, world)  # the layout and batch arithmetic for this world size fail here, not on the cluster
    return nproc


def check_settings(s: SlurmSettings, cfg: Config) -> int:
    """Every rule that can be checked before submission; returns the processes per node."""
    nproc = procs_per_node(s.nodes, s.gpus_per_node, s.procs_per_node, cfg)
    if s.cpus_per_task is not None and s.cpus_per_task < nproc:
        raise ConfigError(f"cpus_per_task({s.cpus_per_task}) < processes per node({nproc}): each worker needs a "
                          f"CPU; set --cpus-per-task to at least {nproc}")
    if s.time is not None and not TIME_RE.fullmatch(s.time):
        raise ConfigError(f"time = {s.time!r} is not a Slurm time; use MM, HH:MM:SS, D-HH or D-HH:MM:SS (e.g. 2-00:00:00)")
    if not 0 < s.port < 65536:
        raise ConfigError(f"port = {s.port} must be in 1..65535")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", s.job_name):
        raise ConfigError(f"job_name = {s.job_name!r} may only hold letters, digits, '_', '.', '-'")
    for key in s.extra_env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"--env {key!r}: not a shell variable name; use KEY=VALUE with KEY like NCCL_DEBUG")
    for arg in s.sbatch_args:
        name = (arg.removeprefix("#SBATCH").split() or [""])[0].split("=")[0]
        name = name[:2] if re.fullmatch(r"-[A-Za-z].+", name) else name  # -N2 -> -N
        if name in OWNED_DIRECTIVES:
            raise ConfigError(f"--sbatch-arg {arg!r} sets {name}, which lockstep derives from its own settings; "
                              "use the matching lockstep flag instead")
    # a per-task variable written outside the per-task program is expanded once, on node 0, for every node
    for where, text in [("--env-setup", s.env_setup or ""), *((f"--env {k}", v) for k, v in s.extra_env.items())]:
        for var in PER_TASK_VARS:
            if re.search(rf"\${{?{var}\b", text):
                raise ConfigError(
                    f"{where} uses ${var}, which the batch shell would expand once on the first node, giving "
                    "every node node 0's value; per-node values are set by lockstep's per-task program")
    return nproc


def _dq(value: str) -> str:
    """Double-quote for bash, leaving `$VAR` to expand when the job runs (backslash, quote, backtick escaped)."""
    return '"' + re.sub(r'(["\\`])', r"\\\1", value) + '"'


def task_program(nproc: int, port: int) -> str:
    """The per-task program run by `srun bash -c '...'` on every node; `"$@"` is the worker command.

    Holds no single quote (it sits inside one). LOCKSTEP_HEAD_ADDR comes from the batch shell.
    """
    program = f"""
if [ "$SLURM_NODEID" = 0 ]; then
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
exec torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {nproc} --rdzv-backend c10d \\
  --rdzv-endpoint "$LOCKSTEP_HEAD_ADDR:{port}" --rdzv-id "$SLURM_JOB_ID" --rdzv-conf "is_host=$IS_HOST" \\
  --local-addr "$LOCAL_ADDR" "$@"
"""
    assert "'" not in program
    return program


def render_sbatch(s: SlurmSettings, cfg: Config) -> str:
    """The sbatch script for these settings; raises ConfigError for anything that cannot work."""
    nproc = check_settings(s, cfg)
    log_dir = Path(s.log_dir).resolve()
    directives = [f"--job-name={s.job_name}", f"--nodes={s.nodes}", "--ntasks-per-node=1"]
    if s.gpus_per_node:
        directives.append(f"--gpus-per-node={s.gpus_per_node}")
    if s.cpus_per_task:
        directives.append(f"--cpus-per-task={s.cpus_per_task}")
    directives += [f"--time={s.time}"] * bool(s.time) + [f"--partition={s.partition}"] * bool(s.partition)
    directives += [f"--account={s.account}"] * bool(s.account)
    directives += [f"--chdir={Path(s.workdir).resolve()}", f"--output={log_dir}/%x-%j.out"]
    if s.requeue:
        # B: signal the batch shell only (its trap stops the step); append: a requeued run keeps the first log
        directives += [f"--signal=B:USR1@{SIGNAL_LEAD_SECONDS}", "--requeue", "--open-mode=append"]
    directives += [a.removeprefix("#SBATCH").strip() for a in s.sbatch_args]

    env = {"OMP_NUM_THREADS": str(max(1, (s.cpus_per_task or nproc) // nproc))}
    if s.gpus_per_node:
        # fail a stuck NCCL collective with an error instead of hanging the job until its time limit
        env |= {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "${NCCL_DEBUG:-WARN}"}
    env |= s.extra_env
    worker = ["-m", "lockstep", "train", *(["--config", str(Path(s.config).resolve())] if s.config else [])]
    for key, value in s.overrides.items():
        worker += ["--set", f"{key}={value}"]

    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), ""]
    lines.append(f"# rendered by `lockstep slurm`: {s.nodes} node(s) x {nproc} process(es) = {s.nodes * nproc} ranks")
    if s.env_setup:  # a failed activation would run the workers with some other python: stop instead
        fail = shlex.quote(f"lockstep: environment setup failed: {s.env_setup}")
        lines += ["{", f"  {s.env_setup}", f"}} || {{ echo {fail} >&2; exit 1; }}"]
    lines += [f"export {k}={_dq(v)}" for k, v in env.items()]
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
        "",
    ]
    # --cpus-per-task again on srun: Slurm 22.05-23.02 steps do not inherit it and would pin torchrun and all
    # its workers to one CPU; --kill-on-bad-exit: a failed node ends the step instead of leaving the rest waiting
    srun = "srun --ntasks-per-node=1" + (f" --cpus-per-task={s.cpus_per_task}" if s.cpus_per_task else "")
    srun += f" --kill-on-bad-exit=1 bash -c '{task_program(nproc, s.port)}' lockstep-task {shlex.join(worker)}"
    if s.requeue:
        lines += [
            "# time limit or preemption: USR1 arrives 120 s ahead; SIGTERM to srun reaches torchrun and the workers,",
            "# which commit a checkpoint and exit; the requeued job resumes from it (checkpoint.resume = auto)",
            "lockstep_requeue() {",
            '  echo "lockstep: got USR1, stopping the workers and requeueing job $SLURM_JOB_ID"',
            '  kill -TERM "$SRUN_PID" 2>/dev/null',
            '  wait "$SRUN_PID"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "  exit 0",
            "}",
            "trap lockstep_requeue USR1",
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
            raise ConfigError(f"the rendered sbatch script is not valid bash ({proc.stderr.strip()}); check "
                              "--env-setup and --env values for unbalanced quotes")


def check_partition(partition: str | None) -> None:
    """When `sinfo` is here, the partition must be one of the cluster's."""
    if partition is None or not shutil.which("sinfo"):
        return
    proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise SubmitError(f"sinfo failed ({proc.stderr.strip()}); is slurmctld reachable?")
    valid = sorted({p.strip().rstrip("*") for p in proc.stdout.split() if p.strip()})
    if partition not in valid:
        raise ConfigError(f"partition {partition!r} is not one of this cluster's partitions: {', '.join(valid)}; "
                          "pick one with --partition (or omit it for the default)")


def submit_sbatch(s: SlurmSettings, script: str) -> tuple[str, Path]:
    """Submit the rendered script; returns (job id, log path)."""
    if not shutil.which("sbatch"):
        raise SubmitError("sbatch not found; use --dry-run to print the script")
    check_partition(s.partition)
    log_dir = Path(s.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)  # sbatch does not create it: the job would fail with no log at all
    path = log_dir / f"{s.job_name}.sbatch"
    path.write_text(script)
    proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60)
    if proc.returncode:
        raise SubmitError(f"sbatch refused {path}: {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;cluster"
    return job_id, log_dir / f"{s.job_name}-{job_id}.out"
