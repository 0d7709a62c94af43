"""Tiny random Hugging Face models built and saved locally, for tests, examples and smoke runs (no downloads).

`save_tiny_llama(dir)` writes a LlamaForCausalLM (hidden 64, 2 layers) with a byte-level BPE
tokenizer that has a ChatML chat template; `save_tiny_whisper(dir)` writes a
WhisperForConditionalGeneration with a 1-second feature extractor and the same kind of tokenizer;
`save_tiny_higgs(dir)` and `save_tiny_higgs_codec(dir)` write a Higgs Audio v2 text-to-speech model and its
audio tokenizer in the released layout (8 codebooks of 1024 codes, 25 frames/s at 24 kHz) at tiny widths, and
`write_tts_fixture(dir)` synthetic voices with a Higgs-format ChatML file.
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
TRAIN_TEXT = (
    "the quick brown fox jumps over the lazy dog. hello, how are you? i am fine, thank you. "
    "user assistant system speak a sentence about the weather today. "
) * 20


def build_tokenizer(chat_template: str | None = CHATML_TEMPLATE, vocab_size: int = 300):
    """A byte-level BPE tokenizer (trained on a fixed text) as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template:
        fast.chat_template = chat_template
    return fast


def save_tiny_llama(out: Path, chat_template: str | None = CHATML_TEMPLATE, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(chat_template)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)


def save_tiny_whisper(out: Path, seed: int = 0) -> Path:
    """Whisper whose feature extractor takes 1 s of 16 kHz audio (100 frames, 50 encoder positions)."""
    import torch
    from tokenizers.processors import TemplateProcessing
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    tok = build_tokenizer(chat_template=None)
    # transcripts end with the end-of-text token, as Whisper's own tokenizer ends them: a model whose labels
    # never end never learns to stop, and transcribes every clip up to its length limit
    tok._tokenizer.post_processor = TemplateProcessing(
        single=f"$A {tok.eos_token}", special_tokens=[(tok.eos_token, tok.eos_token_id)]
    )
    fe = WhisperFeatureExtractor(
        feature_size=16, sampling_rate=16000, chunk_length=1, hop_length=160
    )
    torch.manual_seed(seed)
    cfg = WhisperConfig(
        vocab_size=len(tok),
        num_mel_bins=16,
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=50,
        max_target_positions=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.bos_token_id,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    model = WhisperForConditionalGeneration(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    fe.save_pretrained(out)
    return Path(out)


# ---------------------------------------------------------------- Higgs Audio v2 (text-to-speech)

# the special tokens of the Higgs tokenizer (Llama-3 headers + audio tokens) that lockstep's audio ChatML uses
HIGGS_SPECIAL = [
    "<|end_of_text|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|audio_bos|>",
    "<|AUDIO|>",
    "<|audio_out_bos|>",
    "<|AUDIO_OUT|>",
    "<|audio_eos|>",
    "<|reserved_special_token_6|>",
]


def save_tiny_higgs_codec(out: Path, seed: int = 0, sample_rate: int = 24000) -> Path:
    """A HiggsAudioV2TokenizerModel with the real layout (8 codebooks of 1024, 25 frames/s at 24 kHz), tiny widths.

    A freshly built codec has all-zero codebooks (every clip encodes to code 0); these are random, so
    different audio gives different codes.
    """
    import torch
    from transformers import HiggsAudioV2TokenizerConfig

    from lockstep.models.higgs import codec_class

    ratios = [8, 5, 4, 2, 3]  # hop 960: 25 frames/s at 24 kHz
    cfg = HiggsAudioV2TokenizerConfig(
        sample_rate=sample_rate,
        target_bandwidths=[0.5, 1, 2],
        codebook_size=1024,
        codebook_dim=8,
        acoustic_model_config=dict(
            encoder_hidden_size=8,
            downsampling_ratios=ratios,
            decoder_hidden_size=64,
            upsampling_ratios=ratios,
            hidden_size=16,
        ),  # decoder widths halve 5 times
        semantic_model_config=dict(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            conv_dim=[16] * 7,
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
        ),
    )
    torch.manual_seed(seed)
    codec = codec_class()(cfg)
    with torch.no_grad():
        for name, buf in codec.named_buffers():
            if name.endswith("codebook.embed"):
                buf.copy_(torch.randn_like(buf))
    codec.save_pretrained(out)
    return Path(out)


def save_tiny_higgs(out: Path, seed: int = 0, hidden_size: int = 64, layers: int = 2) -> Path:
    """A HiggsAudioV2ForConditionalGeneration for a 1024-code, 8-codebook codec, with its tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        HiggsAudioV2Config,
        HiggsAudioV2ForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TRAIN_TEXT],
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=HIGGS_SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|end_of_text|>",
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in HIGGS_SPECIAL}
    cfg = HiggsAudioV2Config(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=2048,
        pad_token_id=ids["<|end_of_text|>"],
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<|eot_id|>"],
        num_codebooks=8,
        codebook_size=1026,  # 1024 codes + the stream bos/eos codes 1024/1025
        audio_token_id=ids["<|AUDIO_OUT|>"],
        audio_bos_token_id=ids["<|audio_out_bos|>"],
        audio_delay_token_id=ids["<|reserved_special_token_6|>"],
    )
    torch.manual_seed(seed)
    HiggsAudioV2ForConditionalGeneration(cfg).save_pretrained(out)
    fast.save_pretrained(out)
    return Path(out)


def write_tts_fixture(out: Path, samples: int = 8, seed: int = 0, rate: int = 24000) -> Path:
    """Synthetic voices (tones whose pitch and length follow the text) and a Higgs-format ChatML JSON list.

    Lengths vary (0.4-1.2 s), one wav is at another rate (16 kHz) and one is stereo, so resampling and
    mixing down are exercised. Returns the JSON file's path; wavs are in out/wavs, paths relative to the JSON.
    """
    import json

    import numpy as np
    import soundfile as sf

    rng = np.random.default_rng(seed)
    words = TRAIN_TEXT.split()[:24]
    (out / "wavs").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(samples):
        text = " ".join(words[i % 7 : i % 7 + 3 + i % 4])
        sr = 16000 if i == 1 else rate
        t = np.arange(int(sr * (0.4 + 0.1 * (i % 9)))) / sr
        wave = 0.3 * np.sin(2 * np.pi * (180 + 20 * len(text)) * t) + 0.01 * rng.standard_normal(
            len(t)
        )
        if i == 2:
            wave = np.stack([wave, 0.5 * wave], axis=1)  # stereo
        sf.write(out / "wavs" / f"utt{i}.wav", wave.astype(np.float32), sr)
        records.append(
            {
                "messages": [
                    {"role": "system", "content": "Generate audio following instruction."},
                    {"role": "user", "content": text},
                    {
                        "role": "assistant",
                        "content": {"type": "audio", "audio_url": f"wavs/utt{i}.wav"},
                    },
                ],
                "speaker": f"spk{i % 2}",
            }
        )
    path = out / "train_chatml_samples.json"
    path.write_text(json.dumps(records, indent=1))
    return path
