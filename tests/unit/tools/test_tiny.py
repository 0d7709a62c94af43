"""lockstep/tools/tiny.py: the tiny random Hugging Face models the tests and examples build locally. The tokenizer
round-trips text and its ChatML template marks the assistant's text; the Llama and Whisper it saves load back
with the stock Auto classes and run."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lockstep.tools.tiny import SPECIAL, build_tokenizer, save_tiny_llama, save_tiny_whisper  # noqa: E402


def test_tokenizer_round_trips_text_and_knows_the_chat_tokens():
    tok = build_tokenizer()
    text = "the quick brown fox? i am fine, thank you. Grüße"  # the last word is outside the training text
    assert tok.decode(tok.encode(text)) == text
    # merges learned from TRAIN_TEXT
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")
    assert tok.convert_tokens_to_ids(SPECIAL) == [0, 1, 2, 3, 4]
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", "</s>")
    assert len(tok) <= 300 and build_tokenizer(chat_template=None).chat_template is None


def test_chat_template_is_chatml_and_marks_the_assistants_text():
    tok = build_tokenizer()
    chat = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "fine"}]},
    ]
    assert (
        tok.apply_chat_template(chat, tokenize=False)
        == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nfine<|im_end|>\n"
    )
    assert tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n"
    )
    out = tok.apply_chat_template(
        chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(marked) == "fine<|im_end|>"


def test_tiny_llama_loads_back_and_is_seeded(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = save_tiny_llama(tmp_path / "llama", seed=3)
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (
        64,
        2,
        2,
        len(tok),
    )
    assert tok.chat_template is not None and tok.pad_token_id == cfg.pad_token_id == 0
    ids = torch.tensor([tok.encode("hello, how are you?")])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    again = AutoModelForCausalLM.from_pretrained(
        save_tiny_llama(tmp_path / "again", seed=3)
    ).state_dict()
    # the seed fixes the weights
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


def test_tiny_whisper_takes_one_second_of_audio(tmp_path):
    from transformers import AutoFeatureExtractor, WhisperForConditionalGeneration

    out = save_tiny_whisper(tmp_path / "whisper")
    model = WhisperForConditionalGeneration.from_pretrained(out)
    features = AutoFeatureExtractor.from_pretrained(out)(
        torch.zeros(16000).numpy(), sampling_rate=16000, return_tensors="pt"
    ).input_features
    assert features.shape == (1, 16, 100)  # 16 mel bins, 100 frames of 10 ms
    logits = model(input_features=features, decoder_input_ids=torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, model.config.vocab_size)
