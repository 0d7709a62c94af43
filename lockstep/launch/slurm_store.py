"""An elastic Slurm job whose rendezvous store outlives any worker node: a heterogeneous job.

By default the first node's torchrun hosts torch's c10d store, and that node also runs the batch
script: when it is lost, Slurm ends the job (`--no-kill` keeps a job only through the loss of its
other nodes), so no store elsewhere could save it. `--rdzv-store external` renders a heterogeneous
job instead (https://slurm.schedmd.com/heterogeneous_jobs.html): its first component is one task on
a node of its own, where the batch script runs and serves the store (`lockstep rendezvous`,
lockstep.launch.store); the second is the worker nodes, whose torchruns all join the store as
clients. The job then trains on after losing any worker node, the first one included; it ends with
the store's node, which runs nothing else. Seen on Slurm 22.05 (tests/e2e/test_slurm_cluster.py):
the components get distinct nodes, so the job needs MAX + 1; in the workers' step SLURM_NNODES,
SLURM_NODEID and SLURM_JOB_NODELIST are their component's; the backfill scheduler starts the job.
"""

from __future__ import annotations

from lockstep.errors import ConfigError

STORES = ("node0", "external")


def check_store(store: str, min_nodes: int | None, nodes: int) -> None:
    """--rdzv-store: one of STORES; external only for an elastic job (--nodes MIN:MAX)."""
    if store not in STORES:
        raise ConfigError(f"--rdzv-store {store!r} is not one of {', '.join(STORES)}")
    if store == "external" and (min_nodes is None or min_nodes >= nodes):
        raise ConfigError(
            "--rdzv-store external: only an elastic job (--nodes MIN:MAX) re-forms its group "
            "through the store; a fixed-size job ends with any node. Drop --rdzv-store, or give "
            "--nodes a range"
        )


def store_component(job_wide: list[str], partition: str | None) -> list[str]:
    """The directives of the store's component (the batch script runs there), then `hetjob`."""
    where = [f"--partition={partition}"] if partition else []
    return [*job_wide, "--nodes=1", "--ntasks=1", "--cpus-per-task=1", *where, "hetjob"]


def serve_store(port: int) -> list[str]:
    """Batch-script lines that serve the store on this node (LOCKSTEP_HEAD_ADDR) while the job
    runs."""
    return [
        "# the rendezvous store, served here: this node runs the batch script and no worker",
        f'python -m lockstep rendezvous --host "$LOCKSTEP_HEAD_ADDR" --port {port} &',
        "STORE_PID=$!",
        "trap 'kill \"$STORE_PID\" 2>/dev/null' EXIT",
    ]
