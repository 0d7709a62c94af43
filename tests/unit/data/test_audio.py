"""Audio manifests, decoding, AudioDataset and AudioCollator (lockstep/data/audio.py), on synthesized WAVs."""

from __future__ import annotations

import json
import logging
import pickle
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch
from torch.utils.data import DataLoader

from lockstep.config import DataConfig
from lockstep.data.audio import (
    AudioCollator,
    AudioDataset,
    build_audio_datasets,
    collate_audio,
    decode_audio,
    load_manifest,
)
from lockstep.errors import DataError

# name: (seconds, sample rate, sine frequency, channels); 8 kHz and 22.05 kHz files exercise resampling
WAVS = {
    "a": (0.3, 16000, 440.0, 1),
    "b": (0.55, 8000, 300.0, 1),
    "c": (0.8, 22050, 1000.0, 1),
    "d": (1.0, 16000, 2000.0, 2),
}
TEXTS = {
    "a": "the quick brown fox",
    "b": "hello, how are you?",
    "c": "i am fine, thank you.",
    "d": "speak a sentence about the weather",
}


def sine(seconds: float, rate: int, freq: float) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def frames(name: str) -> int:
    seconds, rate, _, _ = WAVS[name]
    return round(seconds * rate)


@pytest.fixture
def wavs(tmp_path) -> dict[str, Path]:
    """The four WAVs under tmp_path/wavs; d is stereo (right channel at half the left's amplitude)."""
    (tmp_path / "wavs").mkdir()
    paths = {}
    for name, (seconds, rate, freq, channels) in WAVS.items():
        x = sine(seconds, rate, freq)
        data = x if channels == 1 else np.stack([x, 0.5 * x], axis=1)
        paths[name] = tmp_path / "wavs" / f"{name}.wav"
        sf.write(paths[name], data, rate, subtype="FLOAT")
    return paths


def manifest_rows(names=tuple(WAVS), duration: bool = False) -> list[dict]:
    rows = []
    for i, n in enumerate(names):
        row = {"audio": f"wavs/{n}.wav", "text": TEXTS.get(n, "hello"), "speaker": f"00{i % 2}"}
        if duration:  # every other row leaves its duration for the header probe
            row["duration"] = frames(n) / WAVS[n][1] if i % 2 == 0 and n in WAVS else None
        rows.append(row)
    return rows


def write_manifest(path: Path, rows: list[dict]) -> Path:
    table = pa.Table.from_pylist(rows)
    match path.suffix:
        case ".csv":
            pcsv.write_csv(table, path)
        case ".jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        case ".parquet":
            pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def whisper(tiny_whisper):
    """(model dir, feature extractor, tokenizer) of the tiny local Whisper (1 s of 16 kHz audio)."""
    from transformers import AutoFeatureExtractor, AutoTokenizer

    out = tiny_whisper  # the session's (tests/unit/conftest.py)
    return out, AutoFeatureExtractor.from_pretrained(out), AutoTokenizer.from_pretrained(out)


def dataset(tmp_path, whisper, read_log=None, bad_audio="stop", **cfg) -> AudioDataset:
    _, fe, tok = whisper
    manifest = load_manifest(str(tmp_path / "m.csv"), DataConfig(bad_audio=bad_audio, **cfg))
    return AudioDataset(manifest.rows, fe, tok, bad_audio=bad_audio, read_log=read_log)


# ---------------------------------------------------------------- manifests


def test_three_formats_give_the_same_rows_and_header_durations(tmp_path, wavs, monkeypatch):
    def no_decoding(*a, **k):
        raise AssertionError("load_manifest decoded audio; it must read headers only")

    monkeypatch.setattr(sf, "read", no_decoding)
    loaded = {}
    for suffix in (".csv", ".jsonl", ".parquet"):
        path = write_manifest(tmp_path / f"m{suffix}", manifest_rows())
        m = load_manifest(str(path), DataConfig())
        assert m.files == [path] and m.skipped == []
        assert [r.source for r in m.rows] == [f"{path}:{i}" for i in range(1, 5)]
        loaded[suffix] = [r._replace(source=None) for r in m.rows]
    assert loaded[".csv"] == loaded[".jsonl"] == loaded[".parquet"]
    rows = loaded[".csv"]
    # relative paths resolved to the manifest
    assert [r.audio for r in rows] == [str(wavs[n]) for n in WAVS]
    assert [r.text for r in rows] == list(TEXTS.values())
    assert [r.speaker for r in rows] == [
        "000",
        "001",
        "000",
        "001",
    ]  # CSV strings not parsed as numbers
    for r, n in zip(rows, WAVS, strict=True):
        assert r.duration == pytest.approx(frames(n) / WAVS[n][1], abs=1e-9)


def test_durations_from_column_and_header_agree(tmp_path, wavs, whisper):
    m = load_manifest(
        str(write_manifest(tmp_path / "m.jsonl", manifest_rows(duration=True))), DataConfig()
    )
    want = [frames(n) / WAVS[n][1] for n in WAVS]
    assert [r.duration for r in m.rows] == pytest.approx(want, abs=1e-9)
    ds = AudioDataset(m.rows, whisper[1], whisper[2])
    np.testing.assert_allclose(ds.lengths(), want, atol=1e-9)
    assert ds.lengths().dtype == np.float64


