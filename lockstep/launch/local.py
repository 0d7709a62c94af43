"""Start N workers on this machine through torchrun's elastic agent (not a spawner of our own).

The agent gives workers the same environment torchrun would (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*), forwards SIGTERM/SIGINT to them,
and reports which rank failed; the workers then join the group through
`lockstep.runtime.init_runtime` exactly as they would under torchrun.
"""

from __future__ import annotations

import sys
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from lockstep.runtime import check_port_free


class WorkerFailed(RuntimeError):
    """One or more workers exited with an error; the message names the ranks and exit codes."""


class LaunchInterrupted(RuntimeError):
    """The launcher got SIGTERM / SIGINT and passed it to the workers, which committed a checkpoint and stopped."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}; the workers committed a checkpoint first: "
                         "run the same command again to resume")
        self.signum = signum


def launch_local(module_args: list[str], nproc: int, master_port: int | None = None, max_restarts: int = 0) -> None:
    """Run `python -m <module_args...>` as `nproc` workers of one job on this machine."""
    if master_port is not None:
        check_port_free("127.0.0.1", master_port)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"lockstep-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        # port 0: the agent binds a free port itself, as `torchrun --standalone` does
        rdzv_endpoint=f"127.0.0.1:{master_port or 0}",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", *module_args)
    except ChildFailedError as e:
        failed = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(e.failures.items()))
        raise WorkerFailed(f"training failed on {failed}; each rank's log is in the run directory under logs/") from None
    except SignalException as e:  # the agent already forwarded the signal and waited for the workers to exit
        raise LaunchInterrupted(int(e.sigval)) from None
