"""Submitting a rendered sbatch script (lockstep.launch.slurm renders and checks it): the partition checked with
sinfo where it is installed, the log directory made (sbatch does not make it: the job would fail with no log),
and sbatch's refusal reported as it said it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from lockstep.errors import ConfigError
from lockstep.launch.slurm import SlurmSettings


class SubmitError(RuntimeError):
    """sbatch is missing or refused the script; the message says what to do."""


def check_partition(partition: str | None) -> None:
    """When `sinfo` is here, the partition must be one of the cluster's."""
    if partition is None or not shutil.which("sinfo"):
        return
    proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise SubmitError(f"sinfo failed ({proc.stderr.strip()}); is slurmctld reachable?")
    valid = sorted({p.strip().rstrip("*") for p in proc.stdout.split() if p.strip()})
    if partition not in valid:
        raise ConfigError(
            f"partition {partition!r} is not one of this cluster's partitions: {', '.join(valid)}; "
            "pick one with --partition (or omit it for the default)"
        )


def submit_sbatch(s: SlurmSettings, script: str) -> tuple[str, Path]:
    """Submit the rendered script; returns (job id, log path)."""
    if not shutil.which("sbatch"):
        raise SubmitError("sbatch not found; use --dry-run to print the script")
    check_partition(s.partition)
    log_dir = Path(s.log_dir).resolve()
    # sbatch does not create it: the job would fail with no log at all
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{s.job_name}.sbatch"
    path.write_text(script)
    proc = subprocess.run(
        ["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60
    )
    if proc.returncode:
        raise SubmitError(f"sbatch refused {path}: {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;cluster"
    return job_id, log_dir / f"{s.job_name}-{job_id}.out"
