"""lockstep.plan.profiles: the built-in device profiles, a YAML file's, and what a bad one gets."""

from __future__ import annotations

import json

import pytest

from lockstep.doctor.device import datasheet_tflops
from lockstep.errors import ConfigError
from lockstep.plan.profiles import PROFILES, RESERVE_GIB, load_profile


def test_the_built_in_profiles_agree_with_the_doctor_s_datasheet_table():
    assert set(PROFILES) == {"h100-80gb", "h200", "a100-80gb"}
    for name, board in (
        ("h100-80gb", "NVIDIA H100 80GB HBM3"),
        ("h200", "NVIDIA H200"),
        ("a100-80gb", "NVIDIA A100-SXM4-80GB"),
    ):
        assert load_profile(name).bf16_tflops == datasheet_tflops(board), name
    h100 = load_profile("h100-80gb")
    assert h100.usable_bytes == int((79.1 - RESERVE_GIB) * 2**30)
    assert h100.intra_node_gbs > h100.inter_node_gbs > 0
    # the share of the peak a step reaches is the device's: an A100's (MosaicML's published runs)
    # over an H100's (this project's measurement), the H200 computing as the H100
    efficiency = {name: p.compute_efficiency for name, p in PROFILES.items()}
    assert efficiency == {"h100-80gb": 0.38, "h200": 0.38, "a100-80gb": 0.54}


def test_a_yaml_file_is_a_profile(tmp_path):
    path = tmp_path / "mi300x.yaml"
    path.write_text(
        "name: mi300x\nmemory_gib: 191.5\nbf16_tflops: 1307\nintra_node_gbs: 448\n"
        "inter_node_gbs: 50\ncompute_efficiency: 0.3\n"
    )
    p = load_profile(str(path))
    assert (p.name, p.memory_gib, p.bf16_tflops, p.compute_efficiency) == (
        "mi300x",
        191.5,
        1307,
        0.3,
    )
    assert p.source == str(path) and p.link_efficiency == 0.8


def test_an_unknown_profile_lists_the_known_ones(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"'b200' is neither a known profile nor a YAML file; "
        r"known: h100-80gb, h200, a100-80gb",
    ):
        load_profile("b200")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmemory_gib: 80\nbf16_tflop: 1\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown keys \['bf16_tflop'\], missing \['bf16_tflops', "
        r"'intra_node_gbs', 'inter_node_gbs'\]",
    ):
        load_profile(str(bad))
    bad.write_text(
        "name: x\nmemory_gib: -1\nbf16_tflops: 1\nintra_node_gbs: 1\ninter_node_gbs: 1\n"
    )
    with pytest.raises(ConfigError, match="memory_gib must be numbers >= 0"):
        load_profile(str(bad))


def _report(hosts: list[str], kind: str = "cuda", bandwidth: bool = True) -> dict:
    """A report in the shape `lockstep doctor --json` writes (tests/unit/doctor/test_probes.py
    loads a real 2-rank one)."""
    ranks = [
        {
            "rank": i,
            "host": host,
            "hardware": {"kind": kind, "name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1 - i},
            "peak": {"dtype": "bfloat16", "size": 8192, "flops": (700 + i) * 1e12},
        }
        for i, host in enumerate(hosts)
    ]
    sizes = [
        {"bytes": 1024, "size": "1 KiB", "busbw_gbps": 0.5, "time_us": 21.0},
        {"bytes": 4096, "size": "4 KiB", "busbw_gbps": 1.9, "time_us": 19.5},
        {"bytes": 2**26, "size": "64 MiB", "busbw_gbps": 42.0, "time_us": 2900.0},
    ]
    return {"ok": True, "ranks": ranks, "bandwidth": sizes if bandwidth else []}


def test_a_doctor_report_is_the_cluster_as_measured(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(_report(["a", "a", "b", "b"])))
    profile = load_profile(str(path))
    assert profile.memory_gib == 79.1 - 3 and profile.reserve_gib == RESERVE_GIB
    assert profile.bf16_tflops == 700  # the slowest rank's
    assert profile.intra_node_gbs == profile.inter_node_gbs == 42.0  # the largest message's
    assert profile.collective_latency_us == 19.5  # the fastest all-reduce's time
    assert all(p.collective_latency_us == 0 for p in PROFILES.values())  # none measured
    assert "(4 ranks on 2 hosts)" in profile.name and str(path) in profile.source


def test_a_report_without_bandwidth_or_not_a_report_is_refused(tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps(_report(["a"], bandwidth=False)))
    with pytest.raises(ConfigError, match="measured no all-reduce bandwidth .* --nproc N"):
        load_profile(str(one))
    other = tmp_path / "other.json"
    other.write_text('{"loss": 1.0}')
    with pytest.raises(ConfigError, match=r"not a report of `lockstep doctor --json` \(KeyError"):
        load_profile(str(other))
