"""Split a dataset into N disjoint parts: `lockstep split DATA --parts N -o OUT_DIR [--seed S]`.

For training independent copies of a model, one per part, and averaging them with `lockstep merge`.
What an item is depends on DATA:

    a folder or glob       its files (hidden entries and __pycache__ skipped); each part is a folder
                           OUT_DIR/part-0000i-of-0000N/ holding its files at their relative paths.
                           A folder or glob of .parquet files only is one table instead (rows, below).
    .jsonl / .ndjson       non-blank lines                  -> OUT_DIR/part-0000i-of-0000N.jsonl
    .csv / .tsv            rows (quoted newlines allowed), the header repeated in every part
    .parquet               rows, read with pyarrow; every part keeps the schema (and its metadata)
    any other text file    documents: runs of non-blank lines, separated by blank lines; a part joins
                           its documents with one blank line

Items are assigned by a seeded permutation (numpy's default_rng(seed)) cut into N contiguous parts
whose sizes differ by at most 1; each part keeps the input's order. The same input, seed and numpy
give byte-identical parts; the parts are disjoint and together hold every item exactly once (blank
lines between JSONL records, CSV rows or documents are not items and are not kept). OUT_DIR/split.json
records the source, seed and counts. A .jsonl line that is not JSON, a CSV row whose quote never closes
or whose field count differs from the header's, or an unreadable parquet file stops the split, naming the
file and line, before anything is written. (Split by file, files are copied as they are, unchecked.)

Relative paths inside records (an audio manifest's audio column) resolve against the part's folder:
give the manifest absolute paths first, or write OUT_DIR where the same relative paths hold.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from lockstep.errors import DataError

_LINES, _ROWS, _TABLE = (".jsonl", ".ndjson"), (".csv", ".tsv"), (".parquet",)
SUPPORTED = (
    "a folder or glob of files (split by file; .parquet only: by row), .jsonl/.ndjson (lines), "
    ".csv/.tsv (rows), .parquet (rows), any other text file (blank-line-separated documents)"
)
_SNIFF_BYTES = 8192


def part_name(i: int, parts: int) -> str:
    return f"part-{i:05d}-of-{parts:05d}"


def assign_parts(n: int, parts: int, seed: int) -> list[np.ndarray]:
    """Item indices of each part: a seeded permutation cut into near-equal contiguous runs, each sorted."""
    order = np.random.default_rng(seed).permutation(n)
    # sizes n // parts or n // parts + 1
    return [np.sort(chunk) for chunk in np.array_split(order, parts)]


@dataclass
class _Items:
    """What a source splits into: `n` items, and how to write the ones with given indices as part i."""

    n: int
    what: str  # for messages: "rows", "files", ...
    kind: str  # for split.json
    write: Callable[[np.ndarray, str, Path], Path]  # (indices, part name, out dir) -> path written


def split_dataset(
    path: str | Path, parts: int, out_dir: str | Path, seed: int = 0, force: bool = False
) -> list[Path]:
    """Write DATA's items into `parts` disjoint parts under out_dir (see the module doc); return their paths."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise DataError(
            f"--parts {parts!r} must be an integer >= 1; pass how many parts (copies to train) you want"
        )
    source, out = str(path), Path(out_dir)
    files, base = _list_files(source)
    if files is None:
        items = _read_single(Path(source))
    elif all(f.suffix.lower() in _TABLE for f in files):
        items = _read_parquet(files)
    else:
        items = _file_items(files, base)
    if items.n == 0:
        raise DataError(
            f"{source!r} holds no {items.what}, so there is nothing to split; point it at your data"
        )
    if parts > items.n:
        raise DataError(
            f"--parts {parts} is more than the {items.n} {items.what} in {source!r}; every part needs at "
            f"least one: pass --parts {items.n} or fewer"
        )
    _prepare_out(out, force, base)  # only now: a refused split leaves OUT_DIR as it was
    chunks = assign_parts(items.n, parts, seed)
    written = [items.write(idx, part_name(i, parts), out) for i, idx in enumerate(chunks)]
    info = {
        "source": os.path.abspath(source),
        "format": items.kind,
        "seed": seed,
        "parts": parts,
        "items": items.n,
        "counts": [len(idx) for idx in chunks],
        "files": [p.name for p in written],
        "order": "numpy.random.default_rng(seed).permutation(items), cut into contiguous parts, each sorted",
    }
    (out / "split.json").write_text(json.dumps(info, indent=2) + "\n")
    return written


