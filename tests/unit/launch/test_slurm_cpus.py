"""The default --cpus-per-task of `lockstep slurm`: from sinfo's node sizes, or per worker without them; and how it
reaches the script (directive, srun, OMP_NUM_THREADS). A real cluster's value: tests/e2e/test_slurm_cluster.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.launch.slurm import SlurmSettings, render_sbatch
from lockstep.launch.slurm_cpus import (
    NodeKind,
    build_cpus_per_task,
    load_node_kinds,
    parse_gpus,
    parse_sinfo,
)

from .test_slurm import config, directives, srun_tokens  # noqa: F401  (the fixture, written once)

# `sinfo -h -o %P|%c|%G` of a cluster with a default CPU partition and a GPU partition of two node kinds
SINFO = """cpu*|64|(null)
gpu|128|gpu:a100:8(S:0-1)
gpu|96+|gpu:h100:4,shard:16
debug|2|(null)
"""


@pytest.mark.parametrize(
    "gres, gpus",
    [
        ("(null)", 0),
        ("gpu:8", 8),
        ("gpu:a100:4(S:0-1)", 4),
        ("gpu:2,shard:8", 2),
        ("gpu:a100:2,gpu:v100:2", 4),
        ("mps:400", 0),
    ],
)
def test_parse_gpus(gres, gpus):
    assert parse_gpus(gres) == gpus


def test_parse_sinfo():
    assert parse_sinfo(SINFO, None) == [NodeKind(64, 0)]  # the default partition
    assert parse_sinfo(SINFO, "gpu") == [NodeKind(128, 8), NodeKind(96, 4)]
    assert parse_sinfo(SINFO, "nope") == [] and parse_sinfo("garbage\n", None) == []


@pytest.mark.parametrize(
    "nproc, gpus, partition, want",
    [
        # the 96-CPU, 4-GPU node cannot take 8 GPUs: all of the 128-CPU, 8-GPU one
        (8, 8, "gpu", 128),
        (4, 4, "gpu", 64),  # 4 of 8 GPUs: 64 of 128 CPUs; 4 of 4: 96; the smaller counts
        (2, 0, None, 64),  # CPU workers: the whole (smallest) node
    ],
)
def test_from_sinfo(nproc, gpus, partition, want):
    value, why = build_cpus_per_task(nproc, gpus, 1, partition, parse_sinfo(SINFO, partition))
    assert value == want and "(sinfo)" in why


def test_without_sinfo():
    assert build_cpus_per_task(8, 8, 1, None, [])[0] == 64  # 8 per GPU worker
    assert build_cpus_per_task(4, 4, 11, None, [])[0] == 48  # 1 + 11 DataLoader processes each
    value, why = build_cpus_per_task(2, 0, 0, None, [])
    assert (
        value == 2
        and why
        == "2 CPU worker(s) x 1 CPUs = max(1, 1 + data.num_workers) each (sinfo gave no node size)"
    )
    # data.num_workers auto (the default) counts 1 DataLoader worker: 2 CPUs per CPU worker, so
    # auto then finds 2 cores per rank in the job and starts 1 worker; a GPU worker's 8 stay 8
    assert build_cpus_per_task(2, 0, "auto", None, []) == (
        4,
        "2 CPU worker(s) x 2 CPUs = max(1, 1 + 1 for data.num_workers auto) each "
        "(sinfo gave no node size)",
    )
    assert build_cpus_per_task(4, 4, "auto", None, []) == (
        32,
        "4 GPU worker(s) x 8 CPUs = max(8, 1 + 1 for data.num_workers auto) each "
        "(sinfo gave no node size)",
    )
    # sinfo's node size wins over the per-worker count
    assert build_cpus_per_task(2, 0, "auto", None, parse_sinfo(SINFO, None))[0] == 64
    with pytest.raises(
        ConfigError,
        match=r"partition debug's nodes have 2 CPU\(s\) for this job, fewer than its 4 "
        "processes per node",
    ):
        build_cpus_per_task(4, 0, 0, "debug", parse_sinfo(SINFO, "debug"))


def stand_in_sinfo(bin_dir: Path, body: str) -> str:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sinfo").write_text(f'#!/bin/sh\necho "$@" > {bin_dir}/sinfo-args\n{body}\n')
    (bin_dir / "sinfo").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_load_node_kinds(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", stand_in_sinfo(tmp_path / "bin", f"cat <<'EOF'\n{SINFO}EOF"))
    assert load_node_kinds("gpu") == [NodeKind(128, 8), NodeKind(96, 4)]
    assert (tmp_path / "bin" / "sinfo-args").read_text().split() == ["-h", "-o", "%P|%c|%G"]
    monkeypatch.setenv(
        "PATH", stand_in_sinfo(tmp_path / "bin", "echo 'slurm_load_partitions: down' >&2; exit 1")
    )
    assert load_node_kinds("gpu") == []
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert load_node_kinds(None) == []


def test_script_gets_the_default(config, tmp_path, monkeypatch):  # noqa: F811
    """Not given: sinfo's node size in the directive, on srun (22.05 steps do not inherit it) and as
    OMP_NUM_THREADS per worker; with no sinfo, the per-worker default."""
    monkeypatch.setenv("PATH", stand_in_sinfo(tmp_path / "bin", f"cat <<'EOF'\n{SINFO}EOF"))
    cfg = load_config(config)
    settings = SlurmSettings(
        config=str(config),
        nodes=2,
        gpus_per_node=4,
        partition="gpu",
        log_dir=str(tmp_path / "logs"),
    )
    script = render_sbatch(settings, cfg)
    assert directives(script)["--cpus-per-task"] == "64"
    assert srun_tokens(script)[:3] == ["srun", "--ntasks-per-node=1", "--cpus-per-task=64"]
    assert '\nexport OMP_NUM_THREADS="16"\n' in script
    assert (
        "# --cpus-per-task=64: 4 GPU(s)' share of the smallest node of partition gpu (sinfo); "
        "OMP_NUM_THREADS=16 per process" in script
    )
    (tmp_path / "nosinfo").mkdir()
    (tmp_path / "nosinfo" / "bash").symlink_to("/bin/bash")
    monkeypatch.setenv("PATH", str(tmp_path / "nosinfo"))
    script = render_sbatch(
        SlurmSettings(
            config=str(config), nodes=2, procs_per_node=2, log_dir=str(tmp_path / "logs")
        ),
        load_config(config),
    )
    # 2 CPU workers x (1 + 1 for data.num_workers auto, the default)
    assert directives(script)["--cpus-per-task"] == "4"
    assert (
        "# --cpus-per-task=4: 2 CPU worker(s) x 2 CPUs = "
        "max(1, 1 + 1 for data.num_workers auto) each"
    ) in script
    assert '\nexport OMP_NUM_THREADS="2"\n' in script
    settings.cpus_per_task = 12  # the user's value wins over sinfo's
    monkeypatch.setenv("PATH", stand_in_sinfo(tmp_path / "bin", f"cat <<'EOF'\n{SINFO}EOF"))
    script = render_sbatch(settings, cfg)
    assert (
        directives(script)["--cpus-per-task"] == "12" and '\nexport OMP_NUM_THREADS="3"\n' in script
    )
