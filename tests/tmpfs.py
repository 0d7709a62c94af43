"""A real tmpfs mount that a test can turn read-only (helper, no tests).

We run as root, and root ignores permissions: a directory that cannot be written is a read-only mount.
Where this machine lets us mount none, the test is skipped with the reason.
"""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(mnt: Path, options: str = "size=64m"):
    """A fresh tmpfs at `mnt` (created), writable until read_only(mnt); unmounted afterwards."""
    mnt.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}); a read-only directory "
            "needs a read-only mount, since root writes into chmod-protected ones"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def read_only(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True)
    with pytest.raises(OSError, match="Read-only file system"):
        (mnt / "probe").write_text("x")