def _list_files(source: str) -> tuple[list[Path] | None, Path | None]:
    """(files, the folder their relative paths start at) for a folder or glob; (None, None) for one file."""
    p = Path(source)
    if p.is_file():
        return None, None
    if p.is_dir():
        base, found = (
            p,
            [
                Path(d) / f
                for d, dirs, names in os.walk(p)
                for f in names
                if not _hidden(Path(d).relative_to(p) / f)
            ],
        )
    elif any(ch in source for ch in "*?["):
        found = [Path(os.path.abspath(m)) for m in glob.glob(source, recursive=True)]
        base = Path(os.path.commonpath([f.parent for f in found])) if found else None
        found = [f for f in found if not _hidden(f.relative_to(base))]
    else:
        raise DataError(
            f"{source!r} does not exist; pass a data file, a folder or a glob ({SUPPORTED})"
        )
    files = (
        sorted((f for f in found if f.is_file()), key=lambda f: f.relative_to(base).as_posix())
        if found
        else []
    )
    if not files:
        raise DataError(
            f"{source!r} holds no files (hidden ones are skipped), so there is nothing to split; "
            "point it at your data"
        )
    return files, base


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") or part == "__pycache__" for part in rel.parts)


def _prepare_out(out: Path, force: bool, base: Path | None) -> None:
    if base is not None and out.resolve().is_relative_to(base.resolve()):
        raise DataError(
            f"output {out} is inside the input folder {base}; its parts would become input next time: "
            "pass an OUT_DIR outside it"
        )
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} is a file; pass a directory path for OUT_DIR")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            shown = ", ".join(sorted(p.name for p in out.iterdir())[:5])
            raise DataError(
                f"output {out} is not empty ({shown}); pass an empty or new OUT_DIR, or --force to replace "
                "earlier parts there"
            )
        for old in out.iterdir():  # only what an earlier split wrote
            if old.name.startswith("part-") or old.name == "split.json":
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _file_items(files: list[Path], base: Path) -> _Items:
    def write(idx: np.ndarray, name: str, out: Path) -> Path:
        for j in idx:
            dest = out / name / files[j].relative_to(base)
            dest.parent.mkdir(parents=True, exist_ok=True)
            # contents only: a part does not depend on mtimes or modes
            shutil.copyfile(files[j], dest)
        return out / name

    return _Items(len(files), "files", "files", write)


def _byte_items(
    items: list[bytes],
    what: str,
    kind: str,
    ext: str,
    header: bytes = b"",
    join: bytes = b"",
    end: bytes = b"",
) -> _Items:
    def write(idx: np.ndarray, name: str, out: Path) -> Path:
        file = out / f"{name}{ext}"
        file.write_bytes(header + join.join(items[j] for j in idx) + end)
        return file

    return _Items(len(items), what, kind, write)


def _read_single(file: Path) -> _Items:
    suffix = file.suffix.lower()
    if suffix in _TABLE:
        return _read_parquet([file])
    data = file.read_bytes()
    if suffix in _LINES:
        return _byte_items(_json_lines(file, data), "records (non-blank lines)", "jsonl", ".jsonl")
    if suffix in _ROWS:
        header, rows = _csv_rows(file, data, "\t" if suffix == ".tsv" else ",")
        return _byte_items(rows, "rows below the header", suffix[1:], suffix, header=header)
    binary = b"\0" in data[:_SNIFF_BYTES]
    if binary or suffix == ".json":
        what = (
            "a binary file"
            if binary
            else "one JSON document, not one record per line (convert it to .jsonl)"
        )
        raise DataError(
            f"{str(file)!r} is {what}: an unknown format to split; supported: {SUPPORTED}"
        )
    return _byte_items(
        _documents(data),
        "documents (blank-line-separated)",
        "text",
        file.suffix,
        join=b"\n\n",
        end=b"\n",
    )


