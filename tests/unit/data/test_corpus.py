"""lockstep/data/corpus.py: data.path as a file, a folder or a glob, each refusal naming the path; the embedded
default corpus (this Python's standard library), in a fixed order; the CLI refusing a bad corpus before any
worker starts."""

from __future__ import annotations

import pytest
from conftest import run_main, write_corpus

from lockstep.config import DataConfig
from lockstep.data.corpus import default_corpus_files, resolve_corpus
from lockstep.data.text import prepare_tokens
from lockstep.errors import DataError


def test_resolve_corpus_file_folder_glob(tmp_path):
    files = write_corpus(tmp_path / "c")
    (tmp_path / "c" / "sub").mkdir()
    nested = tmp_path / "c" / "sub" / "more.md"
    nested.write_text("nested text\n")
    (tmp_path / "c" / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)  # binary: skipped
    (tmp_path / "c" / ".hidden.txt").write_text("hidden\n")  # hidden: skipped

    assert resolve_corpus(str(files[0])) == [files[0].resolve()]
    assert resolve_corpus(str(tmp_path / "c")) == sorted(
        [*(f.resolve() for f in files), nested.resolve()], key=str
    )
    assert resolve_corpus(str(tmp_path / "c" / "**" / "*.txt")) == [f.resolve() for f in files]
    assert resolve_corpus(str(tmp_path / "c" / "**" / "*.md")) == [nested.resolve()]


@pytest.mark.parametrize(
    "case", ["missing", "empty_folder", "empty_file", "glob_nothing", "binary_file"]
)
def test_resolve_corpus_errors_name_the_path(tmp_path, case):
    match case:
        case "missing":
            path = str(tmp_path / "nope.txt")
            words = "does not exist"
        case "empty_folder":
            (tmp_path / "empty").mkdir()
            path = str(tmp_path / "empty")
            words = "no text files"
        case "empty_file":
            (tmp_path / "e.txt").write_text("")
            path = str(tmp_path / "e.txt")
            words = "empty"
        case "glob_nothing":
            path = str(tmp_path / "*.nothing")
            words = "matched no files"
        case "binary_file":
            (tmp_path / "b.dat").write_bytes(b"abc\x00def")
            path = str(tmp_path / "b.dat")
            words = "binary"
    with pytest.raises(DataError) as info:
        resolve_corpus(path)
    assert path in str(info.value) and words in str(info.value)
    with pytest.raises(DataError):  # prepare_tokens reports the same
        prepare_tokens(DataConfig(path=path), cache_root=tmp_path / "cache")


def test_the_cli_refuses_a_missing_or_empty_corpus_before_any_worker_starts(tmp_path, capsys):
    """`lockstep train` tokenizes in the launching process (prepare_tokens): a corpus that is not
    there or holds no text stops it with exit 1 and the path, and no worker starts."""
    missing = tmp_path / "nope.txt"
    code, out, err = run_main(
        capsys, "train", "--world-size", "2", "--data", missing, "--output-dir", tmp_path
    )
    assert code == 1 and "Traceback" not in err, err
    assert "starting 2 workers" not in out, "workers were started before the input was checked"
    assert f"data.path '{missing}' does not exist" in err and "omit --data" in err
    (tmp_path / "empty").mkdir()
    code, out, err = run_main(
        capsys, "train", "--world-size", "2", "--data", tmp_path / "empty", "--output-dir", tmp_path
    )
    assert code == 1 and "Traceback" not in err, err
    assert "starting 2 workers" not in out, "workers were started before the input was checked"
    assert str(tmp_path / "empty") in err
    (tmp_path / "empty.txt").write_text("")
    code, out, err = run_main(
        capsys, "train", "--data", tmp_path / "empty.txt", "--output-dir", tmp_path
    )
    assert code == 1 and "Traceback" not in err, err
    assert "starting 2 workers" not in out, "workers were started before the input was checked"
    assert "empty" in err and str(tmp_path / "empty.txt") in err


def test_default_corpus_is_stdlib_python():
    files = default_corpus_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert files == default_corpus_files()  # deterministic
    assert not any(
        part in ("site-packages", "test", "tests", "__pycache__") for f in files for part in f.parts
    )


# ---------------------------------------------------------------- token cache
