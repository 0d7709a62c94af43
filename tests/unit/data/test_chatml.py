"""ChatML loading, chat-template labels, packed / unpacked datasets and collation (lockstep/data/chatml.py)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from lockstep.data import chatml
from lockstep.data.chat_files import Conversation
from lockstep.data.chatml import (
    IGNORE_INDEX,
    build_chat_datasets,
    collate_chat,
    require_chat_template,
    tokenize_conversation,
)
from lockstep.errors import DataError
from lockstep.tools.tiny import CHATML_TEMPLATE, build_tokenizer

from .chats import MULTI, PARTS, SINGLE, TOOL

# the same ChatML template without {% generation %}, like most released templates (Qwen, Llama-3)
PLAIN_TEMPLATE = CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def plain(tok):
    return with_template(tok, PLAIN_TEMPLATE)


def with_template(tok, template: str | None):
    out = copy.deepcopy(tok)
    out.chat_template = template
    return out


def assistant_texts(messages) -> list[str]:
    """What the assistant says in each turn, as the template renders it, with the end marker."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            c = m["content"]
            out.append(
                (c if isinstance(c, str) else "".join(p["text"] for p in c if p["type"] == "text"))
                + "<|im_end|>"
            )
    return out


def labelled_runs(tok, labels: list[int]) -> list[str]:
    runs, current = [], []
    for t in [*labels, IGNORE_INDEX]:
        if t != IGNORE_INDEX:
            current.append(t)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs


# ---------------------------------------------------------------- labels


@pytest.mark.parametrize("path", ["generation-mask", "prefixes"])
@pytest.mark.parametrize(
    "messages", [SINGLE, PARTS, MULTI, TOOL], ids=["single", "parts", "multi", "tool"]
)
def test_labels_cover_assistant_tokens_only(tok, plain, path, messages):
    t = tok if path == "generation-mask" else plain
    ids, labels = tokenize_conversation(t, messages)
    assert len(ids) == len(labels)
    assert ids == t.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert all(lab in (IGNORE_INDEX, i) for i, lab in zip(ids, labels))
    # each labelled run is exactly one assistant reply and its end marker: no prompt, header or separator
    assert labelled_runs(t, labels) == assistant_texts(messages)


def test_both_paths_are_used(tok, plain):
    assert chatml._pick_tokenize(tok) is chatml._tokenize_with_mask
    assert chatml._pick_tokenize(plain) is chatml._tokenize_by_prefixes


def test_prefix_fallback_matches_generation_mask(tok, plain):
    convs = [
        SINGLE,
        PARTS,
        MULTI,
        TOOL,
        MULTI + [{"role": "user", "content": "and now?"}],
        [{"role": "system", "content": "you speak"}, *MULTI, *PARTS],
    ]
    for messages in convs:
        assert tokenize_conversation(plain, messages) == tokenize_conversation(tok, messages)


def test_template_that_rewrites_past_turns_is_refused(tok):
    # like Qwen3's: the last assistant turn gets a reasoning block that earlier turns lose
    rewriting = with_template(
        tok,
        PLAIN_TEMPLATE.replace(
            "{% if message['role'] == 'assistant' %}",
            "{% if message['role'] == 'assistant' %}{% if loop.last %}<think></think>{% endif %}",
        ),
    )
    tokenize_conversation(rewriting, SINGLE)  # one assistant turn, always last: fine
    with pytest.raises(
        DataError,
        match=r"MULTI\.jsonl:7: .*no \{% generation %\} tags.*up to message 1 "
        r"\(assistant\) differently.*<think>",
    ):
        tokenize_conversation(rewriting, MULTI, source="MULTI.jsonl:7")


def test_generation_prompt_that_differs_from_the_turn_is_refused(tok):
    odd = with_template(
        tok,
        PLAIN_TEMPLATE.replace(
            "'<|im_start|>assistant\\n' }}{% endif %}",
            "'<|im_start|>assistant\\n<think>' }}{% endif %}",
        ),
    )
    with pytest.raises(
        DataError, match=r"c:1: .*generation prompt .* not how it starts assistant message 2"
    ):
        tokenize_conversation(odd, SINGLE, source="c:1")


