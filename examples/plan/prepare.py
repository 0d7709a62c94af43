"""Write the config.json of the seeds' large models, for `lockstep plan` (README.md here).

    python prepare.py     # ./higgs-audio-v2-3b/config.json, ./whisper-small/config.json

A plan reads a Hugging Face model's config.json only, never its weights, so these two files stand in
for the 3B and 244M checkpoints a team would have in its local cache:

- Higgs Audio v2 3B: transformers' HiggsAudioV2Config defaults, which are the released
  bosonai/higgs-audio-v2-generation-3B-base (a Llama-3.2-3B backbone: 28 layers of width 3,072, 24
  heads, 8 key-value heads; 8 codebooks of 1,024 codes);
- Whisper small: openai/whisper-small's published config.json values (12 + 12 layers of width 768,
  12 heads, FFN 3,072, 80 mel bins, 51,865 tokens).
"""

from __future__ import annotations

from pathlib import Path

WHISPER_SMALL = dict(
    d_model=768,
    encoder_layers=12,
    decoder_layers=12,
    encoder_attention_heads=12,
    decoder_attention_heads=12,
    encoder_ffn_dim=3072,
    decoder_ffn_dim=3072,
    num_mel_bins=80,
    vocab_size=51865,
    max_source_positions=1500,
    max_target_positions=448,
    architectures=["WhisperForConditionalGeneration"],
)


def main(out: Path = Path(".")) -> dict[str, Path]:
    from transformers import HiggsAudioV2Config, WhisperConfig

    dirs = {"higgs": out / "higgs-audio-v2-3b", "whisper": out / "whisper-small"}
    higgs = HiggsAudioV2Config()
    higgs.architectures = ["HiggsAudioV2ForConditionalGeneration"]
    higgs.save_pretrained(dirs["higgs"])
    WhisperConfig(**WHISPER_SMALL).save_pretrained(dirs["whisper"])
    return dirs


if __name__ == "__main__":
    for path in main().values():
        print(f"wrote {path / 'config.json'}")
