"""`lockstep doctor`: exercise the real job from every rank, say what is wrong and how to fix it.

Every rank runs every probe (`probe_local`, then the collectives, ring, barrier, clock and
filesystem probes); the facts are all-gathered, and every rank turns them into the same checks
with `build_checks`, a pure function a test can feed any cluster. With a training config
(`lockstep doctor --config`), one more check weighs its gradient all-reduce against its compute
(lockstep.doctor.comm_check). Statuses: ok, warn (shown, exit code still 0), fail (exit code 1,
always with a fix line), skip (with the reason).

Thresholds, chosen here: free disk under the output dir warns below 5 GiB and fails below
1 GiB (one checkpoint of a 1B-parameter model with Adam state is ~16 GB; 1 GiB does not hold
even a small run's checkpoints and logs); clock skew warns above 1 s and fails above 60 s
(per-rank logs and progress times stop lining up); barrier latency warns above 50 ms.
The default output dir is `runs`, the parent of `lockstep train`'s default run dir: the doctor
probes the filesystem training will write to, in `runs/.doctor/`, and removes its markers.
"""

from lockstep.doctor.probes import run_doctor
from lockstep.doctor.report import (DEFAULT_OUTPUT_DIR, MiB, DoctorError, Report, build_checks, bus_bandwidth,
                                    format_report, parse_size, span)

__all__ = ["DEFAULT_OUTPUT_DIR", "DoctorError", "MiB", "Report", "build_checks", "bus_bandwidth", "format_report",
           "parse_size", "run_doctor", "span"]