def test_max_files_keeps_the_first_files_of_a_parquet_folder(tmp_path, wavs):
    folder = tmp_path / "parts"
    folder.mkdir()
    for k in range(4):  # part-0 holds a, b; part-1 c, d; part-2 a, b; ...
        names = list(WAVS)[2 * (k % 2) : 2 * (k % 2) + 2]
        rows = [
            dict(r, audio=f"../wavs/{r['audio'].split('/')[1]}", text=f"part {k}")
            for r in manifest_rows(names)
        ]
        write_manifest(folder / f"part-{k}.parquet", rows)
    m = load_manifest(str(folder), DataConfig(max_files=2))
    assert m.files == [folder / "part-0.parquet", folder / "part-1.parquet"]
    assert [r.text for r in m.rows] == ["part 0", "part 0", "part 1", "part 1"]
    assert [r.audio for r in m.rows] == [str(wavs[n]) for n in WAVS]
    assert len(load_manifest(str(folder), DataConfig()).rows) == 8


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_decode_resamples_to_the_target_rate_and_keeps_the_tone(wavs, name):
    _, rate, freq, channels = WAVS[name]
    x = decode_audio(str(wavs[name]), 16000)
    assert x.dtype == np.float32 and x.ndim == 1
    assert abs(len(x) - frames(name) * 16000 / rate) <= 1
    spectrum = np.abs(np.fft.rfft(x))
    assert np.fft.rfftfreq(len(x), 1 / 16000)[spectrum.argmax()] == pytest.approx(
        freq, abs=16000 / len(x)
    )
    if channels == 2:  # the mean of the left (0.5 amplitude) and right (0.25) channels
        assert np.abs(x).max() == pytest.approx(0.375, abs=1e-3)


def test_getitem_decodes_once_and_a_worker_pass_reads_each_file_once(
    tmp_path, wavs, whisper, monkeypatch
):
    write_manifest(tmp_path / "m.csv", manifest_rows())
    log = tmp_path / "reads" / "rank0.txt"
    ds = dataset(tmp_path, whisper, read_log=log)
    reads = Counter()
    real_read = sf.read
    monkeypatch.setattr(
        sf, "read", lambda path, *a, **k: (reads.update([str(path)]), real_read(path, *a, **k))[1]
    )
    sample = ds[1]
    assert reads == {str(wavs["b"]): 1}
    assert log.read_text().splitlines() == [str(wavs["b"])]
    assert set(sample) == {"input_features", "labels"}
    assert sample["input_features"].shape == (16, 100) and sample["labels"].dtype == torch.long
    assert sample["labels"].tolist() == whisper[2](TEXTS["b"]).input_ids
    ds[1]
    assert log.read_text().splitlines() == [str(wavs["b"])] * 2  # one line per call

    log.unlink()
    loader = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=AudioCollator())
    assert sum(len(b["labels"]) for b in loader) == 4
    assert Counter(log.read_text().splitlines()) == {str(p): 1 for p in wavs.values()}


def test_dataset_and_collator_pickle(tmp_path, wavs, whisper):
    write_manifest(tmp_path / "m.csv", manifest_rows())
    ds = pickle.loads(pickle.dumps(dataset(tmp_path, whisper, read_log=tmp_path / "r.txt")))
    collate = pickle.loads(pickle.dumps(AudioCollator(decoder_start_token_id=1)))
    assert collate([ds[0]])["input_features"].shape == (1, 16, 100)


def test_build_audio_datasets_holds_out_the_last_rows(tmp_path, wavs, whisper):
    m = load_manifest(str(write_manifest(tmp_path / "m.csv", manifest_rows())), DataConfig())
    train, ev = build_audio_datasets(
        m, whisper[1], whisper[2], DataConfig(), eval_fraction=0.25, read_log=None
    )
    assert train.rows == m.rows[:3] and ev.rows == m.rows[3:]
    train, ev = build_audio_datasets(
        m, whisper[1], whisper[2], DataConfig(), eval_fraction=0.0, read_log=None
    )
    assert len(train) == 4 and ev is None
    with pytest.raises(
        DataError, match="data.sample_rate = 8000 but the feature extractor expects 16000"
    ):
        build_audio_datasets(m, whisper[1], whisper[2], DataConfig(sample_rate=8000), 0.0, None)


# ---------------------------------------------------------------- batching


def test_collate_pads_strips_the_start_token_and_drops_none():
    collate = AudioCollator(decoder_start_token_id=1)
    batch = collate(
        [
            {"input_values": torch.ones(3), "labels": torch.tensor([1, 5, 6])},
            None,
            {"input_values": torch.ones(5), "labels": torch.tensor([7])},
        ]
    )
    assert batch["input_values"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[5, 6], [7, -100]]
    feats = AudioCollator()(
        [
            {"input_features": torch.ones(2, 3), "labels": torch.tensor([1, 2])},
            {"input_features": torch.ones(2, 4), "labels": torch.tensor([3])},
        ]
    )
    assert (
        feats["input_features"].shape == (2, 2, 4) and feats["input_features"][0, :, 3].eq(0).all()
    )
    assert feats["labels"].tolist() == [[1, 2], [3, -100]]
    with pytest.raises(DataError, match="all 2 samples of a micro-batch failed to decode"):
        collate([None, None])


