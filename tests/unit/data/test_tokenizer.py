"""The byte tokenizer and the byte-level BPE: lossless round trips, and the BPE saved and loaded as JSON
(lockstep/data/tokenizer.py)."""

from __future__ import annotations

import pytest
from conftest import SAMPLE, write_corpus

from lockstep.data.corpus import train_bpe
from lockstep.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    build_bpe_from_texts,
    tokenizer_from_json,
)


def test_byte_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids) and tok.vocab_size == 256 and tok.kind == "byte"
    assert tok.decode(ids) == SAMPLE
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def test_bpe_train_round_trip_and_json(tmp_path):
    files = write_corpus(tmp_path / "c")
    tok = train_bpe(files, vocab_size=400, max_bytes=None)
    assert isinstance(tok, BPETokenizer) and tok.kind == "bpe"
    assert 256 < tok.vocab_size <= 400
    ids = tok.encode(SAMPLE)
    assert len(ids) < len(SAMPLE.encode())  # merges were learned
    assert tok.decode(ids) == SAMPLE
    unseen = "völlig neue Wörter ✓ λx. x\n"
    assert tok.decode(tok.encode(unseen)) == unseen  # byte-level: nothing is unknown

    again = tokenizer_from_json(tok.to_json())
    assert isinstance(again, BPETokenizer) and again.vocab_size == tok.vocab_size
    assert again.encode(SAMPLE) == ids
    assert isinstance(tokenizer_from_json(None), ByteTokenizer)


def test_byte_tokenizer_ids_are_the_utf8_bytes():
    tok = ByteTokenizer()
    # ASCII: one id per character
    assert [tok.encode(chr(i)) for i in range(128)] == [[i] for i in range(128)]
    # one character, two bytes
    assert tok.encode("ÿ") == [0xC3, 0xBF] and tok.decode([0xC3, 0xBF]) == "ÿ"
    assert tok.decode(iter([104, 105])) == "hi"  # any iterable of ids


def test_bpe_from_texts_batches_and_caps_the_vocabulary():
    texts = [SAMPLE * 20, "def sub(a, b):\n    return a - b\n" * 50]
    tok = build_bpe_from_texts(texts, vocab_size=300)
    assert 256 < tok.vocab_size <= 300  # the cap holds; every byte is in it
    lines = SAMPLE.splitlines(keepends=True)
    assert tok.encode_batch(lines) == [tok.encode(line) for line in lines]
    assert "".join(tok.decode(ids) for ids in tok.encode_batch(lines)) == SAMPLE
    assert tok.decode(tok.encode("\x00\x7f")) == "\x00\x7f"  # bytes the training text never held
    # the byte alphabet alone: no merges
    assert build_bpe_from_texts(texts, vocab_size=256).vocab_size == 256


def test_bpe_below_the_byte_alphabet_is_refused():
    with pytest.raises(
        ValueError,
        match=r"data.bpe_vocab_size = 255 is below 256, the byte alphabet a byte-level BPE "
        r"starts from; set it to 256 or more",
    ):
        build_bpe_from_texts(["some text"], vocab_size=255)
