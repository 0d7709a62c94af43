"""lockstep/tools/speak.py: a trained TTS run (its HF directory or a checkpoint) speaks a text into a wav whose length
follows the text, with or without a reference voice, and says whether the model ended the speech
or the length cap did."""

from __future__ import annotations

import pytest
import soundfile as sf
import torch

from lockstep.errors import ConfigError
from lockstep.tools.export import checkpoint_config, load_verified_checkpoint
from lockstep.tools.speak import (
    CHARS_PER_SECOND,
    load_trained_tts,
    speak,
    speak_from_checkpoint,
    speech_prompt,
)

from .output_bias import set_output_bias


@pytest.fixture(scope="module")
def trained(tts_run):
    return tts_run  # the session's 2-step LoRA run of the tiny Higgs (tests/unit/conftest.py)


def _seconds(path) -> float:
    info = sf.info(path)
    assert info.samplerate == 24000  # the codec's rate
    return info.duration


def test_speech_from_the_final_directory_and_from_a_checkpoint(trained, tmp_path):
    ckpt = trained / "checkpoints" / "step_00000002"
    cfg = checkpoint_config(load_verified_checkpoint(ckpt))
    short, long = (
        "hello there",
        "the quick brown fox jumps over the lazy dog, and then it jumps again",
    )
    a = _seconds(speak_from_checkpoint(trained / "final", cfg, short, tmp_path / "a.wav").path)
    b = _seconds(speak_from_checkpoint(ckpt, cfg, short, tmp_path / "b.wav").path)
    c = _seconds(speak_from_checkpoint(ckpt, cfg, long, tmp_path / "c.wav").path)
    assert a == b  # greedy, the same weights: the same audio
    assert 0 < a <= 1.5 * len(short) / CHARS_PER_SECOND + 0.5 + 0.4
    # a longer text may speak longer, never past the cap
    assert a < c <= 1.5 * len(long) / CHARS_PER_SECOND + 0.5 + 0.4
    with pytest.raises(ConfigError, match="--text is empty"):
        speak_from_checkpoint(ckpt, cfg, " ", tmp_path / "d.wav")


def test_a_reference_voice_goes_in_as_codes_before_the_text(trained, tiny_tts, tmp_path):  # noqa: F811
    ckpt = trained / "checkpoints" / "step_00000002"
    cfg = checkpoint_config(load_verified_checkpoint(ckpt))
    out = speak_from_checkpoint(
        ckpt,
        cfg,
        "hello there",
        tmp_path / "r.wav",
        reference=tiny_tts.data.parent / "wavs" / "utt1.wav",
    )
    assert _seconds(out.path) > 0
    from transformers import AutoTokenizer

    from lockstep.data.audio_chatml import HiggsTokens
    from lockstep.models.higgs import build_higgs_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_tts.model)
    tokens = HiggsTokens.of(tokenizer, build_higgs_model(cfg.model).config)
    codes = torch.randint(0, 1024, (8, 5)).numpy()
    ids, frames = speech_prompt(tokenizer, tokens, "hi", codes, "ref words")
    assert ids[-1] == tokens.audio_bos and frames.shape == (5 + 8 + 1, 8)
    # one placeholder per frame
    assert sum(i in (tokens.audio, tokens.delay) for i in ids) == frames.shape[0]
    assert "ref words" in tokenizer.decode(ids) and "hi" in tokenizer.decode(ids)


def test_it_says_whether_the_model_ended_the_speech_or_the_length_cap_cut_it(trained, tmp_path):
    ckpt = trained / "checkpoints" / "step_00000002"
    cfg = checkpoint_config(load_verified_checkpoint(ckpt))
    model, tokenizer, codec = load_trained_tts(ckpt, cfg)
    # 11 characters: a cap of 25 frames/s * (1.5 * 11 / 15 + 0.5) s + 8 codebooks = 48 frames
    text = "hello there"
    # 2 steps of training: the model has not learned to end its speech, and greedy decoding never
    # does
    cut = speak(model, tokenizer, codec, text, tmp_path / "cut.wav")
    assert (cut.ended, cut.cap_frames, cut.cap_seconds) == (False, 48, 48 / 25)
    assert cut.seconds == _seconds(cut.path) > 0
    assert cut.describe() == (
        f"wrote {tmp_path / 'cut.wav'} ({cut.seconds:.1f} s); stopped at the length cap of 48 "
        "frames (1.9 s) before the model emitted end-of-speech: the model may be undertrained, or "
        "the text too long for the cap"
    )
    # the same model with an output bias that makes the last codebook's stream-eos code certain
    # as soon as that codebook may speak: the model ends its speech, and the stream closes within
    # the delay pattern
    set_output_bias(model, [model.config.num_codebooks - 1], model.config.audio_stream_eos_id)
    ended = speak(model, tokenizer, codec, text, tmp_path / "ended.wav")
    assert ended.ended and ended.cap_frames == 48
    assert 0 < ended.seconds == _seconds(ended.path) < cut.seconds
    assert (
        ended.describe()
        == f"wrote {tmp_path / 'ended.wav'} ({ended.seconds:.1f} s, ended at end-of-speech)"
    )
