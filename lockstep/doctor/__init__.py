"""`lockstep doctor`: exercise the real job from every rank, say what is wrong and how to fix it.

Every rank runs every probe (`probe_local` with its device's facts, the matmul peak, then the
collectives, ring, barrier, clock and filesystem probes); the facts are all-gathered, and every rank
turns them into the same checks with `build_checks`, a pure function a test can feed any cluster.
At world size 1 on a GPU, a 1-rank NCCL group runs the all-reduce checks (lockstep.doctor.device).
With a training config (`lockstep doctor --config`), one more check weighs its gradient all-reduce
against its compute (lockstep.doctor.comm_check). Statuses: ok, warn (shown, exit code still 0),
fail (exit code 1, always with a fix line), skip (with the reason).

    report      Check, Report, the printed table
    checks      the verdicts on the cluster: process group, devices, versions, collectives, env
    device      each rank's device facts and matmul peak, and their rows; the 1-rank group
    filesystem  the output dir: written, shared, free space
    probes      join the group, run every probe, gather, build the report
    comm_check  --config: the gradient all-reduce against the compute

The thresholds are in the module of each check, with their reasons. The default output dir is
`runs`, the parent of `lockstep train`'s default run dir: the doctor probes the filesystem training
will write to, in `runs/.doctor/`, and removes its markers.
"""

from lockstep.doctor.checks import build_checks
from lockstep.doctor.probes import run_doctor
from lockstep.doctor.report import (
    DEFAULT_OUTPUT_DIR,
    DoctorError,
    MiB,
    Report,
    bus_bandwidth,
    format_report,
    parse_size,
    span,
)

__all__ = [
    "DEFAULT_OUTPUT_DIR",
    "DoctorError",
    "MiB",
    "Report",
    "build_checks",
    "bus_bandwidth",
    "format_report",
    "parse_size",
    "run_doctor",
    "span",
]
