"""The matmul peak: measured, and cached per machine so later runs start without the probe."""

from __future__ import annotations

import json

import pytest
import torch

from lockstep.peak_flops import (
    CACHE_FILE,
    load_peak_flops,
    measure_peak_flops,
    peak_key,
    probe_size,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measure_peak_flops_cpu(dtype):
    flops = measure_peak_flops(torch.device("cpu"), dtype, size=256, seconds=0.1)
    assert 1e8 < flops < 1e14


def test_the_peak_probe_leaves_the_training_rng_alone():
    # a resumed run probes at its restart, where the uninterrupted run did not: a draw here would shift dropout
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    measure_peak_flops(torch.device("cpu"), torch.float32, size=64, seconds=0.01)
    assert torch.equal(torch.rand(4), expected)


def test_the_first_run_measures_and_later_runs_read_the_cache(tmp_path):
    cpu = torch.device("cpu")
    measured = load_peak_flops(cpu, torch.float32, tmp_path)
    cache = json.loads((tmp_path / CACHE_FILE).read_text())
    assert cache == {peak_key(cpu, torch.float32): measured} and 1e8 < measured < 1e14
    # a value no probe would give: returned as is, so nothing was measured
    (tmp_path / CACHE_FILE).write_text(json.dumps({peak_key(cpu, torch.float32): 123.0}))
    assert load_peak_flops(cpu, torch.float32, tmp_path) == 123.0
    # another dtype is another entry; the first one is kept
    bf16 = load_peak_flops(cpu, torch.bfloat16, tmp_path)
    assert json.loads((tmp_path / CACHE_FILE).read_text()) == {
        peak_key(cpu, torch.float32): 123.0,
        peak_key(cpu, torch.bfloat16): bf16,
    }


def test_the_key_names_what_the_peak_depends_on():
    key = peak_key(torch.device("cpu"), torch.bfloat16)
    threads = torch.get_num_threads()
    assert f"threads {threads}" in key and "bfloat16" in key and torch.__version__ in key
    assert torch.backends.cpu.get_cpu_capability() in key
    torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
    try:
        # 1 and 2 threads peak differently
        assert peak_key(torch.device("cpu"), torch.bfloat16) != key
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_or_unwritable_cache_only_means_measuring(tmp_path):
    (tmp_path / CACHE_FILE).write_text("{not json")
    assert load_peak_flops(torch.device("cpu"), torch.float32, tmp_path) > 1e8
    assert peak_key(torch.device("cpu"), torch.float32) in json.loads(
        (tmp_path / CACHE_FILE).read_text()
    )
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a cache dir below a file cannot be made, even by root
    assert load_peak_flops(torch.device("cpu"), torch.float32, blocked / "cache") > 1e8
    assert not (blocked / "cache").exists()


def test_the_peak_probe_is_large_enough_for_an_h100():
    # 1024^3 takes ~3 us on an H100: launch-bound, the peak would read low and MFU high
    assert probe_size(torch.device("cuda")) >= 8192
    assert probe_size(torch.device("cpu")) == 1024
