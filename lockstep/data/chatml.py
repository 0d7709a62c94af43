"""ChatML conversations -> the model's chat template -> (input_ids, labels) samples for a causal LM.

    data.path (.json / .jsonl / folder / glob)
      -> load_conversations      validated Conversation(messages, source="file:line") (data/chat_files.py)
      -> tokenize_conversation   the tokenizer's chat template renders and tokenizes each conversation once;
                                 labels = the token id on assistant tokens, -100 everywhere else
      -> build_chat_datasets     the last conversations form the eval split; each split is either packed into
                                 windows of exactly max_seq_length tokens (pack=True) or kept one conversation
                                 per sample, truncated to max_seq_length (pack=False)
      -> collate_chat            right-pads a micro-batch (pad id / -100 / attention 0)

Labels and input_ids are aligned (same length): Hugging Face causal LMs shift labels inside the loss.
Assistant tokens are found by the template itself when it marks them with `{% generation %}`; most
released templates (Qwen, Llama-3) do not, and then by rendering prefixes of the conversation
(see `tokenize_conversation`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lockstep.data.chat_files import Conversation
from lockstep.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # label of tokens the loss skips (the value Hugging Face losses ignore)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # the same test transformers applies

log = logging.getLogger("lockstep.data.chatml")


# ---------------------------------------------------------------- chat template -> tokens and labels


def require_chat_template(tokenizer: PreTrainedTokenizerBase, model_path: str) -> None:
    """Stop with the fix when the tokenizer has no chat template (base models often ship without one)."""
    if getattr(tokenizer, "chat_template", None):
        return
    raise DataError(
        f"the tokenizer in model.path {model_path!r} has no chat template, which data.kind: chatml needs to turn "
        f"messages into tokens; give it one: save the template as {model_path}/chat_template.jinja (or set "
        f'"chat_template" in {model_path}/tokenizer_config.json), or in Python: '
        f"tok = AutoTokenizer.from_pretrained({model_path!r}); tok.chat_template = open('template.jinja').read(); "
        f"tok.save_pretrained({model_path!r}). Use the template the model was (or will be) prompted with, e.g. the "
        "one of its -Instruct variant"
    )


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], source: str = "conversation"
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation rendered by the tokenizer's chat template.

    labels[i] = input_ids[i] on assistant tokens (the reply and its end-of-turn marker), -100 elsewhere.
    """
    return _pick_tokenize(tokenizer)(tokenizer, messages, source)


def _pick_tokenize(tokenizer: PreTrainedTokenizerBase) -> Callable:
    require_chat_template(tokenizer, getattr(tokenizer, "name_or_path", "") or "<model.path>")
    marks_generation = _GENERATION_TAG.search(tokenizer.get_chat_template() or "") is not None
    return _tokenize_with_mask if marks_generation else _tokenize_by_prefixes


