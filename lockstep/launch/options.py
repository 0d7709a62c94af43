"""A job's node count, group restarts and rendezvous settings: one rule set for every launcher.

    --nnodes / --nodes N|MIN:MAX   a fixed job of N nodes, or an elastic one on MIN..MAX nodes
    --max-restarts N               torchrun's group restarts on a failure: 0 by default, 3 for a range
    --rdzv-conf KEY=VALUE          a c10d rendezvous setting, as torchrun takes it (last_call_timeout=10)

`lockstep launch`, `slurm` and `k8s` declare these flags once (lockstep.cli.launch_options) and read
them into a LaunchOptions here; the Slurm and Kubernetes renderers check their settings with the same
check_elastic, size a node with procs_per_node and plan an elastic job's batch with elastic_plan.
`is_host` is lockstep's to set on each node, never the user's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from lockstep.config import Config
from lockstep.errors import ConfigError
from lockstep.parallel.mesh import describe_plans, plan_world_sizes

ELASTIC_RESTARTS = 3  # torchrun's --max-restarts for an elastic job unless one is given
# no quote, comma or space: a value sits in a shell line (Slurm) and in torchrun's KEY=VALUE,KEY=VALUE list
RDZV_CONF_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.:-]+")


@dataclass(frozen=True)
class LaunchOptions:
    """The node range, the restarts and the rendezvous settings of one job, checked."""

    min_nodes: int = 1
    nodes: int = 1  # MAX: the node count of a fixed job
    max_restarts: int = 0
    rdzv_conf: dict[str, str] = field(default_factory=dict)

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.nodes

    def as_settings(self) -> dict[str, object]:
        """The fields a renderer's settings take (SlurmSettings, K8sSettings): min_nodes None when fixed."""
        return {
            "nodes": self.nodes,
            "min_nodes": self.min_nodes if self.elastic else None,
            "max_restarts": self.max_restarts,
            "rdzv_conf": self.rdzv_conf,
        }

    @property
    def spec(self) -> str:
        """As --nnodes takes it: N, or MIN:MAX."""
        return f"{self.min_nodes}:{self.nodes}" if self.elastic else str(self.nodes)


def launch_options(
    nnodes: str | int = "1", max_restarts: int | None = None, rdzv_conf: Iterable[str] = ()
) -> LaunchOptions:
    """The flags as given (--nnodes text, --max-restarts or None, --rdzv-conf items) -> LaunchOptions."""
    low, high = parse_nnodes(nnodes)
    conf = parse_rdzv_conf(rdzv_conf)
    return LaunchOptions(low, high, check_elastic(low, high, max_restarts, conf), conf)


def parse_nnodes(text: str | int) -> tuple[int, int]:
    """`--nnodes N` (a fixed job) or `MIN:MAX` (elastic: any node count in between) -> (MIN, MAX)."""
    low, sep, high = str(text).partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise ConfigError(
            f"--nnodes {text!r} is not a node count N or a range MIN:MAX (e.g. 2, or 1:2)"
        ) from None
    _check_range(*bounds, spec=str(text))
    return bounds


