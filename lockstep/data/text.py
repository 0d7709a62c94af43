"""Text corpus (lockstep.data.corpus) -> cached token file -> fixed windows for next-token prediction.

The corpus is tokenized once into `<cache>/<key>.bin` (a flat uint16/uint32 array that every
rank and DataLoader worker memory-maps) plus `<key>.json` (metadata and the BPE tokenizer).
The key hashes what the tokens depend on: the files read (path, size, mtime), the tokenizer
and the byte cap, so a changed file or setting makes a new cache and an unchanged corpus is
never read twice.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from lockstep.config import DataConfig
from lockstep.data.corpus import corpus_chunks, files_read, read_corpus, resolve_corpus
from lockstep.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    build_bpe_from_texts,
    tokenizer_from_json,
)
from lockstep.errors import DataError

CACHE_FORMAT = 1  # bump when the cache layout or tokenization changes, so old caches are not reused


# ---------------------------------------------------------------- token cache


@dataclass
class TokenCache:
    tokens_path: Path  # flat array of token ids, memory-mappable
    dtype: str  # "uint16" or "uint32"
    num_tokens: int  # length of the array
    tokenizer_json: str | None  # BPE tokenizer (None = byte tokenizer)
    key: str  # cache key: hash of files, sizes, mtimes and tokenizer settings

    def tokenizer(self) -> ByteTokenizer | BPETokenizer:
        return tokenizer_from_json(self.tokenizer_json)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer().vocab_size


def _cache_root(cfg: DataConfig, cache_root: Path | None) -> Path:
    if cache_root is not None:
        return Path(cache_root)
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir)
    return Path.home() / ".cache" / "lockstep" / "tokens"


def _cache_key(cfg: DataConfig, files: list[Path]) -> str:
    read = files_read(files, cfg.max_bytes)
    spec = {
        "format": CACHE_FORMAT,
        "files": [[str(f), st.st_size, st.st_mtime_ns] for f, st in read],
        "tokenizer": cfg.tokenizer,
        "bpe_vocab_size": cfg.bpe_vocab_size
        if cfg.tokenizer == "bpe" and not cfg.tokenizer_path
        else None,
        "tokenizer_file": _sha256_file(Path(cfg.tokenizer_path)) if cfg.tokenizer_path else None,
        "max_bytes": cfg.max_bytes,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
    return f"{cfg.tokenizer}-{digest}"


def _token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"  # ids run 0..vocab_size-1


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _read_cached(root: Path, key: str) -> TokenCache | None:
    """The committed cache for key, or None if absent or not (yet) consistent."""
    meta_path, bin_path = root / f"{key}.json", root / f"{key}.bin"
    try:
        meta = json.loads(meta_path.read_text())
        size = bin_path.stat().st_size
    except (OSError, ValueError):
        return None
    if (
        size != meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
        or _sha256_file(bin_path) != meta["sha256"]
    ):
        return (
            None  # another writer's .bin replaced ours between the two renames; its .json follows
        )
    return TokenCache(bin_path, meta["dtype"], meta["num_tokens"], meta["tokenizer_json"], key)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _tokenize(cfg: DataConfig, files: list[Path]) -> tuple[np.ndarray, str | None]:
    blob = read_corpus(files, cfg.max_bytes)
    match cfg.tokenizer:
        case "byte":
            return np.frombuffer(blob, dtype=np.uint8).astype(np.uint16), None
        case "bpe":
            chunks = corpus_chunks(blob.decode("utf-8", errors="replace"))
            # a shared vocabulary: copies trained on different data stay mergeable
            if cfg.tokenizer_path:
                tok = _load_tokenizer_file(Path(cfg.tokenizer_path))
            else:
                tok = build_bpe_from_texts(chunks, cfg.bpe_vocab_size)
            ids = np.fromiter(
                (i for piece in tok.encode_batch(chunks) for i in piece),
                dtype=_token_dtype(tok.vocab_size),
            )
            return ids, tok.to_json()
        case _:
            raise DataError(
                f"data.tokenizer = {cfg.tokenizer!r} is not one of 'byte', 'bpe'; pick one of those"
            )


def _load_tokenizer_file(path: Path):
    try:
        tok = tokenizer_from_json(path.read_text())
    except Exception as e:  # tokenizers raises its own exception types for a malformed file
        raise DataError(
            f"data.tokenizer_path = {str(path)!r} is not a tokenizer.json that `tokenizers` reads "
            f"({type(e).__name__}: {e}); pass the tokenizer.json of a lockstep run or checkpoint"
        ) from e
    if tok.kind != "bpe":
        raise DataError(
            f"data.tokenizer_path = {str(path)!r} holds a {tok.kind} tokenizer, not BPE"
        )
    return tok


def _check_length(cache: TokenCache, seq_len: int | None, source: str) -> None:
    if seq_len is None:
        return
    need = 2 * seq_len + 1  # one train and one eval window of seq_len + 1 tokens, sharing no token
    if cache.num_tokens < need:
        raise DataError(
            f"{source} gives {cache.num_tokens} tokens; seq_len {seq_len} needs at least 2 x {seq_len} + 1 = {need} "
            "(one train and one eval window); add text, raise data.max_bytes or lower model.max_seq_length"
        )


def prepare_tokens(
    cfg: DataConfig, cache_root: Path | None = None, seq_len: int | None = None
) -> TokenCache:
    """Tokenize the corpus once into the cache; later calls (any process) return the cached file.

    A hit only stats the corpus files for the key. Files are written temp-then-rename, .bin
    before .json, and the .json records the .bin's checksum, so processes racing on a shared
    filesystem never use a half-written or mismatched pair. With seq_len, a corpus too short for
    one train and one eval window raises DataError.
    """
    files = resolve_corpus(cfg.path)[: cfg.max_files]  # max_files None: all
    root = _cache_root(cfg, cache_root)
    key = _cache_key(cfg, files)
    source = f"data.path {cfg.path!r}" if cfg.path is not None else "the default corpus"
    cache = _read_cached(root, key)
    if cache is None:
        root.mkdir(parents=True, exist_ok=True)
        ids, tok_json = _tokenize(cfg, files)
        meta = {
            "num_tokens": int(ids.size),
            "dtype": str(ids.dtype),
            "tokenizer_json": tok_json,
            "sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
            "files": len(files_read(files, cfg.max_bytes)),
            "max_bytes": cfg.max_bytes,
        }
        _atomic_write(root / f"{key}.bin", ids.tobytes())
        _atomic_write(root / f"{key}.json", json.dumps(meta).encode())
        cache = _read_cached(root, key)
        if cache is None:  # lost a race to a writer whose output differs; its pair lands shortly
            cache = _wait_for_cache(root, key, timeout=60.0)
    _check_length(cache, seq_len, source)
    return cache


def _wait_for_cache(root: Path, key: str, timeout: float) -> TokenCache:
    deadline = time.monotonic() + timeout
    while (cache := _read_cached(root, key)) is None:
        if time.monotonic() > deadline:
            raise DataError(
                f"token cache {str(root / key)!r}.bin/.json did not become consistent within {timeout:.0f} s; "
                "another process may have died while writing it: delete both files and run again"
            )
        time.sleep(0.2)
    return cache


def load_token_cache(
    cfg: DataConfig, cache_root: Path | None = None, seq_len: int | None = None
) -> TokenCache:
    """The cache `prepare_tokens` made for this corpus and settings (same key); never tokenizes."""
    files = resolve_corpus(cfg.path)[: cfg.max_files]  # max_files None: all
    root = _cache_root(cfg, cache_root)
    key = _cache_key(cfg, files)
    cache = _read_cached(root, key)
    if cache is None:
        raise DataError(
            f"no token cache {key!r} under {str(root)!r} for data.path {cfg.path!r}; the preparing rank must "
            "call prepare_tokens first (and data.cache_dir must be on a filesystem every rank sees)"
        )
    _check_length(cache, seq_len, f"data.path {cfg.path!r}")
    return cache


# ---------------------------------------------------------------- windows


class TokenWindows(torch.utils.data.Dataset):
    """Fixed, non-overlapping windows of seq_len + 1 tokens; the last ones form the eval split.

    Window i covers tokens [i * seq_len, i * seq_len + seq_len + 1): neighbours share one
    token (the last target of i is the first input of i + 1), so every token is predicted once.
    The eval split is the last ceil(eval_fraction * n) windows; train is the rest. The token
    file is memory-mapped on first access, so the dataset pickles cheaply into workers.
    """

    def __init__(
        self, cache: TokenCache, seq_len: int, split: Literal["train", "eval"], eval_fraction: float
    ):
        if split not in ("train", "eval"):
            raise ValueError(f"split {split!r} is not one of 'train', 'eval'")
        self.cache, self.seq_len, self.split = cache, seq_len, split
        self.num_windows = max(0, (cache.num_tokens - 1) // seq_len)
        # the epsilon keeps 0.02 * 100 (= 2.0000000000000004) at 2 windows, not 3
        self.num_eval = math.ceil(eval_fraction * self.num_windows - 1e-9)
        self.num_train = self.num_windows - self.num_eval
        if self.num_train < 1 or (eval_fraction > 0 and self.num_eval < 1):
            raise DataError(
                f"{cache.num_tokens} tokens make {self.num_windows} windows of seq_len {seq_len}, split into "
                f"{self.num_train} train / {self.num_eval} eval (data.eval_fraction {eval_fraction}); each split "
                "needs at least one: add text, raise data.max_bytes, lower model.max_seq_length or adjust "
                "data.eval_fraction"
            )
        self._first = 0 if split == "train" else self.num_train
        self._len = self.num_train if split == "train" else self.num_eval
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = None  # re-opened lazily in the worker
        return state

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(
                f"window {i} out of range for the {self.split} split of {self._len} windows"
            )
        if self._tokens is None:
            self._tokens = np.memmap(
                self.cache.tokens_path,
                dtype=self.cache.dtype,
                mode="r",
                shape=(self.cache.num_tokens,),
            )
        start = (self._first + i) * self.seq_len
        chunk = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]  # x, y: (seq_len,) each, y is x shifted by one
