"""The device and backend a process takes, the checks before a worker starts, a CPU host's threads and heap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import run_main

from lockstep.config import DistributedConfig
from lockstep.errors import ConfigError
from lockstep.runtime import check_local_launch, check_mixed_precision, pick_backend, pick_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's messages")
def test_cuda_requested_without_gpus(capsys):
    assert pick_device(DistributedConfig(), 0, 2) == torch.device("cpu")  # auto falls back to CPU
    with pytest.raises(
        ConfigError, match=r"2 process\(es\) asked for cuda but this machine has no GPU"
    ):
        pick_device(DistributedConfig(device="cuda"), 0, 2)
    # `lockstep train` asks before any worker starts
    code, out, err = run_main(capsys, "train", "--device", "cuda", "--world-size", "2")
    assert code == 2 and "Traceback" not in err, err
    assert "starting 2 workers" not in out, "workers were started before the input was checked"
    assert "asked for cuda" in err and "--device cpu" in err
    with pytest.raises(ConfigError, match=r"'nccl' needs CUDA devices; on CPU use --backend gloo"):
        pick_backend(DistributedConfig(backend="nccl"), torch.device("cpu"))
    assert pick_backend(DistributedConfig(), torch.device("cpu")) == "gloo"
    if not torch.distributed.is_mpi_available():
        with pytest.raises(ConfigError, match=r"'mpi' is not built into this torch"):
            pick_backend(DistributedConfig(backend="mpi"), torch.device("cpu"))


def test_backend_choice_for_cuda_devices():
    cuda = torch.device("cuda", 0)  # only the choice is checked; no device is touched
    assert pick_backend(DistributedConfig(), cuda) == "nccl"
    assert pick_backend(DistributedConfig(no_nccl=True), cuda) == "gloo"


def test_fp16_needs_a_cuda_device():
    # only the rule is checked; no device is touched
    cpu, cuda = (torch.device("cpu"), torch.device("cuda", 0))
    with pytest.raises(
        ConfigError,
        match=r"train.mixed_precision = 'fp16' needs a CUDA device \(GradScaler\), but "
        r"this process trains on cpu.*use --mixed-precision bf16 or no",
    ):
        check_mixed_precision("fp16", cpu)
    for ok in ("bf16", "no"):
        check_mixed_precision(ok, cpu)
    check_mixed_precision("fp16", cuda)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the CPU-only machine's pre-launch check"
)
def test_pre_launch_check_refuses_fp16_where_auto_picks_the_cpu(tmp_path, corpus, capsys):
    with pytest.raises(ConfigError, match=r"trains on cpu; this machine has no GPU"):
        check_local_launch(DistributedConfig(), 2, 2, "fp16")
    check_local_launch(DistributedConfig(), 2, 2, "bf16")
    # --device left at auto: the device is known only at launch, so the pre-launch check refuses it
    code, out, err = run_main(
        capsys,
        "train",
        "--world-size",
        "2",
        "--mixed-precision",
        "fp16",
        "--data",
        corpus,
        "--output-dir",
        tmp_path / "r",
    )
    assert code == 2 and "Traceback" not in err, err
    assert "starting 2 workers" not in out, "workers were started before the input was checked"
    assert "train.mixed_precision = 'fp16' needs a CUDA device" in err and "trains on cpu" in err
    assert "--mixed-precision bf16 or no" in err
    code, out, err = run_main(
        capsys,
        "train",
        "--mixed-precision",
        "fp16",
        "--data",
        corpus,
        "--output-dir",
        tmp_path / "r1",
    )  # one process: the same check
    assert code == 2 and "Traceback" not in err, err
    assert "starting 2 workers" not in out, "workers were started before the input was checked"
    assert "needs a CUDA device" in err and not (tmp_path / "r1" / "checkpoints").exists()
    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  path: {corpus}\ncheckpoint:\n  output_dir: {tmp_path / 'r2'}\n")
    code, out, err = run_main(
        capsys, "launch", config, "--nproc", "2", "--set", "train.mixed_precision=fp16"
    )
    assert (
        code == 2 and "lockstep launch: error: train.mixed_precision = 'fp16' needs a CUDA" in err
    )
    assert "worker(s) on this node" not in out and "Traceback" not in err


HEAP_PROBE = """
import torch
from lockstep.runtime import init_cpu_host
init_cpu_host(local_world_size=1)
keep = [torch.ones(1 << 20) for _ in range(50)]  # 50 x 4 MiB, alive together
heap = 0
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        heap += end - start
print(heap >> 20, torch.get_num_threads())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator and /proc/self/maps")
def test_cpu_host_keeps_large_blocks_on_the_heap_unless_the_user_tuned_it():
    # glibc's default maps each 4 MiB block on its own (above its 128 KiB starting threshold): the heap stays
    # small. lockstep's fixed 32 MiB threshold puts them on the heap, where freed ones are reused without faults.
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")
    }
    ours = subprocess.run(
        [sys.executable, "-c", HEAP_PROBE], env=base, capture_output=True, text=True, check=True
    )
    heap_mb, threads = map(int, ours.stdout.split())
    assert heap_mb >= 200 and threads == (os.cpu_count() or 1)
    theirs = subprocess.run(
        [sys.executable, "-c", HEAP_PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**base, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"},
    )
    heap_mb, threads = map(int, theirs.stdout.split())
    assert heap_mb < 100 and threads == 1  # what the user set in the environment wins
