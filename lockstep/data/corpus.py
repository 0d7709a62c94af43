"""The text corpus: data.path's files (a file, a folder, a glob), or the embedded default (this Python's
standard library sources), read in a fixed order, and a BPE tokenizer trained on them."""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

from lockstep.data.tokenizer import BPETokenizer, build_bpe_from_texts
from lockstep.errors import DataError

SEPARATOR = b"\n\n"  # between files
_SNIFF_BYTES = 8192  # a NUL in this many leading bytes marks a file as binary
# skipped when walking a folder, and in the default corpus: generated, vendored or test code
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "test", "tests", "idle_test"}


def default_corpus_files() -> list[Path]:
    """The embedded default corpus: this Python's standard library `.py` sources.

    Present on every machine with Python, no download. Sorted by path relative to the stdlib
    root; `site-packages`, `dist-packages`, test folders and `__pycache__` are left out, so the
    list depends only on the Python installation, not on what else is installed.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    files = [f for f in files if f.is_file()]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _is_text(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return b"\0" not in fh.read(_SNIFF_BYTES)
    except OSError:
        return False


def resolve_corpus(path: str | None) -> list[Path]:
    """The corpus files for `data.path`, sorted.

    None -> `default_corpus_files()`; a file; a folder (recursive; hidden entries, `__pycache__`
    and binary files, i.e. with a NUL byte in the first 8 KiB, are skipped); or a glob pattern
    (`**` recurses; binary matches are skipped).
    """
    if path is None:
        files = default_corpus_files()
        if not files:
            raise DataError(
                f"the embedded default corpus (Python's stdlib at {sysconfig.get_paths()['stdlib']!r}) has no .py "
                "files on this machine; pass --data with a file, folder or glob of text"
            )
        return files
    if any(c in path for c in "*?["):
        matches = [Path(p) for p in glob.glob(path, recursive=True)]
        files = [p for p in matches if p.is_file() and _is_text(p)]
        if not files:
            what = f"only binary files or folders ({len(matches)})" if matches else "no files"
            raise DataError(
                f"data.path {path!r} matched {what}; pass a glob that matches text files"
            )
    else:
        p = Path(path)
        if not p.exists():
            raise DataError(
                f"data.path {path!r} does not exist; pass a file, folder or glob of text, "
                "or omit --data to use the embedded default corpus"
            )
        if p.is_dir():
            files = []
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
                files.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
            files = [f for f in files if f.is_file() and _is_text(f)]
            if not files:
                raise DataError(
                    f"data.path {path!r} is a folder with no text files; put .txt (or other text) files in it"
                )
        else:
            if not _is_text(p):
                raise DataError(
                    f"data.path {path!r} is a binary file (NUL bytes); pass a text file"
                )
            files = [p]
    files = sorted({Path(os.path.abspath(f)) for f in files}, key=str)
    if all(f.stat().st_size == 0 for f in files):
        raise DataError(f"data.path {path!r}: all {len(files)} file(s) are empty; add text to them")
    return files


def files_read(files: list[Path], max_bytes: int | None) -> list[tuple[Path, os.stat_result]]:
    """The files whose bytes make it under the cap, with their stat (sizes tell where the cut falls)."""
    out, total = [], 0
    for f in files:
        st = f.stat()
        if st.st_size == 0:
            continue
        if max_bytes is not None and total >= max_bytes:
            break
        out.append((f, st))
        total += st.st_size + len(SEPARATOR)
    return out


def read_corpus(files: list[Path], max_bytes: int | None) -> bytes:
    """Non-empty files in order, joined by a blank line, truncated at max_bytes total."""
    parts, total = [], 0
    for f, _ in files_read(files, max_bytes):
        if parts:
            parts.append(SEPARATOR)
            total += len(SEPARATOR)
        data = f.read_bytes()
        parts.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(parts)
    return blob if max_bytes is None else blob[:max_bytes]


def corpus_chunks(text: str, chunk_chars: int = 1 << 16) -> list[str]:
    """Cut text at line ends into ~chunk_chars pieces, so BPE can train/encode them in parallel.

    Cutting right after a newline matches where the byte-level pre-tokenizer splits anyway,
    so the ids equal those of encoding the whole text at once (up to whitespace runs that
    straddle a cut).
    """
    chunks, start = [], 0
    while start < len(text):
        end = min(start + chunk_chars, len(text))
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl >= start else end
        chunks.append(text[start:end])
        start = end
    return chunks


def train_bpe(files: list[Path], vocab_size: int, max_bytes: int | None) -> BPETokenizer:
    """Train on the corpus text: files in the given order, joined by a blank line, capped at max_bytes."""
    text = read_corpus(files, max_bytes).decode("utf-8", errors="replace")
    return build_bpe_from_texts(corpus_chunks(text), vocab_size)