def _json_lines(file: Path, data: bytes) -> list[bytes]:
    """The non-blank lines, each one JSON value: a broken line would otherwise reach a part unnoticed and fail
    (or be skipped) only when that part is trained on."""
    records = []
    for number, line in enumerate(data.splitlines(keepends=True), 1):
        if not line.strip():
            continue
        try:
            json.loads(line.rstrip(b"\r\n"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"{file}:{number}: not UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start + 1}); "
                f"JSON Lines are UTF-8 text: re-encode the file, or fix or delete line {number}, then "
                "split again"
            ) from None
        except json.JSONDecodeError as e:
            problem = e.msg.removesuffix(" at")  # json's "Invalid control character at", ...
            raise DataError(
                f"{file}:{number}: not valid JSON ({problem} at column {e.colno}: {_excerpt(line)}); "
                f"each line of a .jsonl file is one JSON value: fix or delete line {number}, then split "
                "again"
            ) from None
        records.append(line if line.endswith(b"\n") else line + b"\n")
    return records


def _excerpt(line: bytes | str, limit: int = 60) -> str:
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    text = text.rstrip("\r\n")
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _csv_rows(file: Path, data: bytes, delimiter: str) -> tuple[bytes, list[bytes]]:
    """(header, rows) as their exact bytes; a row may span lines inside quotes. Blank lines are dropped.

    Strict, as pyarrow's reader (lockstep's audio manifests) is: a quote left open would otherwise swallow
    every later line into one field, and a row with more or fewer fields than the header would shift columns.
    """
    # csv needs str; this round-trips any bytes
    text = data.decode("utf-8", errors="surrogateescape")
    lines = io.StringIO(text, newline="").readlines()
    consumed: list[str] = []

    def feed():
        for line in lines:
            consumed.append(line)
            yield line

    kind = "TSV" if delimiter == "\t" else "CSV"
    # start: the line the current record begins on
    records, fields, header_line, start = ([], 0, 1, 1)
    # pulls only the lines of one record at a time
    reader = csv.reader(feed(), delimiter=delimiter, strict=True)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            what = (
                "the quote opened on this line is never closed"
                if "unexpected end of data" in str(e)
                else str(e)
            )
            raise DataError(
                f"{file}:{start}: malformed {kind} row ({what}: "
                f"{_excerpt(consumed[0] if consumed else '')}); fix the quoting of line {start} (a quote "
                "inside a quoted field is written twice), then split again"
            ) from None
        raw = "".join(consumed)
        row_start, start = start, start + len(consumed)
        consumed.clear()
        if not row:
            continue
        if not records:
            fields, header_line = len(row), row_start
        elif len(row) != fields:
            raise DataError(
                f"{file}:{row_start}: row has {len(row)} fields but the header (line {header_line}) has "
                f"{fields}: {_excerpt(raw)}; fix that row (quote fields that hold the delimiter), then "
                "split again"
            )
        raw = raw if raw.endswith(("\n", "\r")) else raw + "\n"
        records.append(raw.encode("utf-8", errors="surrogateescape"))
    return (records[0], records[1:]) if records else (b"", [])


def _documents(data: bytes) -> list[bytes]:
    """Runs of non-blank lines, each joined with \\n (a blank line ends a document)."""
    docs, current = [], []
    for line in data.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            docs.append(b"\n".join(current))
            current = []
    if current:
        docs.append(b"\n".join(current))
    return docs


def _read_parquet(files: list[Path]) -> _Items:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(
            f"splitting parquet needs pyarrow ({e}); install it: pip install 'lockstep[audio]'"
        ) from None
    tables = []
    for f in files:
        try:
            tables.append(pq.read_table(f))
        except (pa.ArrowException, OSError) as e:  # truncated, not parquet at all, ...
            raise DataError(
                f"{str(f)!r} is not a readable parquet file ({str(e).strip().splitlines()[0]}); "
                "replace it with a complete copy, or remove it from the input, then split again"
            ) from None
    for f, t in zip(files[1:], tables[1:]):
        if not t.schema.equals(tables[0].schema, check_metadata=False):
            raise DataError(
                f"{str(f)!r} has another schema than {str(files[0])!r} ({t.schema} vs {tables[0].schema}); "
                "a folder of parquet files is split as one table: give them one schema, or split them "
                "one at a time"
            )
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]

    def write(idx: np.ndarray, name: str, out: Path) -> Path:
        file = out / f"{name}.parquet"
        pq.write_table(table.take(pa.array(idx, type=pa.int64())), file)
        return file

    return _Items(table.num_rows, "rows", "parquet", write)
