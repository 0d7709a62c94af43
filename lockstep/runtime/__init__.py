"""The process's place in the job: the only stage that reads the launcher's environment.

    launch_env   torchrun, SLURM or hand-set ranks -> one LaunchEnv (before any process group)
    device       the device and backend a process takes; the checks before a worker starts
    cuda         the lines only a GPU runs: binding, allocator and NCCL settings, device facts
    group        init_runtime / shutdown_runtime: the process group, its timeouts, `Runtime`
    process_end  exit_process: how a lockstep process ends (gloo's threads would abort finalization)

Everything else takes the `Runtime` that init_runtime returns (rt.rank, rt.device, rt.is_main).
"""

from lockstep.runtime.device import (
    check_local_launch,
    check_mixed_precision,
    default_local_processes,
    init_cpu_host,
    pick_backend,
    pick_device,
)
from lockstep.runtime.group import (
    Runtime,
    check_port_free,
    free_port,
    init_runtime,
    shutdown_runtime,
    side_group,
    wait_for_rendezvous,
)
from lockstep.runtime.launch_env import LaunchEnv, read_launch_env, under_launcher

__all__ = [
    "LaunchEnv",
    "Runtime",
    "check_local_launch",
    "check_mixed_precision",
    "check_port_free",
    "default_local_processes",
    "free_port",
    "init_cpu_host",
    "init_runtime",
    "pick_backend",
    "pick_device",
    "read_launch_env",
    "shutdown_runtime",
    "side_group",
    "under_launcher",
    "wait_for_rendezvous",
]
