"""Which files a data path names: one file, a folder, a glob; sorted, cut to max_files (lockstep/data/files.py)."""

from __future__ import annotations

import pytest

from lockstep.data.files import list_data_files
from lockstep.errors import DataError

SUFFIXES = (".jsonl", ".json")


@pytest.fixture
def folder(tmp_path):
    """b.jsonl, a.JSON, sub/c.jsonl and a notes.txt the suffixes leave out."""
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    for name in ("b.jsonl", "a.JSON", "sub/c.jsonl", "notes.txt"):
        (root / name).write_text("{}\n")
    return root


def test_a_file_a_folder_and_a_glob(folder):
    # named: taken as it is
    assert list_data_files(str(folder / "notes.txt"), SUFFIXES) == [folder / "notes.txt"]
    # a folder: every file below it with a listed suffix (any case), in sorted order
    assert list_data_files(str(folder), SUFFIXES) == [
        folder / "a.JSON",
        folder / "b.jsonl",
        folder / "sub" / "c.jsonl",
    ]
    assert list_data_files(str(folder / "**" / "*.jsonl"), SUFFIXES) == [
        folder / "b.jsonl",
        folder / "sub" / "c.jsonl",
    ]
    # a glob is taken as written
    assert list_data_files(str(folder / "*.txt"), SUFFIXES) == [folder / "notes.txt"]


def test_max_files_takes_the_first_in_sorted_order(folder):
    assert list_data_files(str(folder), SUFFIXES, max_files=2) == [
        folder / "a.JSON",
        folder / "b.jsonl",
    ]
    assert len(list_data_files(str(folder), SUFFIXES, max_files=10)) == 3
    with pytest.raises(
        DataError, match=r"^data.max_files = 0 must be >= 1 \(or unset to use all 3 files\)$"
    ):
        list_data_files(str(folder), SUFFIXES, max_files=0)


def test_paths_that_name_no_files(tmp_path, folder):
    (tmp_path / "empty").mkdir()
    cases = [
        (
            str(tmp_path / "empty"),
            f"data.path {str(tmp_path / 'empty')!r} is a folder without ChatML files (.jsonl, "
            ".json); put .jsonl, .json files in it or point data.path at one",
        ),
        (
            str(folder / "*.parquet"),
            f"data.path {str(folder / '*.parquet')!r} matched no files; pass a glob that "
            "matches ChatML files (.jsonl, .json)",
        ),
        (
            str(tmp_path / "nope.jsonl"),
            f"data.path {str(tmp_path / 'nope.jsonl')!r} does not exist; pass a ChatML "
            "file (.jsonl, .json), a folder or a glob",
        ),
    ]
    for path, message in cases:
        with pytest.raises(DataError) as info:
            list_data_files(path, SUFFIXES, what="ChatML")
        assert str(info.value) == message
