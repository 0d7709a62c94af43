"""Speech out of a trained Higgs Audio v2 run: `lockstep sample RUN --text "..." [--reference voice.wav]`.

The prompt is the training format (lockstep.data.audio_chatml): a system turn, optionally a reference voice as
an earlier assistant clip, the user's text, then the assistant header and <|audio_out_bos|>. The model generates
code frames until it emits the stream-eos code (it learned to: assistant clips end with it in training), or
until a cap that grows with the text (speech runs at ~15 characters a second; the cap allows 1.5 times that
plus half a second), and the codec decodes them into a wav at its own rate.
What `lockstep sample` prints says which of the two ended it: speech cut at the cap is what an
undertrained model, or a text too long for the cap, gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lockstep.config import Config
from lockstep.errors import ConfigError

SYSTEM = "Generate audio following instruction."  # what lockstep's TTS recipe trains with
CHARS_PER_SECOND = 15.0


def load_trained_tts(source: Path, cfg: Config):
    """(model with any adapters merged, tokenizer, frozen codec) from a checkpoint or a directory lockstep wrote."""
    from lockstep.models.higgs import build_higgs_model, load_codec
    from lockstep.tools.trained import HF_INFO, load_trained_hf, resolve_trained

    trained = resolve_trained(source)
    info = source / HF_INFO
    codec_path = (
        (json.loads(info.read_text()).get("audio_tokenizer_path") if info.is_file() else None)
        or trained.cfg.model.audio_tokenizer_path
        or cfg.model.audio_tokenizer_path
    )
    if not codec_path:
        raise ConfigError(
            f"{source} does not say which codec decodes its audio (model.audio_tokenizer_path); "
            "sample from the run directory or a checkpoint of a text-to-speech run"
        )
    model, processor = load_trained_hf(trained, build=build_higgs_model)
    return model, processor.tokenizer, load_codec(codec_path)


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
        ids += (
            [tokens.audio_bos]
            + [tokens.audio] * (n - (tokens.codebooks - 1))
            + [tokens.delay] * (tokens.codebooks - 1)
            + [tokens.audio_eos]
            + enc("<|eot_id|>")
        )
        frames = torch.from_numpy(frames)
    ids += turn("user", text) + enc("<|eot_id|>") + turn("assistant") + [tokens.audio_bos]
    return ids, frames


@dataclass
class Spoken:
    """What `lockstep sample --text` wrote, and whether the model finished the utterance."""

    path: Path
    seconds: float  # the wav's duration
    ended: bool  # the model emitted end-of-speech; False: generation stopped at the cap
    cap_frames: int  # the most code frames generation was allowed for this text
    cap_seconds: float  # those frames' duration at the codec's frame rate

    def describe(self) -> str:
        """One line for the user: where the speech went, how long it is, and why it stopped."""
        if self.ended:
            return f"wrote {self.path} ({self.seconds:.1f} s, ended at end-of-speech)"
        return (
            f"wrote {self.path} ({self.seconds:.1f} s); stopped at the length cap of "
            f"{self.cap_frames} frames ({self.cap_seconds:.1f} s) before the model emitted "
            "end-of-speech: the model may be undertrained, or the text too long for the cap"
        )


def speak_from_checkpoint(
    source: Path,
    cfg: Config,
    text: str,
    out: Path,
    reference: Path | None = None,
    reference_text: str = "",
    seed: int = 0,
) -> Spoken:
    """Write `out` (a wav at the codec's rate) speaking `text` with the model of `source`."""
    if not text.strip():
        raise ConfigError("--text is empty; give the sentence to speak, e.g. --text 'Hello there.'")
    model, tokenizer, codec = load_trained_tts(Path(source), cfg)
    return speak(
        model,
        tokenizer,
        codec,
        text,
        out,
        reference=reference,
        reference_text=reference_text,
        seed=seed,
    )


def speak(
    model,
    tokenizer,
    codec,
    text: str,
    out: Path,
    *,
    reference: Path | None = None,
    reference_text: str = "",
    seed: int = 0,
) -> Spoken:
    """speak_from_checkpoint with the model, its tokenizer and the codec already loaded."""
    import soundfile as sf

    from lockstep.data.audio_chatml import HiggsTokens
    from lockstep.data.codes import AudioRef, decode_clip
    from lockstep.models.higgs import synthesize

    tokens = HiggsTokens.of(tokenizer, model.config)
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
    speech = synthesize(model, codec, tokenizer, ids, frames, max_new_frames=cap)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(out, speech.wave.numpy(), rate)
    return Spoken(out, len(speech.wave) / rate, speech.ended, cap, cap / fps)
