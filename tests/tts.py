"""A tiny Higgs Audio v2 model, its codec and a Higgs-format ChatML fixture, built once per test session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class TinyTTS:
    model: Path  # HiggsAudioV2ForConditionalGeneration + tokenizer
    codec: Path  # HiggsAudioV2TokenizerModel, random codebooks
    data: Path  # train_chatml_samples.json (8 samples; wavs/ beside it)


@pytest.fixture(scope="session")
def tiny_tts(tmp_path_factory) -> TinyTTS:
    from lockstep.tools.tiny import save_tiny_higgs, save_tiny_higgs_codec, write_tts_fixture

    root = tmp_path_factory.mktemp("tts")
    return TinyTTS(
        save_tiny_higgs(root / "model"),
        save_tiny_higgs_codec(root / "codec"),
        write_tts_fixture(root / "data"),
    )