def _tokenize_with_mask(tokenizer, messages, source) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(out["input_ids"]), out["assistant_masks"]
    # transformers does not check: a {% generation %} block that never renders marks nothing
    if not any(mask):
        raise DataError(
            f"{source}: the chat template has {{% generation %}} but marked no token of this "
            "conversation's assistant messages; put each assistant message's content and end marker "
            "inside {% generation %}...{% endgeneration %}, or remove the tags (lockstep then finds "
            "assistant tokens by rendering prefixes)"
        )
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def _tokenize_by_prefixes(tokenizer, messages, source) -> tuple[list[int], list[int]]:
    """Assistant turn i = the tokens of messages[:i+1] past those of messages[:i] + the generation prompt.

    This holds only if every rendering is a token prefix of the longer ones (a template that rewrites earlier
    turns, e.g. drops past reasoning, breaks it), so that is checked rather than assumed.
    """
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if turns[0] == 0:
        raise DataError(
            f"{source}: the conversation starts with an assistant message and the chat template has no "
            "{% generation %} tags, so its prompt tokens cannot be told apart; put a system or user "
            "message first"
        )
    texts = [tokenizer.apply_chat_template(messages, tokenize=False)]
    for i in turns:
        texts.append(
            tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        )
        texts.append(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
    # one batched call; apply_chat_template(tokenize=True) tokenizes its rendering the same way
    full, *rest = tokenizer(texts, add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] * len(full)
    special = {tid for tid, t in tokenizer.added_tokens_decoder.items() if t.special}
    for i, prompt, upto in zip(turns, rest[0::2], rest[1::2]):
        if prompt != upto[: len(prompt)]:
            broken = (
                f"its generation prompt (add_generation_prompt=True) is not how it starts assistant message {i}"
                f" ({_first_difference(tokenizer, prompt, upto)})"
            )
        elif upto != full[: len(upto)]:
            broken = (
                f"it renders the conversation up to message {i} (assistant) differently once later messages "
                f"follow, e.g. drops past reasoning ({_first_difference(tokenizer, upto, full)})"
            )
        else:
            end = _turn_end(tokenizer, upto, len(prompt), special)
            labels[len(prompt) : end] = full[len(prompt) : end]
            continue
        raise DataError(
            f"{source}: the chat template has no {{% generation %}} tags and {broken}, so lockstep cannot "
            "tell which tokens are the assistant's; wrap each assistant message's content and end marker "
            "in {% generation %}...{% endgeneration %} in the template"
        )
    return full, labels


def _first_difference(tokenizer, shorter: list[int], longer: list[int]) -> str:
    k = next((k for k, (a, b) in enumerate(zip(shorter, longer)) if a != b), len(shorter))
    return f"token {k}: {tokenizer.decode(shorter[k : k + 8])!r} vs {tokenizer.decode(longer[k : k + 8])!r}"


def _turn_end(tokenizer, ids: list[int], start: int, special: set[int]) -> int:
    """Where the assistant turn in ids[start:] ends: whitespace after its end marker (ChatML's "\\n" after
    <|im_end|>) separates turns and is left unlabelled, as templates with {% generation %} do."""
    last = next((k for k in range(len(ids) - 1, start - 1, -1) if ids[k] in special), None)
    if last is None or tokenizer.decode(ids[last + 1 :]).strip():
        return len(ids)
    return last + 1


# ---------------------------------------------------------------- datasets


class ChatDataset(torch.utils.data.Dataset):
    """Samples cut from one token array: item i = tokens[starts[i] : starts[i] + lengths[i]].

    Packed, every sample is a window of exactly max_seq_length tokens; unpacked, a sample is one
    conversation (truncated to max_seq_length). Plain numpy arrays, so the dataset pickles into
    DataLoader workers.
    """

    def __init__(
        self,
        ids: np.ndarray,
        labels: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        num_truncated: int = 0,
    ):
        self.ids, self.labels, self.starts, self.lengths = ids, labels, starts, lengths
        self.num_truncated = num_truncated  # conversations cut to max_seq_length (unpacked only)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self.starts):
            raise IndexError(
                f"sample {i} out of range for a ChatDataset of {len(self.starts)} samples"
            )
        s, n = int(self.starts[i]), int(self.lengths[i])
        return {
            "input_ids": torch.from_numpy(self.ids[s : s + n].astype(np.int64)),  # (n,)
            "labels": torch.from_numpy(self.labels[s : s + n].astype(np.int64)),  # (n,)
            "attention_mask": torch.ones(n, dtype=torch.int64),
        }


def build_chat_datasets(
    conversations: list[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    pack: bool,
    eval_fraction: float,
) -> tuple[ChatDataset, ChatDataset | None]:
    """Tokenize every conversation once; the last round(eval_fraction * n) conversations form the eval split.

    The split is by conversation, before packing, so no eval conversation leaks into a train window.
    """
    n = len(conversations)
    if n == 0:
        raise DataError(
            "no conversations to build a dataset from; point data.path at ChatML .json/.jsonl files"
        )
    num_eval = round(eval_fraction * n)
    if eval_fraction > 0 and n >= 2:
        num_eval = max(num_eval, 1)
    num_eval = min(num_eval, max(n - 1, 0))  # train keeps at least one conversation
    tokenize = _pick_tokenize(tokenizer)
    pieces = [tokenize(tokenizer, c.messages, c.source) for c in conversations]
    train = _build_split(pieces[: n - num_eval], max_seq_length, pack, "train")
    evals = _build_split(pieces[n - num_eval :], max_seq_length, pack, "eval") if num_eval else None
    if eval_fraction > 0 and evals is None:
        log.warning(
            "chatml: %d conversation(s) leave none for evaluation (data.eval_fraction %s)",
            n,
            eval_fraction,
        )
    return train, evals


def _build_split(
    pieces: list[tuple[list[int], list[int]]], seq_len: int, pack: bool, split: str
) -> ChatDataset:
    sizes = np.array([len(ids) for ids, _ in pieces], dtype=np.int64)
    ids = np.fromiter((t for p, _ in pieces for t in p), dtype=np.int32, count=int(sizes.sum()))
    labels = np.fromiter((t for _, p in pieces for t in p), dtype=np.int32, count=int(sizes.sum()))
    total, learned = int(sizes.sum()), int((labels != IGNORE_INDEX).sum())
    if pack:
        # consecutive conversations share a window (attention crosses their boundary, as in most SFT packing);
        # the tail shorter than a window is dropped
        num = total // seq_len
        ids, labels = ids[: num * seq_len], labels[: num * seq_len]
        starts, lengths, truncated = (
            np.arange(num, dtype=np.int64) * seq_len,
            np.full(num, seq_len),
            0,
        )
    else:
        starts = np.cumsum(sizes) - sizes
        lengths, truncated = np.minimum(sizes, seq_len), int((sizes > seq_len).sum())
    # a sample with no learned token after its first (causal LMs shift labels by one) would give a NaN loss
    # (a mean over zero tokens) and NaN gradients: drop it
    cum = np.concatenate([[0], np.cumsum(labels != IGNORE_INDEX)])
    keep = (cum[starts + lengths] - cum[np.minimum(starts + 1, starts + lengths)]) > 0
    if not keep.all() and keep.any():
        log.warning(
            "chatml %s: %d of %d samples have no assistant token to learn (long prompts?) and are skipped",
            split,
            int((~keep).sum()),
            len(starts),
        )
        starts, lengths = starts[keep], lengths[keep]
    if len(starts) == 0:  # only when packing: unpacked, every conversation is a sample
        extra = ", or raise data.eval_fraction (or set it to 0)" if split == "eval" else ""
        raise DataError(
            f"the {split} split's {len(pieces)} conversation(s) hold {total} tokens, fewer than one "
            f"window of model.max_seq_length = {seq_len}; lower model.max_seq_length (to at most "
            f"{total}) or set data.pack: false (one padded sample per conversation){extra}"
        )
    if truncated:
        log.warning(
            "chatml %s: %d of %d conversations are longer than model.max_seq_length = %d and were cut "
            "(their later tokens are not trained); raise it or set data.pack: true",
            split,
            truncated,
            len(pieces),
            seq_len,
        )
    log.info(
        "chatml %s: %d conversations, %d tokens (%.0f%% assistant) -> %d samples",
        split,
        len(pieces),
        total,
        100 * learned / max(total, 1),
        len(starts),
    )
    return ChatDataset(ids, labels, starts, lengths, truncated)


# ---------------------------------------------------------------- batching


class ChatCollator:
    """Right-pads a list of samples to the longest: input_ids with the pad id, labels with -100, attention with 0.

    A class rather than a closure so that DataLoader workers can pickle it.
    """

    def __init__(self, pad_token_id: int):
        if not isinstance(pad_token_id, int):
            raise DataError(
                f"pad_token_id {pad_token_id!r} is not an integer; the tokenizer has no pad token: pass "
                "its eos_token_id (padded positions are masked and unlabelled, so any id works)"
            )
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(len(s["input_ids"]) for s in samples)
        batch = {
            # (B, T)
            "input_ids": torch.full((len(samples), width), self.pad_token_id, dtype=torch.int64),
            "labels": torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.int64),
            "attention_mask": torch.zeros((len(samples), width), dtype=torch.int64),
        }
        for row, sample in enumerate(samples):
            for key, out in batch.items():
                out[row, : len(sample[key])] = sample[key]
        return batch


def collate_chat(pad_token_id: int) -> ChatCollator:
    return ChatCollator(pad_token_id)
