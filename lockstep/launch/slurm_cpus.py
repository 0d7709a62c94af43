"""The CPUs each node's task asks Slurm for (`--cpus-per-task`) when the user does not say.

lockstep runs one task per node, and that task is torchrun with all of the node's workers. Without
--cpus-per-task Slurm gives the task one CPU, and a cluster that pins tasks to their CPUs (task/affinity,
task/cgroup) then runs every worker, its DataLoader processes and its OpenMP threads on that one core.
The default, in order:
1. `sinfo` answers for the partition (the job's, or the cluster's default): the CPUs of its smallest node, or,
   for a GPU job on nodes whose GPUs sinfo reports, that node's share for the GPUs asked for
   (CPUs x gpus_per_node / GPUs of the node); a job may land on any node of the partition, so the smallest counts.
2. Otherwise, per worker: 8 CPUs for a GPU worker (ample for a worker and its DataLoader processes on common
   GPU nodes, 12-26 CPUs per GPU; a node with fewer makes sbatch refuse the job at once), 1 for a CPU worker, and at
   least 1 + data.num_workers for either (the worker and its DataLoader processes).
   data.num_workers "auto" counts as 1 here: each worker gets at least 2 CPUs, so "auto" in the job
   then finds 2 cores per rank and starts 1 DataLoader worker (data.sampler.resolve_num_workers).
Each worker then runs OMP_NUM_THREADS = cpus_per_task // workers threads.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from lockstep.errors import ConfigError

CPUS_PER_GPU_WORKER = 8  # without sinfo: a GPU worker's CPUs
SINFO_TIMEOUT = 15  # seconds; an unreachable slurmctld must not stall rendering


@dataclass(frozen=True)
class NodeKind:
    cpus: int  # CPUs Slurm schedules on such a node (sinfo %c)
    gpus: int  # GPUs in its GRES (sinfo %G); 0 when none or not reported


def parse_gpus(gres: str) -> int:
    """GPUs in a sinfo %G field: `gpu:8`, `gpu:a100:4(S:0-1)`, `gpu:2,shard:8`, `(null)`."""
    total = 0
    for item in gres.split(","):
        fields = re.sub(r"\(.*?\)", "", item).strip().split(":")
        if fields[0] == "gpu" and len(fields) >= 2 and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def parse_sinfo(text: str, partition: str | None) -> list[NodeKind]:
    """Node kinds of `partition` (None: the default one, marked '*') from `sinfo -h -o %P|%c|%G` lines."""
    kinds = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3:
            continue
        name, cpus, gres = parts
        if (partition is None and name.endswith("*")) or name.rstrip("*") == partition:
            # "64+": a group of nodes with 64 or more; 64 is what every one has
            count = cpus.rstrip("+")
            if count.isdigit():
                kinds.append(NodeKind(int(count), parse_gpus(gres)))
    return kinds


def load_node_kinds(partition: str | None) -> list[NodeKind]:
    """The partition's node kinds from `sinfo`; [] when sinfo is missing, fails or does not answer in time."""
    if not shutil.which("sinfo"):
        return []
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-o", "%P|%c|%G"], capture_output=True, text=True, timeout=SINFO_TIMEOUT
        )
    except (subprocess.TimeoutExpired, OSError):
        return []
    return parse_sinfo(proc.stdout, partition) if proc.returncode == 0 else []


def node_share(kinds: list[NodeKind], gpus_per_node: int) -> tuple[int, str] | None:
    """(CPUs, basis): a GPU job's share of the smallest node with enough GPUs, else the smallest node's CPUs."""
    with_gpus = [k for k in kinds if k.gpus >= gpus_per_node > 0]
    if with_gpus:
        return min(
            k.cpus * gpus_per_node // k.gpus for k in with_gpus
        ), f"{gpus_per_node} GPU(s)' share of"
    return (min(k.cpus for k in kinds), "all CPUs of") if kinds else None


def build_cpus_per_task(
    nproc: int,
    gpus_per_node: int,
    data_workers: int | str,
    partition: str | None,
    kinds: list[NodeKind],
) -> tuple[int, str]:
    """The default --cpus-per-task and where it comes from (a comment in the script).

    `data_workers` is data.num_workers: a number, or "auto" (counted as 1 DataLoader worker).
    """
    where = f"partition {partition}" if partition else "the default partition"
    found = node_share(kinds, gpus_per_node)
    if found is not None:
        share, basis = found
        if share < nproc:
            raise ConfigError(
                f"{where}'s nodes have {share} CPU(s) for this job, fewer than its {nproc} processes per "
                "node; use fewer --procs-per-node / --gpus-per-node, another --partition, or "
                f"--cpus-per-task N with N >= {nproc}"
            )
        return share, f"{basis} the smallest node of {where} (sinfo)"
    floor = CPUS_PER_GPU_WORKER if gpus_per_node else 1
    auto = data_workers == "auto"
    per_worker = max(floor, 1 + (1 if auto else data_workers))
    what = "GPU" if gpus_per_node else "CPU"
    loaders = "1 for data.num_workers auto" if auto else "data.num_workers"
    return nproc * per_worker, (
        f"{nproc} {what} worker(s) x {per_worker} CPUs = "
        f"max({floor}, 1 + {loaders}) each (sinfo gave no node size)"
    )
