"""`lockstep plan` against the device (issue 30): the memory check train runs before its workers on
CUDA, and the plan's predicted peak for the run tests/gpu/test_memory.py measures.

The prediction comes from a simulation on fake CPU tensors (its saved tensors are those of the CPU
kernels torch picks; a GPU's flash attention keeps less), so the bound is loose and both numbers are
recorded for BENCHMARKS.md's table.
"""

from __future__ import annotations

import pytest
import torch

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.parallel.mesh import check_layout, resolve_batch
from lockstep.plan.check import _precision, check_before_launch, profile_here
from lockstep.plan.simulate import simulate_rank
from lockstep.train.step import resolve_mixed_precision

from .runs import metrics, train
from .test_memory import FLAGS

CUDA = torch.device("cuda")
SETS = {
    "model.hidden_size": 512,
    "model.attention_heads": 8,
    "model.layers": 8,
    "model.max_seq_length": 512,
    "train.batch_size": 16,
    "train.micro_batch_size": 16,
    "train.mixed_precision": "bf16",
}


def test_the_device_s_profile_is_its_own_memory():
    """nvidia-smi's memory.total (what the check reads, so the launcher holds no CUDA context)
    against torch's total_memory: the same device, within what the driver keeps for itself."""
    profile = profile_here(CUDA, 1)
    assert profile.name == torch.cuda.get_device_name(CUDA)
    total = torch.cuda.get_device_properties(CUDA).total_memory / 2**30
    assert profile.memory_gib == pytest.approx(total, rel=0.02)
    # train.mixed_precision = auto as the check reads it (nvidia-smi's compute capability) and as
    # train resolves it (torch)
    assert _precision("auto", CUDA) == resolve_mixed_precision("auto", CUDA)[0]


def test_a_run_too_large_for_the_device_is_refused_by_default():
    huge = {"model.hidden_size": 32768, "model.attention_heads": 256, "model.layers": 2}
    cfg = load_config(None, {**huge, "model.max_seq_length": 16, "train.batch_size": 1})
    with pytest.raises(ConfigError, match="to start anyway: --set train.plan_check=warn"):
        check_before_launch(cfg, 1, 1, CUDA)  # train.plan_check = auto: checked on CUDA
    assert check_before_launch(load_config(None, SETS), 1, 1, CUDA) is None


def test_the_planned_peak_against_the_measured_one(tmp_path, corpus, token_cache, record_property):
    cfg = load_config(None, SETS)
    layout = check_layout(cfg, 1)
    predicted = simulate_rank(cfg, layout, resolve_batch(cfg.train, 1), 0).peak / 2**20
    train(tmp_path / "run", corpus, token_cache, *FLAGS)
    measured = metrics(tmp_path / "run")[-1]["peak_mem_mb"]  # torch.cuda.max_memory_allocated
    record_property("plan_peak_mb_predicted", round(predicted, 1))
    record_property("plan_peak_mb_measured", round(measured, 1))
    assert 0.7 * measured <= predicted <= 1.3 * measured, (predicted, measured)
