"""lockstep/models/higgs.py: the codec loads without torchaudio (soxr stands in, and says so), is frozen, and must
fit the model; the model's loss is the sum over its codebooks; frames decode back to audio;
synthesize says whether the model ended its speech or the frame cap cut it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import soxr
import torch

from lockstep.config import ModelConfig
from lockstep.errors import ConfigError
from lockstep.models.higgs import (
    _soxr_resample,
    build_higgs_model,
    check_codec,
    decode_frames,
    load_codec,
    synthesize,
)

from ..tools.output_bias import set_output_bias


def test_the_fallback_resamples_as_soxr_does_and_keeps_shape_and_dtype():
    x = torch.randn(2, 1, 24000)
    y = _soxr_resample(x, 24000, 16000)
    assert y.shape == (2, 1, 16000) and y.dtype == x.dtype
    np.testing.assert_allclose(
        y[1, 0].numpy(), soxr.resample(x[1, 0].numpy(), 24000, 16000), rtol=1e-6
    )


def test_a_fresh_process_without_torchaudio_loads_the_codec_and_logs_the_fallback(tiny_tts):  # noqa: F811
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "import transformers  # imported first, as a user script would: its backend check is cached\n"
        "from lockstep.models.higgs import load_codec\n"
        f"codec = load_codec({str(tiny_tts.codec)!r})\n"
        "import torch; print('codes', tuple(codec.encode(torch.randn(1, 1, 24000)).audio_codes.shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    try:
        import torchaudio  # noqa: F401
    except ImportError:
        assert "runs through soxr instead" in out.stdout
    assert "codes (1, 8, 25)" in out.stdout  # 8 codebooks, 25 frames a second at 24 kHz


def test_the_codec_is_frozen_and_checked_against_the_model(tiny_tts, tiny_llama, tmp_path):
    codec = load_codec(str(tiny_tts.codec))
    assert not codec.training and not any(p.requires_grad for p in codec.parameters())
    config = json.loads((tiny_tts.model / "config.json").read_text())
    model = build_higgs_model(ModelConfig(kind="hf", path=str(tiny_tts.model), use_lora=True))
    check_codec(model.config, codec, "m", "c")  # the tiny pair fits
    assert config["codebook_size"] == 1026  # 1024 codes + the stream bos/eos codes
    small = type(model.config)(**{**model.config.to_dict(), "codebook_size": 1024})
    with pytest.raises(ConfigError, match="needs the codec's codes plus those two"):
        check_codec(small, codec, "m", "c")
    fewer = type(model.config)(**{**model.config.to_dict(), "num_codebooks": 4})
    with pytest.raises(ConfigError, match="encodes 8 codebooks, but model.path = 'm' predicts 4"):
        check_codec(fewer, codec, "m", "c")
    llama = tiny_llama
    with pytest.raises(ConfigError, match="holds a 'llama' model, not a Higgs Audio v2 tokenizer"):
        load_codec(str(llama))
    with pytest.raises(ConfigError, match="needs a Higgs Audio v2 model"):
        build_higgs_model(ModelConfig(kind="hf", path=str(llama)))
    with pytest.raises(ConfigError, match="does not exist"):
        load_codec(str(tmp_path / "nowhere"))


def test_loss_is_the_sum_of_the_codebooks_losses(tiny_tts):  # noqa: F811
    model = build_higgs_model(ModelConfig(kind="hf", path=str(tiny_tts.model)))
    c = model.config
    torch.manual_seed(0)
    n = 6
    ids = torch.tensor([[1, 2, 3, c.audio_bos_token_id, *[c.audio_token_id] * n, 4]])
    frames = torch.randint(0, 1024, (1, n, c.num_codebooks))
    labels = frames.clone()
    labels[0, 0] = -100
    batch = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        audio_input_ids=frames,
        audio_input_ids_mask=torch.ones(1, n, dtype=torch.bool),
        audio_labels=labels,
    )
    out = model(**batch)
    logits = out.logits.reshape(1, ids.shape[1], c.num_codebooks, c.codebook_size)
    start = 4  # the first placeholder; logits at t predict the label at t + 1
    by_hand = sum(
        torch.nn.functional.cross_entropy(logits[0, start : start + n - 1, k], labels[0, 1:, k])
        for k in range(c.num_codebooks)
    )
    torch.testing.assert_close(out.loss, by_hand, rtol=1e-5, atol=1e-5)
    count = int((labels[0, 1:, 0] != -100).sum())
    summed = model(
        **batch, num_items_in_batch=torch.tensor(1)
    ).loss  # sum form: lockstep divides by the count
    torch.testing.assert_close(summed / count, out.loss, rtol=1e-5, atol=1e-5)


def test_frames_decode_between_the_stream_markers(tiny_tts):  # noqa: F811
    codec = load_codec(str(tiny_tts.codec))
    config = build_higgs_model(ModelConfig(kind="hf", path=str(tiny_tts.model))).config
    k, t = config.num_codebooks, 10
    codes = torch.randint(0, 1024, (k, t))
    delayed = torch.full((t + k + 1, k), config.audio_stream_eos_id)
    for i in range(k):
        delayed[: i + 1, i] = config.audio_stream_bos_id
        delayed[i + 1 : i + 1 + t, i] = codes[i]
    wave = decode_frames(torch.cat([torch.full((1, k), 1024), delayed]), codec, config)
    direct = codec.decode(codes[None]).audio_values.reshape(-1)
    torch.testing.assert_close(wave, direct)  # the same audio as decoding the undelayed codes
    assert len(wave) == t * 960


def test_synthesize_says_whether_the_model_ended_its_speech_or_the_cap_did(tiny_tts):  # noqa: F811
    from transformers import AutoTokenizer

    from lockstep.data.audio_chatml import HiggsTokens
    from lockstep.tools.speak import speech_prompt

    codec = load_codec(str(tiny_tts.codec))
    model = build_higgs_model(ModelConfig(kind="hf", path=str(tiny_tts.model))).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_tts.model)
    c = model.config
    reference = torch.randint(0, 1024, (c.num_codebooks, 5)).numpy()
    ids, ref = speech_prompt(tokenizer, HiggsTokens.of(tokenizer, c), "hi", reference, "ref words")
    # the reference clip ends with an all-eos frame of its own
    assert (ref == c.audio_stream_eos_id).all(-1).any()
    # code 5 certain in every codebook: the model never ends its speech
    set_output_bias(model, range(c.num_codebooks), 5)
    cut = synthesize(model, codec, tokenizer, ids, ref, max_new_frames=20)
    assert not cut.ended and len(cut.wave) > 0
    # the last codebook's stream-eos certain: the model ends its speech once that codebook speaks
    set_output_bias(model, [c.num_codebooks - 1], c.audio_stream_eos_id)
    ended = synthesize(model, codec, tokenizer, ids, ref, max_new_frames=20)
    assert ended.ended and len(ended.wave) < len(cut.wave)


def test_a_4bit_higgs_base_is_refused_rather_than_loaded_in_full_precision(tiny_tts):  # noqa: F811
    cfg = ModelConfig(kind="hf", path=str(tiny_tts.model), use_lora=True, load_in_4bit=True)
    with pytest.raises(
        ConfigError,
        match=r"model.load_in_4bit is not supported for the Higgs Audio v2 "
        r"text-to-speech model; drop --load-in-4bit",
    ):
        build_higgs_model(cfg)
