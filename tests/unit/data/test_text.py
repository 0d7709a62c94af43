"""The token cache and TokenWindows (lockstep/data/text.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_corpus

from lockstep.config import DataConfig
from lockstep.data import text as text_mod
from lockstep.data.text import TokenWindows, load_token_cache, prepare_tokens
from lockstep.data.tokenizer import BPETokenizer, tokenizer_from_json
from lockstep.errors import DataError


def test_prepare_tokens_caches_without_rereading(tmp_path, monkeypatch):
    write_corpus(tmp_path / "c")
    cfg = DataConfig(path=str(tmp_path / "c"), max_bytes=None)
    reads = []
    real = Path.read_bytes

    def counting_read_bytes(self):
        reads.append(self)
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", counting_read_bytes)
    first = prepare_tokens(cfg, cache_root=tmp_path / "cache")
    assert len(reads) == 3
    tokens = np.fromfile(first.tokens_path, dtype=first.dtype)
    expected = b"\n\n".join((tmp_path / "c" / f"doc{i}.txt").read_bytes() for i in range(3))
    assert (
        first.dtype == "uint16"
        and first.num_tokens == len(expected)
        and first.tokenizer_json is None
    )
    assert bytes(tokens.astype(np.uint8)) == expected
    reads.clear()

    second = prepare_tokens(cfg, cache_root=tmp_path / "cache")
    assert reads == []  # a hit only stats the files
    assert second == first
    assert load_token_cache(cfg, cache_root=tmp_path / "cache") == first
    leftovers = [
        p.name for p in (tmp_path / "cache").iterdir() if p.suffix not in (".bin", ".json")
    ]
    assert leftovers == []  # no temp files left behind


def test_max_files_takes_the_first_files_of_the_corpus(tmp_path):
    write_corpus(tmp_path / "c")
    every = prepare_tokens(
        DataConfig(path=str(tmp_path / "c"), max_bytes=None), cache_root=tmp_path / "cache"
    )
    cfg = DataConfig(path=str(tmp_path / "c"), max_bytes=None, max_files=2)
    first_two = prepare_tokens(cfg, cache_root=tmp_path / "cache")
    expected = b"\n\n".join((tmp_path / "c" / f"doc{i}.txt").read_bytes() for i in range(2))
    tokens = np.fromfile(first_two.tokens_path, dtype=first_two.dtype)
    assert bytes(tokens.astype(np.uint8)) == expected and first_two.num_tokens < every.num_tokens
    assert load_token_cache(cfg, cache_root=tmp_path / "cache") == first_two


def test_changing_a_file_changes_the_key(tmp_path):
    files = write_corpus(tmp_path / "c")
    cfg = DataConfig(path=str(tmp_path / "c"), max_bytes=None)
    before = prepare_tokens(cfg, cache_root=tmp_path / "cache")
    files[1].write_text("different text entirely\n" * 50)
    st = files[1].stat()
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # coarse-mtime filesystems
    with pytest.raises(DataError, match="no token cache"):
        load_token_cache(cfg, cache_root=tmp_path / "cache")
    after = prepare_tokens(cfg, cache_root=tmp_path / "cache")
    assert after.key != before.key and after.num_tokens != before.num_tokens
    # tokenizer settings are part of the key too
    other = prepare_tokens(
        DataConfig(path=str(tmp_path / "c"), max_bytes=1000), cache_root=tmp_path / "cache"
    )
    assert other.key != after.key and other.num_tokens == 1000


def _prepare_in_child(folder: str, root: str, out) -> None:
    cache = prepare_tokens(
        DataConfig(path=folder, tokenizer="bpe", bpe_vocab_size=300, max_bytes=None), Path(root)
    )
    out.put(
        (
            cache.key,
            np.fromfile(cache.tokens_path, dtype=cache.dtype).tobytes(),
            cache.tokenizer_json,
        )
    )


def test_racing_processes_get_one_consistent_cache(tmp_path):
    import multiprocessing

    write_corpus(tmp_path / "c", repeat=200)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_prepare_in_child, args=(str(tmp_path / "c"), str(tmp_path / "cache"), out)
        )
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(set(results)) == 1
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".bin", ".json"]


def test_prepare_tokens_bpe(tmp_path):
    write_corpus(tmp_path / "c")
    cfg = DataConfig(path=str(tmp_path / "c"), tokenizer="bpe", bpe_vocab_size=400, max_bytes=None)
    cache = prepare_tokens(cfg, cache_root=tmp_path / "cache")
    tok = cache.tokenizer()
    assert isinstance(tok, BPETokenizer) and cache.tokenizer_json is not None
    ids = np.fromfile(cache.tokens_path, dtype=cache.dtype)
    assert ids.size == cache.num_tokens and int(ids.max()) < tok.vocab_size
    assert (
        tok.decode(ids.tolist())
        == b"\n\n".join((tmp_path / "c" / f"doc{i}.txt").read_bytes() for i in range(3)).decode()
    )
    assert prepare_tokens(cfg, cache_root=tmp_path / "cache") == cache


def test_too_few_tokens_for_a_window(tmp_path):
    (tmp_path / "tiny.txt").write_text("hello world\n")
    cfg = DataConfig(path=str(tmp_path / "tiny.txt"))
    with pytest.raises(
        DataError, match=r"gives 12 tokens; seq_len 64 needs at least 2 x 64 \+ 1 = 129"
    ):
        prepare_tokens(cfg, cache_root=tmp_path / "cache", seq_len=64)


def test_default_corpus_tokens_decode_to_python(tmp_path):
    cfg = DataConfig(path=None, max_bytes=200_000)
    cache = prepare_tokens(cfg, cache_root=tmp_path / "cache", seq_len=128)
    assert cache.num_tokens == 200_000
    text = cache.tokenizer().decode(np.fromfile(cache.tokens_path, dtype=cache.dtype).tolist())
    assert "def " in text and "import " in text and "return" in text


# ---------------------------------------------------------------- windows


def test_token_windows_shift_split_and_pickle(tmp_path):
    tokens = np.arange(1001, dtype=np.uint16)  # token value = its position
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    cache = text_mod.TokenCache(path, "uint16", tokens.size, None, "k")
    train = TokenWindows(cache, seq_len=10, split="train", eval_fraction=0.02)
    evals = TokenWindows(cache, seq_len=10, split="eval", eval_fraction=0.02)
    assert train.num_windows == 100 and len(evals) == 2 and len(train) == 98  # ceil(0.02 * 100) = 2

    x, y = train[3]
    assert x.dtype == torch.long and x.shape == (10,) and y.shape == (10,)
    assert torch.equal(x, torch.arange(30, 40)) and torch.equal(y, torch.arange(31, 41))

    # every token is predicted once: train and eval targets are disjoint and together cover 1..1000
    train_targets = torch.cat([train[i][1] for i in range(len(train))]).tolist()
    eval_targets = torch.cat([evals[i][1] for i in range(len(evals))]).tolist()
    assert not set(train_targets) & set(eval_targets)
    assert sorted(train_targets + eval_targets) == list(range(1, 1001))
    ex, ey = evals[1]
    assert torch.equal(ey, torch.arange(991, 1001))  # the last window ends at the last token
    with pytest.raises(IndexError):
        evals[2]

    import pickle

    assert train._tokens is not None  # opened by the accesses above
    clone = pickle.loads(pickle.dumps(train))
    assert clone._tokens is None and torch.equal(clone[3][0], x)


def test_token_windows_need_an_eval_window(tmp_path):
    tokens = np.zeros(15, dtype=np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    cache = text_mod.TokenCache(tmp_path / "t.bin", "uint16", 15, None, "k")
    with pytest.raises(DataError, match="1 windows of seq_len 10"):
        TokenWindows(cache, seq_len=10, split="train", eval_fraction=0.02)


def test_a_shared_tokenizer_file_replaces_training_one(tmp_path):
    # copies trained on different parts stay mergeable when they share one vocabulary
    from lockstep.config import load_config
    from lockstep.errors import ConfigError

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("def alpha(x):\n    return x * 2\n" * 400)
    b.write_text("class Beta:\n    value = 'something else entirely'\n" * 400)
    first = prepare_tokens(
        DataConfig(path=str(a), tokenizer="bpe", bpe_vocab_size=300), cache_root=tmp_path / "c"
    )
    shared = tmp_path / "tokenizer.json"
    shared.write_text(first.tokenizer_json)
    own = prepare_tokens(
        DataConfig(path=str(b), tokenizer="bpe", bpe_vocab_size=300), cache_root=tmp_path / "c"
    )
    reused = prepare_tokens(
        DataConfig(path=str(b), tokenizer="bpe", tokenizer_path=str(shared)),
        cache_root=tmp_path / "c",
    )
    assert own.tokenizer_json != first.tokenizer_json  # trained on b, a different vocabulary
    assert reused.tokenizer_json == first.tokenizer_json and reused.key != own.key
    ids = np.fromfile(reused.tokens_path, dtype=reused.dtype)
    # b, in a's vocabulary
    assert tokenizer_from_json(reused.tokenizer_json).decode(ids.tolist()) == b.read_text()
    with pytest.raises(ConfigError, match="is for data.tokenizer = 'bpe'"):
        load_config(overrides={"data.tokenizer_path": str(shared)})
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(
            overrides={"data.tokenizer": "bpe", "data.tokenizer_path": str(tmp_path / "nope.json")}
        )
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="is not a tokenizer.json"):
        prepare_tokens(
            DataConfig(path=str(b), tokenizer="bpe", tokenizer_path=str(bad)),
            cache_root=tmp_path / "c",
        )
