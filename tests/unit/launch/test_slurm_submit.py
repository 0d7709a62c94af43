"""lockstep/launch/slurm_submit.py with a stand-in sbatch and sinfo on PATH: an unknown partition refused
with the cluster's own, the script and its log directory written, the job id read back; sbatch's refusal
reported as it said it."""

from __future__ import annotations

import os

import pytest

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.launch.slurm import SlurmSettings, render_sbatch
from lockstep.launch.slurm_submit import SubmitError, submit_sbatch

from .test_slurm import config  # noqa: F401  (the fixture, written once)


def test_unknown_partition_and_submission(config, tmp_path, monkeypatch):  # noqa: F811
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text('#!/bin/sh\nprintf "debug*\\ngpu\\ngpu\\n"\n')
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/sbatch-args\necho "777;cluster"\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    settings = SlurmSettings(
        config=str(config), nodes=2, partition="gpux", log_dir=str(tmp_path / "logs")
    )
    script = render_sbatch(settings, load_config(config))
    with pytest.raises(
        ConfigError, match=r"partition 'gpux' is not one of this cluster's partitions: debug, gpu;"
    ):
        submit_sbatch(settings, script)
    settings.partition = "debug"
    job_id, log = submit_sbatch(settings, script)
    assert job_id == "777" and log == tmp_path / "logs" / "lockstep-777.out"
    assert (tmp_path / "sbatch-args").read_text().split() == [
        "--parsable",
        str(tmp_path / "logs" / "lockstep.sbatch"),
    ]


def test_sbatch_refusal_is_reported(config, tmp_path, monkeypatch):  # noqa: F811
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\necho 'sbatch: error: Invalid account' >&2\nexit 1\n"
    )
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    settings = SlurmSettings(config=str(config), log_dir=str(tmp_path / "logs"))
    with pytest.raises(SubmitError, match="Invalid account"):
        submit_sbatch(settings, render_sbatch(settings, load_config(config)))
