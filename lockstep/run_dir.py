"""The run directory (checkpoint.output_dir) must be writable: every rank logs there, rank 0 writes metrics and checkpoints.

A directory that cannot be written (a read-only mount, a full disk, no permission) stops the run with
the directory, the reason and the fix, before any worker starts and again at a worker's first write,
instead of an OSError traceback from deep inside logging or a checkpoint save.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from lockstep.errors import ConfigError

_ELSEWHERE = "or pass another --output-dir (checkpoint.output_dir)"
_FIXES = {
    errno.EROFS: f"its filesystem is mounted read-only: remount it read-write, {_ELSEWHERE}",
    errno.ENOSPC: f"the disk is full: free space there, {_ELSEWHERE}",
    errno.EDQUOT: f"the disk quota is used up: free space there, {_ELSEWHERE}",
    errno.EACCES: f"this user may not write there: change its permissions, {_ELSEWHERE}",
    errno.EPERM: f"this user may not write there: change its permissions, {_ELSEWHERE}",
}


def unwritable_fix(error: OSError) -> str | None:
    """What to do about a failed write, when the error is one a user can fix (read-only, full, no permission)."""
    return _FIXES.get(error.errno)


def unwritable_error(run_dir, error: OSError) -> ConfigError:
    fix = unwritable_fix(error) or f"check that the directory can be written, {_ELSEWHERE}"
    where = f" ({error.filename})" if error.filename and str(error.filename) != str(run_dir) else ""
    return ConfigError(
        f"run directory {run_dir} cannot be written: {error.strerror or error}{where}; a run writes "
        f"its logs, metrics and checkpoints there (a resume too); {fix}"
    )


def check_run_dir_writable(run_dir) -> None:
    """Create the run dir (and its parents) and a file in it, removed again; ConfigError when that fails."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".lockstep-write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise unwritable_error(path, e) from None
