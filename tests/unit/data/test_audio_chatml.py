"""lockstep/data/audio_chatml.py: the Higgs project's ChatML read as it writes it (JSON list, JSONL, relative paths,
raw_audio, string / part / list content, start_index), clips in the delay pattern, and a batch the real
HiggsAudioV2ForConditionalGeneration takes."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from lockstep.data.audio_chatml import (
    IGNORE,
    HiggsTokens,
    TTSCollator,
    TTSDataset,
    audio_refs,
    count_audio_targets,
    delayed,
    encode_sample,
    load_tts_samples,
)
from lockstep.data.codes import AudioRef, CodesCache
from lockstep.errors import DataError

TOKENS = HiggsTokens(
    audio_bos=8,
    audio=9,
    delay=11,
    audio_eos=10,
    pad=0,
    codebooks=4,
    stream_bos=1024,
    stream_eos=1025,
)


def _write(path, records, jsonl=False):
    path.write_text("\n".join(json.dumps(r) for r in records) if jsonl else json.dumps(records))
    return str(path)


def test_the_higgs_formats_are_read_with_paths_relative_to_the_file(tmp_path):
    (tmp_path / "d" / "wavs").mkdir(parents=True)
    raw = base64.b64encode(b"RIFF").decode()
    records = [
        {
            "messages": [
                {"role": "system", "content": "Generate audio."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, "there"]},
                {
                    "role": "assistant",
                    "content": {
                        "type": "audio",
                        "audio_url": "wavs/a.wav",
                        "offset": 0.5,
                        "duration": 1.0,
                    },
                },
            ],
            "speaker": "amy",
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "audio", "raw_audio": raw}],
                },  # a reference voice
                {"role": "assistant", "content": [{"type": "audio", "audio_url": "/abs/b.wav"}]},
            ],
            "misc": {"speaker": "bob"},
        },
        {
            "messages": [
                {"role": "user", "content": "Ref"},
                {"role": "assistant", "content": {"type": "audio", "audio_url": "wavs/ref.wav"}},
                {"role": "user", "content": "Now this"},
                {"role": "assistant", "content": {"type": "audio", "audio_url": "wavs/c.wav"}},
            ],
            "start_index": 2,
        },
    ]
    listed = load_tts_samples(_write(tmp_path / "d" / "s.json", records))
    lined = load_tts_samples(_write(tmp_path / "d" / "s.jsonl", records, jsonl=True))
    assert [s.turns for s in listed] == [s.turns for s in lined]
    first = listed[0]
    assert (
        first.speaker == "amy"
        and listed[1].speaker == "bob"
        and first.source.endswith("s.json:sample 0")
    )
    assert first.turns[1] == ("user", ["Hi", "there"], False)
    clip = first.turns[2][1][0]
    assert clip == AudioRef(str(tmp_path / "d" / "wavs" / "a.wav"), None, 0.5, 1.0, clip.source)
    assert listed[1].turns[0][1][0].raw == raw and listed[1].turns[1][1][0].url == "/abs/b.wav"
    # start_index: the earlier assistant clip is context (a voice to imitate), only the later one is learned
    assert [learned for _, _, learned in listed[2].turns] == [False, False, False, True]
    assert len(audio_refs(listed)) == 5


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            },
            "no assistant audio to learn",
        ),
        ({"messages": [{"role": "human", "content": "hi"}]}, "role 'human' is not one of"),
        ({"messages": [{"role": "assistant", "content": {"type": "audio"}}]}, "needs audio_url"),
        (
            {"messages": [{"role": "assistant", "content": {"type": "image", "url": "x"}}]},
            "a content part is",
        ),
        ({"conversation": []}, "non-empty 'messages' list"),
    ],
)
def test_bad_samples_are_named_with_their_place(tmp_path, record, message):
    path = _write(tmp_path / "s.json", [record])
    with pytest.raises(DataError, match=message) as e:
        load_tts_samples(path)
    assert "s.json:sample 0" in str(e.value)


def test_delay_pattern_gives_every_codebook_the_same_targets():
    codes = np.arange(4 * 5).reshape(4, 5)
    frames, labels = delayed(codes, TOKENS, learned=True)
    assert frames.shape == labels.shape == (5 + 4 + 1, 4)
    for i in range(4):  # codebook i: i + 1 bos, the 5 codes, then eos
        assert (frames[: i + 1, i] == 1024).all() and list(frames[i + 1 : i + 6, i]) == list(
            codes[i]
        )
        assert (frames[i + 6 :, i] == 1025).all()
        # codes + the one stop code
        assert list(labels[:, i][labels[:, i] != IGNORE]) == [*codes[i], 1025]
    assert ((labels != IGNORE).sum(0) == 6).all()
    _, context = delayed(codes, TOKENS, learned=False)
    assert (context == IGNORE).all()


def test_a_batch_the_real_model_takes_and_its_target_count(tiny_tts, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer, HiggsAudioV2ForConditionalGeneration

    model = HiggsAudioV2ForConditionalGeneration.from_pretrained(tiny_tts.model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tts.model)
    tokens = HiggsTokens.of(tokenizer, model.config)
    samples = load_tts_samples(str(tiny_tts.data))[:3]
    cache = CodesCache(tmp_path, "fp")
    rng = np.random.default_rng(0)
    keys = {}
    for i, ref in enumerate(audio_refs(samples)):
        cache.save(f"k{i}", rng.integers(0, 1024, size=(8, 3 + 2 * i)))
        keys[ref] = f"k{i}"
    encoded = [encode_sample(s, keys, cache, tokenizer, tokens) for s in samples]
    ds = TTSDataset(encoded, cache, tokens)
    items = [ds[i] for i in range(3)]
    assert (
        [len(it["input_ids"]) for it in items] == [e.length for e in encoded] == list(ds.lengths())
    )
    for it in items:  # one placeholder token per frame
        placeholders = ((it["input_ids"] == tokens.audio) | (it["input_ids"] == tokens.delay)).sum()
        assert placeholders == len(it["frames"])
    batch = TTSCollator(tokens)(items)
    assert "labels" not in batch and batch["audio_input_ids_mask"].sum() == sum(
        len(it["frames"]) for it in items
    )
    # codes + stop, per codebook
    assert count_audio_targets(batch) == sum(3 + 2 * i + 1 for i in range(3))
    out = model(**batch)
    assert torch.isfinite(out.loss) and out.loss > 8 * 5  # 8 codebooks of ~ln(1026) each, untrained
    # a dropped clip drops its sample
    assert encode_sample(samples[0], {}, cache, tokenizer, tokens) is None