def parse_rdzv_conf(items: Iterable[str]) -> dict[str, str]:
    """`--rdzv-conf KEY=VALUE` (repeatable) -> {KEY: VALUE}, as torchrun's --rdzv-conf takes them."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf {item!r} is not KEY=VALUE (e.g. last_call_timeout=10)")
        out[key] = value
    check_rdzv_conf(out)
    return out


def check_elastic(
    min_nodes: int | None, nodes: int, max_restarts: int | None, rdzv_conf: dict[str, str]
) -> int:
    """The node range, restarts and rendezvous settings of a job; returns torchrun's --max-restarts
    (`max_restarts`, or its default: 0 for a fixed job, ELASTIC_RESTARTS for a range)."""
    low = nodes if min_nodes is None else min_nodes
    _check_range(low, nodes, spec=f"{low}:{nodes}")
    restarts = (
        max_restarts if max_restarts is not None else (ELASTIC_RESTARTS if low < nodes else 0)
    )
    if restarts < 0:
        raise ConfigError(f"--max-restarts {restarts} must be >= 0")
    if low < nodes and restarts == 0:
        raise ConfigError(
            f"--nnodes {low}:{nodes} with --max-restarts 0: the nodes left after a failure re-form "
            "the group in a restart; pass --max-restarts 1 or more (the default for a range is "
            f"{ELASTIC_RESTARTS})"
        )
    check_rdzv_conf(rdzv_conf)
    return restarts


def check_rdzv_conf(conf: dict[str, str]) -> None:
    """Plain values; timeouts and keep-alive settings whole numbers above 0; no is_host."""
    for key, value in conf.items():
        if not RDZV_CONF_RE.fullmatch(f"{key}={value}"):
            raise ConfigError(
                f"--rdzv-conf {key}={value!r}: expected KEY=VALUE with a plain value (letters, "
                "digits, '.', ':', '-', '_'), e.g. last_call_timeout=10"
            )
        if (key.endswith("_timeout") or key.startswith("keep_alive_")) and not (
            value.isdigit() and int(value) > 0
        ):
            raise ConfigError(
                f"--rdzv-conf {key}={value}: {key} must be a whole number of seconds (or attempts) "
                f"above 0, e.g. {key}=10"
            )
        if key == "is_host":
            raise ConfigError(
                "--rdzv-conf is_host: lockstep sets it per node (1 on the node that hosts the "
                "rendezvous); drop it"
            )


def _check_range(low: int, high: int, spec: str) -> None:
    if not 1 <= low <= high:
        raise ConfigError(
            f"--nnodes {spec}: MIN({low}) must be at least 1 and at most MAX({high}); "
            f"write MIN:MAX with 1 <= MIN <= MAX, e.g. 1:{max(high, 2)}"
        )


def procs_per_node(nodes: int, gpus_per_node: int, procs: int | None, cfg: Config) -> int:
    """Worker processes per node, checked against the GPUs and the config's world size and batch."""
    if nodes < 1:
        raise ConfigError(f"nodes = {nodes} must be >= 1")
    if gpus_per_node < 0 or (procs is not None and procs < 1):
        raise ConfigError(
            f"gpus_per_node = {gpus_per_node} must be >= 0 and procs_per_node = {procs} >= 1"
        )
    if gpus_per_node and procs is not None and procs != gpus_per_node:
        raise ConfigError(
            f"procs_per_node({procs}) != gpus_per_node({gpus_per_node}): lockstep runs one process per GPU; "
            "drop --procs-per-node, or use --gpus-per-node 0 for CPU workers"
        )
    nproc = gpus_per_node or procs or 1
    dist = cfg.distributed
    if not gpus_per_node and (dist.device == "cuda" or dist.backend == "nccl"):
        key = (
            "distributed.device = 'cuda'"
            if dist.device == "cuda"
            else "distributed.backend = 'nccl'"
        )
        raise ConfigError(
            f"{key} but gpus_per_node = 0; pass --gpus-per-node N, or use device cpu / backend gloo"
        )
    world = nodes * nproc
    label = "gpus_per_node" if gpus_per_node else "procs_per_node"
    if dist.world_size is not None and dist.world_size != world:
        raise ConfigError(
            f"nodes({nodes}) x {label}({nproc}) = {world} != distributed.world_size({dist.world_size}); "
            f"change --nodes / --{label.replace('_', '-')}, or set distributed.world_size to {world} (or drop it)"
        )
    if dist.rank is not None:
        raise ConfigError(
            f"distributed.rank = {dist.rank} is for hand-started processes; drop it, torchrun sets ranks"
        )
    from lockstep.parallel.mesh import check_layout

    # the layout and batch arithmetic for this world size fail here, not on the cluster
    check_layout(cfg, world)
    return nproc


def elastic_plan(
    cfg: Config, min_nodes: int, max_nodes: int, nproc: int
) -> tuple[dict[str, int | None], list[str]]:
    """For a node range: the config overrides every worker gets (global batch and micro-batch fixed at the largest
    world, accumulation worked out at each: {"train.batch_size": G, ...}), and one line per world size saying how
    the batch is made up there. A fixed node count: ({}, []). Refuses a batch that some world size in the range
    cannot keep."""
    if min_nodes == max_nodes:
        return {}, []
    worlds = [n * nproc for n in range(min_nodes, max_nodes + 1)]
    if cfg.distributed.world_size is not None:
        raise ConfigError(
            f"distributed.world_size = {cfg.distributed.world_size} fixes the world size, but nodes {min_nodes}:"
            f"{max_nodes} x {nproc} process(es) runs at {worlds[0]}..{worlds[-1]} ranks; drop distributed.world_size "
            "(the launcher sets it), or give a fixed node count"
        )
    overrides, plans = plan_world_sizes(cfg, worlds)
    return overrides, describe_plans(plans)
