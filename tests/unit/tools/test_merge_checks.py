"""lockstep/tools/merge_checks.py through `lockstep merge`: inputs that are not copies of one model (another
vocabulary, width, depth, a setting that changes no shape, another tokenizer) refused before anything is
written, each naming what differs and where."""

from __future__ import annotations

import pytest
from conftest import run_main

from lockstep.errors import CheckpointError
from lockstep.tools.merge import merge_checkpoints

from .test_merge import TOKENIZER, save_gpt


def test_different_vocabularies_are_refused(tmp_path):
    a, b = save_gpt(tmp_path / "a", seed=1), save_gpt(tmp_path / "b", seed=2, vocab_size=300)
    with pytest.raises(CheckpointError) as e:
        merge_checkpoints([a, b], tmp_path / "out", log=lambda _: None)
    msg = str(e.value)
    assert "tok_emb.weight" in msg and "(256, 32)" in msg and "(300, 32)" in msg
    assert "vocabularies differ (model.vocab_size 256" in msg and "300 in" in msg
    assert not (tmp_path / "out").exists()


def test_different_hidden_sizes_name_the_hidden_size_not_the_vocabulary(tmp_path, capsys):
    a, b = save_gpt(tmp_path / "a", seed=1), save_gpt(tmp_path / "b", seed=2, hidden_size=48)
    code, _, err = run_main(capsys, "merge", str(a), str(b), "-o", str(tmp_path / "out"))
    assert code == 1 and "Traceback" not in err, err
    msg = err.strip()
    assert msg == (
        f"lockstep merge: error: tensor tok_emb.weight has shape (256, 32) in {a} but (256, 48) in {b}: "
        f"model.hidden_size is 32 in {a} but 48 in {b}; merge only copies of one model trained with the "
        "same model settings"
    )
    assert not (tmp_path / "out").exists()
    # both differ: each is named, by the dimension it sizes
    c = save_gpt(tmp_path / "c", seed=3, hidden_size=48, vocab_size=300)
    with pytest.raises(CheckpointError) as e:
        merge_checkpoints([a, c], tmp_path / "out", log=lambda _: None)
    assert "(256, 32) in" in str(e.value) and "(300, 48) in" in str(e.value)
    assert "the vocabularies differ (model.vocab_size 256 in" in str(
        e.value
    ) and "model.hidden_size is 32" in str(e.value)
    # a longer context shows in the position embedding
    d = save_gpt(tmp_path / "d", seed=4, max_seq_length=32)
    with pytest.raises(
        CheckpointError,
        match=r"tensor pos_emb\.weight has shape \(16, 32\) in .* but \(32, 32\) in "
        r".*: model\.max_seq_length is 16 in .* but 32 in",
    ):
        merge_checkpoints([a, d], tmp_path / "out", log=lambda _: None)


def test_different_depth_names_the_first_differing_tensor(tmp_path):
    a, b = save_gpt(tmp_path / "a", seed=1), save_gpt(tmp_path / "b", seed=2, layers=3)
    with pytest.raises(
        CheckpointError,
        match=rf"tensor blocks\.2\.\S+ is in {b} but not in {a} .*"
        r"model\.layers is 2 in .* but 3 in",
    ):
        merge_checkpoints([a, b], tmp_path / "out", log=lambda _: None)


def test_settings_that_change_no_shape_are_refused(tmp_path):
    a, b = save_gpt(tmp_path / "a", seed=1), save_gpt(tmp_path / "b", seed=2, attention_heads=4)
    with pytest.raises(
        CheckpointError, match=r"model\.attention_heads is 2 in .* but 4 in .*mean different things"
    ):
        merge_checkpoints([a, b], tmp_path / "out", log=lambda _: None)


def test_different_tokenizers_are_refused(tmp_path):
    a = save_gpt(tmp_path / "a", seed=1, extra={"tokenizer.json": TOKENIZER})
    b = save_gpt(tmp_path / "b", seed=2, extra={"tokenizer.json": b'{"other": "bpe"}'})
    with pytest.raises(CheckpointError, match=r"same token id\s+means different text"):
        merge_checkpoints([a, b], tmp_path / "out", log=lambda _: None)
    c = save_gpt(tmp_path / "c", seed=3)  # the byte tokenizer: no tokenizer.json
    with pytest.raises(
        CheckpointError, match=r"with the byte tokenizer \(no tokenizer.json\) but .* with a BPE"
    ):
        merge_checkpoints([a, c], tmp_path / "out", log=lambda _: None)