def test_assistant_first_needs_generation_tags(tok, plain):
    messages = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    assert labelled_runs(tok, tokenize_conversation(tok, messages)[1]) == ["hello<|im_end|>"]
    with pytest.raises(
        DataError, match="starts with an assistant message.*put a system or user message first"
    ):
        tokenize_conversation(plain, messages)


def test_generation_tags_that_mark_nothing_are_refused(tok):
    never = with_template(
        tok, PLAIN_TEMPLATE + "{% if false %}{% generation %}x{% endgeneration %}{% endif %}"
    )
    with pytest.raises(DataError, match=r"a\.json:3: .*\{% generation %\} but marked no token"):
        tokenize_conversation(never, SINGLE, source="a.json:3")


def test_missing_chat_template_names_the_fix(tok, tmp_path):
    bare = with_template(tok, None)
    with pytest.raises(DataError) as e:
        require_chat_template(bare, str(tmp_path))
    msg = str(e.value)
    for part in (
        str(tmp_path),
        "no chat template",
        f"{tmp_path}/chat_template.jinja",
        "tokenizer_config.json",
        "tok.chat_template = ",
        "save_pretrained",
    ):
        assert part in msg
    require_chat_template(tok, str(tmp_path))  # has one: no error
    with pytest.raises(DataError, match="no chat template"):
        tokenize_conversation(bare, SINGLE)


# ---------------------------------------------------------------- datasets


def convs(*messages_lists) -> list[Conversation]:
    return [Conversation(m, f"test:{i + 1}") for i, m in enumerate(messages_lists)]


def test_packed_windows_are_the_concatenated_stream(tok):
    conversations = convs(*[SINGLE, PARTS, MULTI, TOOL] * 5)
    T = 16
    train, evals = build_chat_datasets(conversations, tok, T, pack=True, eval_fraction=0.0)
    assert evals is None
    stream = [tokenize_conversation(tok, c.messages) for c in conversations]
    ids = [t for s in stream for t in s[0]]
    labels = [t for s in stream for t in s[1]]
    k = len(ids) // T
    windows = [(ids[i * T : (i + 1) * T], labels[i * T : (i + 1) * T]) for i in range(k)]
    # windows with nothing to learn after their first token (a causal LM shifts labels) are skipped
    learnable = [w for w in windows if any(x != -100 for x in w[1][1:])]
    assert len(train) == len(learnable) > 5
    items = [train[i] for i in range(len(train))]
    for item in items:
        assert all(item[key].shape == (T,) and item[key].dtype == torch.int64 for key in item)
        assert item["attention_mask"].eq(1).all()
    assert [x["input_ids"].tolist() for x in items] == [w[0] for w in learnable]
    assert [x["labels"].tolist() for x in items] == [w[1] for w in learnable]
    k = len(train)
    with pytest.raises(IndexError):
        train[k]


def test_unpacked_samples_pad_through_collate(tok):
    conversations = convs(SINGLE, MULTI, PARTS, TOOL)
    lengths = [len(tokenize_conversation(tok, c.messages)[0]) for c in conversations]
    T = 60
    assert min(lengths) < T < max(lengths)
    train, _ = build_chat_datasets(conversations, tok, T, pack=False, eval_fraction=0.0)
    assert len(train) == 4
    assert train.num_truncated == sum(n > T for n in lengths) >= 1
    samples = [train[i] for i in range(4)]
    want = [min(n, T) for n in lengths]
    assert [len(s["input_ids"]) for s in samples] == want
    # truncation keeps the start of the conversation
    assert samples[1]["input_ids"].tolist() == tokenize_conversation(tok, MULTI)[0][:T]

    batch = collate_chat(tok.pad_token_id)(samples)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert all(v.shape == (4, max(want)) and v.dtype == torch.int64 for v in batch.values())
    for row, (s, n) in enumerate(zip(samples, want)):
        for key, pad in (
            ("input_ids", tok.pad_token_id),
            ("labels", IGNORE_INDEX),
            ("attention_mask", 0),
        ):
            assert batch[key][row, :n].tolist() == s[key].tolist()
            assert batch[key][row, n:].eq(pad).all()
    assert batch["attention_mask"].sum(1).tolist() == want


