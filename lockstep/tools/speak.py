"""Speech out of a trained Higgs Audio v2 run: `lockstep sample RUN --text "..." [--reference voice.wav]`.

The prompt is the training format (lockstep.data.audio_chatml): a system turn, optionally a reference voice as
an earlier assistant clip, the user's text, then the assistant header and <|audio_out_bos|>. The model generates
code frames until it emits the stream-eos code (it learned to: assistant clips end with it in training), or
until a cap that grows with the text (speech runs at ~15 characters a second; the cap allows 1.5 times that
plus half a second), and the codec decodes them into a wav at its own rate.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lockstep.config import Config
from lockstep.errors import ConfigError

SYSTEM = "Generate audio following instruction."  # what lockstep's TTS recipe trains with
CHARS_PER_SECOND = 15.0


def load_trained_tts(source: Path, cfg: Config):
    """(model, tokenizer, codec) from an HF directory lockstep wrote (lockstep.json) or a training checkpoint."""
    from lockstep.models.hf import load_hf_processor, load_trainable_state_dict
    from lockstep.models.higgs import build_higgs_model, load_codec

    info = json.loads((source / "lockstep.json").read_text()) if (source / "lockstep.json").is_file() else None
    m = cfg.model
    codec_path = (info or {}).get("audio_tokenizer_path") or m.audio_tokenizer_path
    if not codec_path:
        raise ConfigError(f"{source} does not say which codec decodes its audio (model.audio_tokenizer_path); "
                          "sample from the run directory or a checkpoint of a text-to-speech run")
    if info is not None and info.get("format") in ("full", "merged"):
        m = type(m)(**{**vars(m), "path": str(source), "use_lora": False})
        model = build_higgs_model(m)
    elif info is not None:  # adapter: the base from model.path, the adapters from the directory
        from peft import PeftModel

        model = PeftModel.from_pretrained(build_higgs_model(type(m)(**{**vars(m), "use_lora": False})), str(source))
    else:
        from lockstep.tools.export import load_verified_checkpoint

        model = build_higgs_model(m)
        load_trainable_state_dict(model, load_verified_checkpoint(source).tensors)
    tokenizer = load_hf_processor(type(m)(**{**vars(m), "task": "causal-lm"})).tokenizer
    return model.eval(), tokenizer, load_codec(codec_path)


def speech_prompt(tokenizer, tokens, text: str, reference_codes=None, reference_text: str = ""):
    """(prompt ids, reference frames or None) in the training format, ending with <|audio_out_bos|>."""
    from lockstep.data.audio_chatml import delayed

    def enc(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False)

    def turn(role: str, body: str = "") -> list[int]:
        return enc(f"<|start_header_id|>{role}<|end_header_id|>\n\n{body}")

    ids = enc("<|begin_of_text|>") + turn("system", SYSTEM) + enc("<|eot_id|>")
    frames = None
    if reference_codes is not None:
        frames, _ = delayed(reference_codes, tokens, learned=False)
        n = frames.shape[0]
        ids += turn("user", reference_text) + enc("<|eot_id|>") + turn("assistant")
        ids += [tokens.audio_bos] + [tokens.audio] * (n - (tokens.codebooks - 1)) + [tokens.delay] * (
            tokens.codebooks - 1) + [tokens.audio_eos] + enc("<|eot_id|>")
        frames = torch.from_numpy(frames)
    ids += turn("user", text) + enc("<|eot_id|>") + turn("assistant") + [tokens.audio_bos]
    return ids, frames


def speak_from_checkpoint(source: Path, cfg: Config, text: str, out: Path, reference: Path | None = None,
                          reference_text: str = "", seed: int = 0) -> Path:
    """Write `out` (a wav at the codec's rate) speaking `text`; returns its path."""
    import soundfile as sf

    from lockstep.data.audio_chatml import HiggsTokens
    from lockstep.data.codes import AudioRef, decode_clip
    from lockstep.models.higgs import synthesize

    if not text.strip():
        raise ConfigError("--text is empty; give the sentence to speak, e.g. --text 'Hello there.'")
    model, tokenizer, codec = load_trained_tts(Path(source), cfg)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    tokens = HiggsTokens.of(tokenizer, base.config)
    rate = codec.config.sample_rate
    codes = None
    if reference is not None:
        ref = AudioRef(str(reference), None, None, None, "--reference")
        wave = decode_clip(ref, ref.read_bytes(), rate)
        with torch.no_grad():
            codes = codec.encode(torch.from_numpy(wave)[None, None]).audio_codes[0].numpy()
    ids, frames = speech_prompt(tokenizer, tokens, text, codes, reference_text)
    fps = rate / codec.config.hop_length
    cap = int(fps * (1.5 * len(text) / CHARS_PER_SECOND + 0.5)) + tokens.codebooks
    torch.manual_seed(seed)
    wave = synthesize(model, codec, tokenizer, ids, frames, max_new_frames=cap)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(out, wave.numpy(), rate)
    return out
