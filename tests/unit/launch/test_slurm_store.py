"""The store's node of an elastic Slurm job (lockstep/launch/slurm_store.py): which jobs may have one,
the directives of its component and the lines that serve the store. Rendered into a whole script:
tests/unit/launch/test_slurm.py; run on a real three-node Slurm cluster: tests/e2e/test_slurm_cluster.py."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from lockstep.errors import ConfigError
from lockstep.launch.slurm_store import check_store, serve_store, store_component


def test_only_an_elastic_job_has_a_store_node_and_only_the_known_kinds():
    check_store("external", 1, 2)
    check_store("node0", None, 2)
    with pytest.raises(ConfigError, match=r"--rdzv-store external: only an elastic job"):
        check_store("external", None, 2)
    with pytest.raises(ConfigError, match=r"--rdzv-store external: only an elastic job"):
        check_store("external", 2, 2)
    with pytest.raises(ConfigError, match=r"--rdzv-store 'etcd' is not one of node0, external"):
        check_store("etcd", 1, 2)


def test_the_store_component_is_one_task_on_one_cpu_then_hetjob():
    job = ["--job-name=x", "--no-kill"]
    assert store_component(job, "cpu") == [
        *job,
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=1",
        "--partition=cpu",
        "hetjob",
    ]
    assert "--partition" not in " ".join(store_component(job, None))


def test_the_store_is_served_in_the_background_and_stopped_with_the_script(tmp_path):
    """The lines run by bash with a stand-in `python` that waits: the script's exit stops it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/bash\necho "$*" > {tmp_path}/args\nexec sleep 60\n')
    (bin_dir / "python").chmod(0o755)
    script = "\n".join(
        ["LOCKSTEP_HEAD_ADDR=10.0.0.9", *serve_store(29400), "sleep 0.5", "echo $STORE_PID"]
    )
    proc = subprocess.run(
        ["bash", "-c", script],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (
        tmp_path / "args"
    ).read_text() == "-m lockstep rendezvous --host 10.0.0.9 --port 29400\n"
    stat = Path(f"/proc/{proc.stdout.split()[-1]}/stat")
    deadline = time.monotonic() + 10
    # gone, or dead and not yet reaped by whoever adopted it
    while _alive(stat):
        assert time.monotonic() < deadline, "the store outlived the script"
        time.sleep(0.05)


def _alive(stat: Path) -> bool:
    try:
        return stat.read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
