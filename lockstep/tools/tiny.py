"""Tiny random Hugging Face models built and saved locally, for tests, examples and smoke runs (no downloads).

`save_tiny_llama(dir)` writes a LlamaForCausalLM (hidden 64, 2 layers) with a byte-level BPE
tokenizer that has a ChatML chat template; `save_tiny_whisper(dir)` writes a
WhisperForConditionalGeneration with a 1-second feature extractor and the same kind of tokenizer.
"""

from __future__ import annotations

from pathlib import Path

# The ChatML template the Qwen/Llama-3 families use, reduced to what the tests need. `{% generation %}`
# marks assistant text, so `return_assistant_tokens_mask` can find it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TRAIN_TEXT = ("the quick brown fox jumps over the lazy dog. hello, how are you? i am fine, thank you. "
              "user assistant system speak a sentence about the weather today. ") * 20


def build_tokenizer(chat_template: str | None = CHATML_TEMPLATE, vocab_size: int = 300):
    """A byte-level BPE tokenizer (trained on a fixed text) as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template:
        fast.chat_template = chat_template
    return fast


def save_tiny_llama(out: Path, chat_template: str | None = CHATML_TEMPLATE, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(chat_template)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)


def save_tiny_whisper(out: Path, seed: int = 0) -> Path:
    """Whisper whose feature extractor takes 1 s of 16 kHz audio (100 frames, 50 encoder positions)."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    tok = build_tokenizer(chat_template=None)
    fe = WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, chunk_length=1, hop_length=160)
    torch.manual_seed(seed)
    cfg = WhisperConfig(vocab_size=len(tok), num_mel_bins=16, d_model=64, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_source_positions=50, max_target_positions=64,
                        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.bos_token_id,
                        suppress_tokens=[], begin_suppress_tokens=[])
    model = WhisperForConditionalGeneration(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    fe.save_pretrained(out)
    return Path(out)
