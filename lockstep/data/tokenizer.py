"""Tokenizers for the built-in GPT: raw UTF-8 bytes, or a byte-level BPE trained on the corpus.

Both map text to ids and back losslessly (byte-level BPE covers every byte, so nothing is
ever unknown). Checkpoints store `to_json()` for BPE only; `tokenizer_from_json(None)` is
the byte tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


class ByteTokenizer:
    """One id per UTF-8 byte; vocab_size 256."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """A `tokenizers.Tokenizer` with ByteLevel pre-tokenizer and decoder."""

    kind = "bpe"

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        # skip_special_tokens=False: there are none, and dropping ids silently would hide bugs
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tokenizer.to_str()


def build_bpe_from_texts(texts: Iterator[str] | Sequence[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE of at most `vocab_size` ids (fewer if the text has fewer merges to learn)."""
    if vocab_size < 256:
        raise ValueError(
            f"data.bpe_vocab_size = {vocab_size} is below 256, the byte alphabet a byte-level BPE starts from; "
            "set it to 256 or more (4096 is typical)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so any text encodes
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return BPETokenizer(tok)


def tokenizer_from_json(text: str | None) -> ByteTokenizer | BPETokenizer:
    """None -> the byte tokenizer; otherwise a BPE tokenizer saved by `BPETokenizer.to_json`."""
    if text is None:
        return ByteTokenizer()
    return BPETokenizer(Tokenizer.from_str(text))
