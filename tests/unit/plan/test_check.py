"""lockstep.plan.check: the plan's memory check before train starts its workers, on this CPU (the
CUDA path is the GPU tier's): skipped by default here, a refusal with the numbers, the fixes and the
flag to go on, or a warning, as train.plan_check says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.plan.check import _precision, check_before_launch, profile_here

CPU = torch.device("cpu")
# ~26B parameters, ~400 GiB with gradients and AdamW: more than any machine has, planned on
# fake tensors in seconds
HUGE = {
    "model.hidden_size": 32768,
    "model.attention_heads": 256,
    "model.layers": 2,
    "model.max_seq_length": 16,
    "train.batch_size": 2,
}


def test_the_cpu_s_budget_is_its_available_memory_over_the_local_processes():
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    available = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:"))
    profile = profile_here(CPU, 2)
    assert profile.reserve_gib == 0 and "over 2 process(es)" in profile.name
    assert profile.memory_gib == pytest.approx(available * 1024 / 2 / 2**30, rel=0.05)


def test_a_step_that_does_not_fit_is_refused_with_the_numbers_and_the_flag_to_go_on():
    cfg = load_config(None, {**HUGE, "train.plan_check": "auto"})
    assert check_before_launch(cfg, 2, 2, CPU) is None  # auto: CPU runs are not checked
    cfg.train.plan_check = "refuse"
    with pytest.raises(ConfigError) as refused:
        check_before_launch(cfg, 2, 2, CPU)
    message = str(refused.value)
    needs = float(message.split("needs ")[1].split(" GiB")[0])
    assert needs > 350  # 26B float32 parameters, their gradients and AdamW's two moments
    assert "parameters " in message and "optimizer " in message
    assert "one setting changed: parallel.data_parallel=fsdp: peak" in message
    assert message.endswith("to start anyway: --set train.plan_check=warn (or off)")
    cfg.train.plan_check = "warn"
    warning = check_before_launch(cfg, 2, 2, CPU)
    # the same words but the flag (the memory available may have moved meanwhile)
    assert warning is not None and warning.split(" of ")[0] == message.split(" of ")[0]
    assert "plan_check" not in warning
    cfg.train.plan_check = "off"
    assert check_before_launch(cfg, 2, 2, CPU) is None


def test_a_step_that_fits_and_a_custom_model_pass():
    small = {"model.hidden_size": 64, "model.layers": 2, "train.plan_check": "refuse"}
    assert check_before_launch(load_config(None, small), 2, 2, CPU) is None
    custom = load_config(None, {**HUGE, "train.plan_check": "refuse"})
    custom.model.kind = "custom"  # its model comes from the user's code
    assert check_before_launch(custom, 2, 2, CPU) is None


def _nvidia_smi(bin_dir: Path, line: str, code: int = 0) -> None:
    """An `nvidia-smi` first on PATH that answers the check's query as the driver's tool does (this
    machine has no GPU): its CSV line, or a failure."""
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\necho '{line}'\nexit {code}\n")
    tool.chmod(0o755)


def test_a_gpu_is_read_from_nvidia_smi_and_auto_precision_follows_its_capability(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    cuda = torch.device("cuda", 0)
    _nvidia_smi(tmp_path, "NVIDIA H100 80GB HBM3, 81559, 9.0")
    profile = profile_here(cuda, 8)
    assert profile.name == "NVIDIA H100 80GB HBM3" and profile.memory_gib == 81559 / 1024
    assert profile.bf16_tflops == 989.0 and profile.reserve_gib == 2.0  # the H100's datasheet
    assert _precision("auto", cuda) == "bf16" and _precision("fp16", cuda) == "fp16"
    cfg = load_config(None, {**HUGE, "train.plan_check": "auto"})  # auto: checked on CUDA
    with pytest.raises(ConfigError, match=r"of 77.65 GiB usable on NVIDIA H100 80GB HBM3"):
        check_before_launch(cfg, 2, 2, cuda)
    _nvidia_smi(tmp_path, "Tesla V100-SXM2-32GB, 32768, 7.0")
    assert _precision("auto", cuda) == "no"  # no native bf16: train runs fp32
    # the check's own failure is a warning, and the run goes on
    _nvidia_smi(tmp_path, "NVIDIA-SMI has failed", code=9)
    warning = check_before_launch(cfg, 2, 2, cuda)
    assert warning.startswith("lockstep plan's memory check could not run (CalledProcessError")
