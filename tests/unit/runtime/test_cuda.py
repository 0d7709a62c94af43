"""The CUDA-only lines' decisions, checked on a CPU: which GPU a rank binds, the allocator and NCCL
settings a process starts with, and that the device sync a timer needs is nothing on a CPU."""

from __future__ import annotations

import pytest
import torch

from lockstep.config import DistributedConfig
from lockstep.errors import ConfigError
from lockstep.runtime import pick_device
from lockstep.runtime.cuda import DUMP_VARS, cuda_device_index, cuda_environment, synchronize


def test_each_local_rank_takes_its_own_gpu():
    assert [cuda_device_index(r, 8, 8, None) for r in range(8)] == list(range(8))
    assert cuda_device_index(1, 2, 4, "0,1,2,3") == 1  # fewer processes than GPUs: the first ones
    assert cuda_device_index(0, 1, 1, None) == 0


def test_a_launcher_that_binds_one_gpu_per_task_leaves_each_rank_gpu_0():
    # srun --gpus-per-task=1: local rank 5 of 8 sees only its own GPU, renumbered 0
    assert cuda_device_index(5, 8, 1, "5") == 0
    assert cuda_device_index(3, 4, 1, "GPU-8c1f0d3e-aaaa") == 0  # UUIDs are as good as indices


def test_more_processes_than_gpus_is_refused_with_the_counts_and_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"8 processes on this node asked for cuda but local rank 5 sees 4 GPU\(s\) "
        r"\(CUDA_VISIBLE_DEVICES unset\); .*--world-size 4.*--gpus-per-task=1",
    ):
        cuda_device_index(5, 8, 4, None)
    # one GPU and no launcher binding (CUDA_VISIBLE_DEVICES unset): 2 processes would share it
    with pytest.raises(
        ConfigError, match=r"local rank 1 sees 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES unset\)"
    ):
        cuda_device_index(1, 2, 1, None)
    # 3 processes, 2 GPUs: rank 0 fits, the node does not
    with pytest.raises(ConfigError, match=r"sees 2 GPU"):
        cuda_device_index(0, 3, 2, None)


def test_expandable_segments_unless_the_user_tuned_the_allocator():
    assert cuda_environment({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert cuda_environment({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {}
    assert cuda_environment({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}


def test_nccl_flight_recorder_dumps_into_the_run_directory(tmp_path):
    got = cuda_environment({}, tmp_path / "hang")
    prefix = str(tmp_path / "hang" / "nccl_trace_rank_")
    assert (
        got["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and got["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    )
    assert [got[v] for v in DUMP_VARS] == [prefix, prefix]
    # the user's own buffer size is kept; a dump file of theirs keeps lockstep's hands off all of it
    assert (
        cuda_environment({"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}, tmp_path)[
            "TORCH_NCCL_TRACE_BUFFER_SIZE"
        ]
        == "50"
    )
    mine = cuda_environment({"TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"}, tmp_path)
    assert not any(k.startswith(("TORCH_NCCL", "TORCH_FR")) for k in mine)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's choices")
def test_auto_device_is_the_cpu_and_sync_is_nothing_there():
    assert pick_device(DistributedConfig(), 3, 4, {"CUDA_VISIBLE_DEVICES": "3"}) == torch.device(
        "cpu"
    )
    synchronize(torch.device("cpu"))  # returns at once: no CUDA call is made on a CPU
    assert not torch.cuda.is_initialized()


def test_a_cpu_device_is_described_by_its_name_alone():
    from lockstep.runtime.cuda import describe_device

    assert describe_device(torch.device("cpu")) == "cpu"