def test_dataset_and_collator_pickle(tok):
    train, _ = build_chat_datasets(
        convs(SINGLE, MULTI, PARTS), tok, 24, pack=True, eval_fraction=0.0
    )
    collate = collate_chat(tok.pad_token_id)
    train2, collate2 = pickle.loads(pickle.dumps((train, collate)))
    for i in range(len(train)):
        assert all(
            torch.equal(train[i][k], train2[i][k])
            for k in ("input_ids", "labels", "attention_mask")
        )
    batch = collate2([train2[0], train2[1]])
    assert batch["input_ids"].shape == (2, 24)
    with pytest.raises(DataError, match="no pad token.*eos_token_id"):
        collate_chat(None)


def test_dataloader_worker_gets_the_same_batches(tok):
    """A spawned worker receives the dataset and collator by pickle, as under any start method but fork."""
    train, _ = build_chat_datasets(
        convs(SINGLE, MULTI, PARTS, TOOL), tok, 64, pack=False, eval_fraction=0.0
    )
    collate = collate_chat(tok.pad_token_id)
    loader = torch.utils.data.DataLoader(
        train, batch_size=3, num_workers=1, collate_fn=collate, multiprocessing_context="spawn"
    )
    got = list(loader)
    want = [collate([train[0], train[1], train[2]]), collate([train[3]])]
    assert [{k: v.tolist() for k, v in b.items()} for b in got] == [
        {k: v.tolist() for k, v in b.items()} for b in want
    ]


@pytest.mark.parametrize(
    "n, fraction, want",
    [
        (10, 0.0, None),
        (10, 0.1, 1),
        (10, 0.2, 2),
        (10, 0.25, 2),  # round() rounds 2.5 to even
        (100, 0.02, 2),
        (2, 0.01, 1),
        (1, 0.2, None),
        (3, 0.4, 1),
    ],
)
def test_eval_split_sizes(tok, n, fraction, want):
    conversations = convs(*[SINGLE] * n)
    train, evals = build_chat_datasets(conversations, tok, 512, pack=False, eval_fraction=fraction)
    assert (None if evals is None else len(evals)) == want
    assert len(train) == n - (want or 0)


def test_eval_split_holds_the_last_conversations(tok):
    conversations = convs(SINGLE, SINGLE, SINGLE, MULTI)
    _, evals = build_chat_datasets(conversations, tok, 512, pack=False, eval_fraction=0.25)
    assert evals[0]["input_ids"].tolist() == tokenize_conversation(tok, MULTI)[0]


def test_too_few_tokens_for_a_window(tok):
    n = len(tokenize_conversation(tok, SINGLE)[0])
    with pytest.raises(DataError) as e:
        build_chat_datasets(convs(SINGLE), tok, 1000, pack=True, eval_fraction=0.0)
    msg = str(e.value)
    assert f"train split's 1 conversation(s) hold {n} tokens" in msg
    assert "model.max_seq_length = 1000" in msg and "data.pack: false" in msg
    with pytest.raises(DataError, match="eval split.*data.eval_fraction"):
        build_chat_datasets(convs(*[MULTI] * 10, SINGLE), tok, n + 1, pack=True, eval_fraction=0.05)
    with pytest.raises(DataError, match="no conversations"):
        build_chat_datasets([], tok, 16, pack=False, eval_fraction=0.0)


# ---------------------------------------------------------------- loading