def test_whisper_forward_on_a_collated_batch_has_a_finite_loss(tmp_path, wavs, whisper):
    from transformers import WhisperForConditionalGeneration

    write_manifest(tmp_path / "m.csv", manifest_rows())
    ds = dataset(tmp_path, whisper)
    model = WhisperForConditionalGeneration.from_pretrained(whisper[0])
    collate = collate_audio(model.config.pad_token_id, model.config.decoder_start_token_id)
    batch = collate([ds[i] for i in range(len(ds))])
    assert batch["input_features"].shape == (4, 16, 100)
    lengths = [len(whisper[2](t).input_ids) for t in TEXTS.values()]
    assert batch["labels"].shape == (4, max(lengths)) and (batch["labels"] == -100).sum() == sum(
        max(lengths) - n for n in lengths
    )
    with torch.no_grad():
        loss = model(**batch).loss
    assert torch.isfinite(loss)


# ---------------------------------------------------------------- bad input


def test_missing_file_with_stop_names_the_path_and_row(tmp_path, wavs):
    wavs["c"].unlink()
    path = write_manifest(tmp_path / "m.csv", manifest_rows())
    with pytest.raises(DataError) as e:
        load_manifest(str(path), DataConfig())
    msg = str(e.value)
    assert str(wavs["c"]) in msg and f"{path}:3" in msg and "does not exist" in msg
    assert "data.bad_audio: skip" in msg


def test_missing_file_with_skip_is_dropped_and_counted(tmp_path, wavs, whisper, caplog):
    wavs["c"].unlink()
    m = load_manifest(
        str(write_manifest(tmp_path / "m.csv", manifest_rows())), DataConfig(bad_audio="skip")
    )
    assert [r.audio for r in m.rows] == [str(wavs[n]) for n in "abd"]
    assert m.skipped == [(str(wavs["c"]), "does not exist")]

    # a duration in the manifest means no header probe: the missing file is found at decode time
    wavs["a"].unlink()
    write_manifest(tmp_path / "m.csv", manifest_rows(duration=True))
    with pytest.raises(DataError, match=f"{wavs['a']}.*m.csv:1.*does not exist"):
        dataset(tmp_path, whisper, bad_audio="stop")[0]
    ds = dataset(tmp_path, whisper, bad_audio="skip")
    # a and c have manifest durations, so they are only found missing when decoded
    assert len(ds) == 4
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        assert ds[0] is None
    assert str(wavs["a"]) in caplog.text and "m.csv:1" in caplog.text
    batch = AudioCollator()([ds[i] for i in range(len(ds))])
    assert len(batch["labels"]) == 2  # a and c dropped


def test_unreadable_file(tmp_path, wavs, whisper):
    wavs["b"].write_bytes(b"not a wav file " * 100)
    path = write_manifest(tmp_path / "m.csv", manifest_rows())
    with pytest.raises(DataError, match=f"{wavs['b']}.*m.csv:2.* is unreadable"):
        load_manifest(str(path), DataConfig())
    m = load_manifest(str(path), DataConfig(bad_audio="skip"))
    assert (
        len(m.rows) == 3 and m.skipped[0][0] == str(wavs["b"]) and "unreadable" in m.skipped[0][1]
    )


@pytest.mark.parametrize(
    "column, key", [("audio", "data.audio_column"), ("text", "data.text_column")]
)
def test_parquet_without_the_named_column(tmp_path, wavs, column, key):
    rows = [{k: v for k, v in r.items() if k != column} for r in manifest_rows()]
    path = write_manifest(tmp_path / "m.parquet", rows)
    with pytest.raises(DataError) as e:
        load_manifest(str(path), DataConfig())
    msg = str(e.value)
    assert f"no column {column!r}" in msg and str(path) in msg and key in msg and "speaker" in msg


def test_embedded_audio_column_is_explained(tmp_path, wavs):
    rows = [dict(r, audio={"bytes": b"RIFF", "path": "a.wav"}) for r in manifest_rows()]
    with pytest.raises(DataError, match="embedded audio.*data.audio_column"):
        load_manifest(str(write_manifest(tmp_path / "m.parquet", rows)), DataConfig())


def test_missing_dependency_says_how_to_install(wavs, monkeypatch):
    monkeypatch.setitem(sys.modules, "soxr", None)  # makes `import soxr` raise ImportError
    assert decode_audio(str(wavs["a"]), 16000).shape == (
        frames("a"),
    )  # no resampling, no soxr needed
    with pytest.raises(ImportError, match=r"pip install 'lockstep\[audio\]'"):
        decode_audio(str(wavs["b"]), 16000)
