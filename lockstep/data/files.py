"""Which files a data path names: one file, a folder (sorted), or a glob; optionally only the first N."""

from __future__ import annotations

import glob
from pathlib import Path

from lockstep.errors import DataError


def list_data_files(
    path: str, suffixes: tuple[str, ...], max_files: int | None = None, what: str = "data"
) -> list[Path]:
    """The files `path` names whose suffix is in `suffixes`, in sorted order, cut to `max_files`.

    Sorted so every rank and every run sees the same list (and `max_files` the same subset).
    """
    p = Path(path)
    want = ", ".join(suffixes)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
        if not files:
            raise DataError(
                f"data.path {path!r} is a folder without {what} files ({want}); "
                f"put {want} files in it or point data.path at one"
            )
    elif any(ch in path for ch in "*?["):
        files = sorted(Path(m) for m in glob.glob(path, recursive=True) if Path(m).is_file())
        if not files:
            raise DataError(
                f"data.path {path!r} matched no files; pass a glob that matches {what} files ({want})"
            )
    else:
        raise DataError(
            f"data.path {path!r} does not exist; pass a {what} file ({want}), a folder or a glob"
        )
    if max_files is not None:
        if max_files < 1:
            raise DataError(
                f"data.max_files = {max_files} must be >= 1 (or unset to use all {len(files)} files)"
            )
        files = files[:max_files]
    return files
