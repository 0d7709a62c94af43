"""lockstep.tools.split on real files of every format: disjoint parts that cover the input, reproducible, the errors."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import run_main

from lockstep.errors import DataError
from lockstep.tools.split import split_dataset


def _snapshot(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "split.json"
    }


def _check_sizes(counts: list[int], total: int, parts: int) -> None:
    assert len(counts) == parts and sum(counts) == total
    assert max(counts) - min(counts) <= 1


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"id": i, "text": f"record {i}"}) for i in range(23)]
    # a blank line, no final newline
    path.write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]))
    return path


def test_jsonl_parts_are_disjoint_cover_and_near_equal(jsonl, tmp_path):
    parts = split_dataset(jsonl, 3, tmp_path / "out", seed=1)
    assert [p.name for p in parts] == [f"part-0000{i}-of-00003.jsonl" for i in range(3)]
    got = [p.read_text().splitlines() for p in parts]
    want = [line for line in jsonl.read_text().splitlines() if line.strip()]
    # disjoint + cover: multisets equal
    assert Counter(line for part in got for line in part) == Counter(want)
    _check_sizes([len(g) for g in got], 23, 3)
    info = json.loads((tmp_path / "out" / "split.json").read_text())
    assert info["counts"] == [len(g) for g in got] and info["seed"] == 1 and info["items"] == 23
    assert info["source"] == str(jsonl.resolve())
    for g in got:  # each part keeps the input's order
        assert g == sorted(g, key=want.index)


def test_same_seed_same_bytes_other_seed_other_assignment(jsonl, tmp_path):
    split_dataset(jsonl, 2, tmp_path / "a", seed=7)
    split_dataset(jsonl, 2, tmp_path / "b", seed=7)
    split_dataset(jsonl, 2, tmp_path / "c", seed=8)
    assert _snapshot(tmp_path / "a") == _snapshot(tmp_path / "b")
    assert _snapshot(tmp_path / "a") != _snapshot(tmp_path / "c")


def test_csv_header_in_every_part_and_quoted_newlines(tmp_path):
    path = tmp_path / "rows.csv"
    rows = [["id", "text"]] + [
        [str(i), f"line one\nline two {i}" if i % 3 == 0 else f"t{i}"] for i in range(11)
    ]
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    path.write_text(buf.getvalue(), newline="")
    parts = split_dataset(path, 4, tmp_path / "out")
    read = [list(csv.reader(io.StringIO(p.read_bytes().decode(), newline=""))) for p in parts]
    assert all(r[0] == ["id", "text"] for r in read)
    body = [row for r in read for row in r[1:]]
    assert Counter(map(tuple, body)) == Counter(map(tuple, rows[1:]))
    _check_sizes([len(r) - 1 for r in read], 11, 4)


def test_tsv_rows(tmp_path):
    path = tmp_path / "rows.tsv"
    path.write_text("a\tb\n" + "".join(f"{i}\tx{i}\n" for i in range(5)))
    parts = split_dataset(path, 2, tmp_path / "out")
    lines = [p.read_text().splitlines() for p in parts]
    assert all(part[0] == "a\tb" for part in lines)
    assert sorted(line for part in lines for line in part[1:]) == [f"{i}\tx{i}" for i in range(5)]


def test_text_file_by_documents(tmp_path):
    docs = [f"document {i}\nsecond line {i}" for i in range(9)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n\n".join(docs) + "\n")
    parts = split_dataset(path, 2, tmp_path / "out", seed=3)
    assert [p.suffix for p in parts] == [".txt", ".txt"]
    got = [p.read_text().strip().split("\n\n") for p in parts]
    assert Counter(d for part in got for d in part) == Counter(docs)
    _check_sizes([len(g) for g in got], 9, 2)


def test_text_folder_by_file_keeps_relative_paths(tmp_path):
    src = tmp_path / "src"
    for i in range(7):
        (src / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 2}" / f"f{i}.txt").write_text(f"text {i}\n")
    (src / ".hidden").write_text("skipped")
    parts = split_dataset(src, 3, tmp_path / "out", seed=5)
    assert [p.name for p in parts] == [f"part-0000{i}-of-00003" for i in range(3)] and all(
        p.is_dir() for p in parts
    )
    files = [sorted(str(f.relative_to(p)) for f in p.rglob("*") if f.is_file()) for p in parts]
    assert Counter(f for part in files for f in part) == Counter(
        f"d{i % 2}/f{i}.txt" for i in range(7)
    )
    _check_sizes([len(f) for f in files], 7, 3)
    for p, names in zip(parts, files):
        assert all((p / n).read_text() == (src / n).read_text() for n in names)
    # a glob names the same files
    parts = split_dataset(str(src / "**" / "*.txt"), 3, tmp_path / "glob", seed=5)
    assert _snapshot(tmp_path / "glob") == _snapshot(tmp_path / "out")


def _table(n: int, start: int = 0):
    pa = pytest.importorskip("pyarrow")
    schema = pa.schema(
        [("id", pa.int64()), ("text", pa.string()), ("score", pa.float32())],
        metadata={b"origin": b"test"},
    )
    return pa.table(
        {
            "id": list(range(start, start + n)),
            "text": [f"t{i}" for i in range(start, start + n)],
            "score": [i / 2 for i in range(start, start + n)],
        },
        schema=schema,
    )


def test_parquet_rows_keep_schema_and_folder_is_one_table(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "src").mkdir()
    pq.write_table(_table(6), tmp_path / "src" / "a.parquet")
    pq.write_table(_table(7, start=6), tmp_path / "src" / "b.parquet")
    parts = split_dataset(tmp_path / "src", 4, tmp_path / "out", seed=2)
    assert [p.name for p in parts] == [f"part-0000{i}-of-00004.parquet" for i in range(4)]
    tables = [pq.read_table(p) for p in parts]
    assert all(t.schema.equals(_table(1).schema, check_metadata=True) for t in tables)
    ids = [i for t in tables for i in t.column("id").to_pylist()]
    assert sorted(ids) == list(range(13))
    _check_sizes([t.num_rows for t in tables], 13, 4)
    split_dataset(tmp_path / "src", 4, tmp_path / "again", seed=2)
    assert _snapshot(tmp_path / "out") == _snapshot(tmp_path / "again")
    # a single parquet file splits by rows too
    parts = split_dataset(tmp_path / "src" / "b.parquet", 2, tmp_path / "one")
    assert sorted(i for p in parts for i in pq.read_table(p).column("id").to_pylist()) == list(
        range(6, 13)
    )


def test_errors_name_value_rule_and_fix(jsonl, tmp_path):
    with pytest.raises(DataError, match=r"--parts 0 must be an integer >= 1"):
        split_dataset(jsonl, 0, tmp_path / "o")
    with pytest.raises(DataError, match=r"--parts -2 must be"):
        split_dataset(jsonl, -2, tmp_path / "o")
    with pytest.raises(
        DataError, match=r"--parts 24 is more than the 23 records .* pass --parts 23 or fewer"
    ):
        split_dataset(jsonl, 24, tmp_path / "o")
    assert not (tmp_path / "o").exists()  # refused before writing anything
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 10)
    with pytest.raises(
        DataError, match=r"unknown format .* supported: .*\.jsonl.*\.csv.*\.parquet"
    ):
        split_dataset(tmp_path / "blob.bin", 2, tmp_path / "o")
    (tmp_path / "doc.json").write_text('[{"a": 1}]')
    with pytest.raises(DataError, match=r"convert it to \.jsonl"):
        split_dataset(tmp_path / "doc.json", 2, tmp_path / "o")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"holds no records"):
        split_dataset(tmp_path / "empty.jsonl", 2, tmp_path / "o")
    (tmp_path / "header.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"holds no rows below the header"):
        split_dataset(tmp_path / "header.csv", 2, tmp_path / "o")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=r"holds no files"):
        split_dataset(tmp_path / "empty_dir", 2, tmp_path / "o")
    with pytest.raises(DataError, match=r"does not exist"):
        split_dataset(tmp_path / "missing.jsonl", 2, tmp_path / "o")


def test_non_empty_out_dir_needs_force(jsonl, tmp_path):
    out = tmp_path / "out"
    split_dataset(jsonl, 3, out)
    with pytest.raises(DataError, match=r"is not empty .* --force"):
        split_dataset(jsonl, 2, out)
    (out / "notes.txt").write_text("mine")
    parts = split_dataset(jsonl, 2, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(p.name for p in parts), "split.json", "notes.txt"]
    )


def test_broken_jsonl_line_stops_the_split_before_any_part(tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    good = [json.dumps({"id": i, "text": f"record {i}"}) for i in range(6)]
    path.write_text(
        "\n".join(good[:2]) + "\n\n" + '{"id": 2, "text": "cut off\n' + "\n".join(good[2:]) + "\n"
    )
    code, _, err = run_main(capsys, "split", str(path), "--parts", "2", "-o", str(tmp_path / "out"))
    assert code == 1 and "Traceback" not in err, err
    assert err.strip() == (
        f"lockstep split: error: {path}:4: not valid JSON (Unterminated string starting at column 19: "
        '\'{"id": 2, "text": "cut off\'); each line of a .jsonl file is one JSON value: fix or delete line 4, '
        "then split again"
    )
    assert not (tmp_path / "out").exists()
    path.write_text("\n".join(good) + '\n{"id": 6, "te')  # a file cut mid-record
    with pytest.raises(DataError, match=rf"{path}:7: not valid JSON"):
        split_dataset(path, 2, tmp_path / "out")
    path.write_bytes(b'{"id": 0}\n{"id": "\xff"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not UTF-8 \(byte 0xff at column 9\)"):
        split_dataset(path, 2, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_malformed_csv_rows_stop_the_split(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('id,text\n1,ok\n2,"never closed\n3,swallowed\n4,also swallowed\n')
    with pytest.raises(
        DataError,
        match=rf"{path}:3: malformed CSV row \(the quote opened on this line is never "
        r"closed: '2,\"never closed'\); fix the quoting of line 3",
    ):
        split_dataset(path, 2, tmp_path / "out")
    path.write_text("id,text\n1,ok\n\n2,one,two\n")
    with pytest.raises(
        DataError, match=rf"{path}:4: row has 3 fields but the header \(line 1\) has 2: '2,one,two'"
    ):
        split_dataset(path, 2, tmp_path / "out")
    tsv = tmp_path / "rows.tsv"
    tsv.write_text("a\tb\n1\tx\n2\n")
    with pytest.raises(
        DataError, match=rf"{tsv}:3: row has 1 fields but the header \(line 1\) has 2"
    ):
        split_dataset(tsv, 2, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unreadable_parquet_stops_the_split(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "src").mkdir()
    pq.write_table(_table(6), tmp_path / "src" / "a.parquet")
    data = (tmp_path / "src" / "a.parquet").read_bytes()
    # a copy that stopped halfway
    (tmp_path / "src" / "b.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        DataError,
        match=r"b.parquet' is not a readable parquet file \(.+\); replace it with a "
        r"complete copy",
    ):
        split_dataset(tmp_path / "src", 2, tmp_path / "out")
    assert not (tmp_path / "out").exists()
