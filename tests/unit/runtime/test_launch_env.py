"""torchrun, SLURM and hand-set ranks read into one LaunchEnv."""

from __future__ import annotations

import pytest

from lockstep.config import DistributedConfig
from lockstep.errors import ConfigError
from lockstep.runtime import read_launch_env

TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "x",
}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NTASKS": "8",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}


def test_torchrun_environment():
    env = read_launch_env(DistributedConfig(), TORCHRUN)
    assert (
        env.launcher,
        env.rank,
        env.local_rank,
        env.world_size,
        env.local_world_size,
        env.node_rank,
    ) == ("torchrun", 5, 1, 8, 4, 1)
    assert (env.master_addr, env.master_port) == ("node0", 29400)
    with pytest.raises(ConfigError, match=r"world_size = 4 but the launcher started WORLD_SIZE=8"):
        read_launch_env(DistributedConfig(world_size=4), TORCHRUN)


def test_srun_environment_without_torchrun():
    # no scontrol: parse the list
    env = read_launch_env(DistributedConfig(), {**SLURM, "PATH": "/nonexistent"})
    assert (
        env.launcher,
        env.rank,
        env.local_rank,
        env.world_size,
        env.local_world_size,
        env.node_rank,
    ) == ("slurm", 6, 2, 8, 4, 1)
    assert env.master_addr == "gpu07" and env.master_port == 20000 + 4242
    # a batch script's own shell (no srun step, one task) is not a multi-process launch
    assert (
        read_launch_env(DistributedConfig(), {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher
        == "none"
    )


def test_hand_started_rank_and_plain_process():
    env = read_launch_env(
        DistributedConfig(world_size=2, rank=1, master_addr="10.1.1.1", master_port=29555), {}
    )
    assert (env.launcher, env.rank, env.world_size, env.master_addr, env.master_port) == (
        "manual",
        1,
        2,
        "10.1.1.1",
        29555,
    )
    assert read_launch_env(DistributedConfig(), {}).launcher == "none"
