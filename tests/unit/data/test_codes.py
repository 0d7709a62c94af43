"""lockstep/data/codes.py: clips decoded once per job across real gloo ranks, codes cached by content and codec,
bad audio stopped (on every rank, same message) or skipped and counted."""

from __future__ import annotations

import base64
import logging

import numpy as np
import pytest
import soundfile as sf
from conftest import one_process, run_ranks

from lockstep.data.codes import AudioRef, CodesCache, codec_fingerprint, decode_clip, prepare_codes
from lockstep.errors import DataError


def _wav(path, seconds=0.5, rate=24000, channels=1, freq=220.0):
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.3 * np.sin(2 * np.pi * freq * t).astype(np.float32)
    sf.write(path, np.stack([wave] * channels, axis=1) if channels > 1 else wave, rate)
    return str(path)


def _fake_encode(wave: np.ndarray) -> np.ndarray:
    """A deterministic stand-in codec (8 codebooks, one frame per 960 samples): the tests count calls, not sound."""
    frames = max(1, len(wave) // 960)
    return (
        (np.abs(wave[: frames * 960]).reshape(frames, 960).mean(1) * 1000)
        .astype(np.int16)[None]
        .repeat(8, 0)
    )


def test_decode_clip_offset_duration_stereo_and_rate(tmp_path, caplog):
    stereo = _wav(tmp_path / "s.wav", seconds=1.0, rate=16000, channels=2)
    ref = AudioRef(stereo, None, 0.25, 0.5, "t:0")
    with caplog.at_level(logging.INFO, logger="lockstep"):
        wave = decode_clip(ref, ref.read_bytes(), 24000)
    assert wave.dtype == np.float32 and len(wave) == 12000  # 0.5 s at 24 kHz, resampled from 16 kHz
    assert "2 channels: mixed down to mono" in caplog.text
    raw = AudioRef(None, base64.b64encode(open(stereo, "rb").read()).decode(), None, None, "t:1")
    assert len(decode_clip(raw, raw.read_bytes(), 16000)) == 16000
    past = AudioRef(stereo, None, 5.0, None, "t:2")
    with pytest.raises(DataError, match="holds no samples"):
        decode_clip(past, past.read_bytes(), 24000)
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF....WAVEfmt not really")
    bad = AudioRef(str(broken), None, None, None, "data.json:sample 3")
    with pytest.raises(
        DataError, match=r"broken.wav .*data.json:sample 3.*cannot be decoded.*bad_audio: skip"
    ):
        decode_clip(bad, bad.read_bytes(), 24000)


def test_cache_keys_follow_content_clip_and_codec(tmp_path):
    a = _wav(tmp_path / "a.wav")
    b = tmp_path / "b.wav"
    b.write_bytes(open(a, "rb").read())  # the same bytes under another name: the same codes
    ref_a, ref_b = AudioRef(a, None, None, None, "x"), AudioRef(str(b), None, None, None, "y")
    assert CodesCache.key(ref_a, ref_a.read_bytes()) == CodesCache.key(ref_b, ref_b.read_bytes())
    clip = AudioRef(a, None, 0.1, 0.2, "x")
    assert CodesCache.key(clip, clip.read_bytes()) != CodesCache.key(ref_a, ref_a.read_bytes())
    codec = tmp_path / "codec"
    codec.mkdir()
    (codec / "config.json").write_text("{}")
    first = codec_fingerprint(codec)
    (codec / "model.safetensors").write_bytes(b"weights")
    assert codec_fingerprint(codec) != first
    cache = CodesCache(tmp_path / "cache", first)
    cache.save("k", np.arange(16, dtype=np.int64).reshape(8, 2))
    assert cache.has("k") and cache.frames("k") == 2 and cache.load("k").dtype == np.int16
    # written through a temporary file, renamed into place
    assert not list(cache.dir.glob(".*tmp*"))


def _prepare_on(rt, wavs: list[str], cache_dir: str, logs: str, bad_audio: str):
    refs = [AudioRef(w, None, None, None, f"data.json:sample {i}") for i, w in enumerate(wavs)]
    # "{rank}" in the path: a node-local cache
    cache = CodesCache(cache_dir.format(rank=rt.rank), "fp")
    try:
        keys, dropped = prepare_codes(
            refs, cache, _fake_encode, 24000, rt, bad_audio, read_log=f"{logs}.{rt.rank}"
        )
    except DataError as e:
        return str(e)
    return keys, dropped


def _reads(logs, ranks=2) -> list[str]:
    out = []
    for r in range(ranks):
        try:
            out += open(f"{logs}.{r}").read().split()
        except FileNotFoundError:
            pass
    return out


def _crashing_encoder_on(rt, wavs: list[str], cache_dir: str):
    def encode(wave):
        if rt.rank == 1:
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return _fake_encode(wave)

    refs = [AudioRef(w, None, None, None, f"s{i}") for i, w in enumerate(wavs)]
    try:
        prepare_codes(refs, CodesCache(cache_dir, "fp"), encode, 24000, rt)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _every_run(rt, runs: list[tuple]) -> list:
    """Each (function, args) of `runs` in turn on the same ranks: what each returned."""
    return [fn(rt, *args) for fn, args in runs]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """The tests' 6 preparations, one after another in one 2-rank group (each makes a gloo group of
    its own, as a job's preparation does), in the order the tests ran them: the rerun after the run
    whose cache it reads, the crash last. name -> (its folder, its clips, each rank's result)."""
    once, bad, node, crash = (tmp_path_factory.mktemp(n) for n in ("once", "bad", "node", "crash"))
    wavs = {
        "once": [
            _wav(once / f"u{i}.wav", seconds=0.2 + 0.1 * i, freq=200 + 30 * i) for i in range(5)
        ],
        "bad": [_wav(bad / f"u{i}.wav") for i in range(3)] + [str(bad / "missing.wav")],
        "node": [_wav(node / f"u{i}.wav", freq=200 + 50 * i) for i in range(4)],
        "crash": [_wav(crash / f"u{i}.wav", freq=300 + 20 * i) for i in range(4)],
    }
    wavs["once"].append(wavs["once"][0])  # a clip two samples use: still one decode
    (bad / "corrupt.wav").write_bytes(b"not audio at all")
    wavs["bad"].append(str(bad / "corrupt.wav"))
    runs = {  # name -> (its folder, its clips, what runs)
        "first": (once, "once", _prepare_on, (str(once / "cache"), str(once / "reads1"), "stop")),
        "again": (once, "once", _prepare_on, (str(once / "cache"), str(once / "reads2"), "stop")),
        "stopped": (bad, "bad", _prepare_on, (str(bad / "c1"), str(bad / "r1"), "stop")),
        "skipped": (bad, "bad", _prepare_on, (str(bad / "c2"), str(bad / "r2"), "skip")),
        "node": (
            node,
            "node",
            _prepare_on,
            (str(node / "node{rank}"), str(node / "reads"), "stop"),
        ),
        "crash": (crash, "crash", _crashing_encoder_on, (str(crash / "cache"),)),
    }
    per_rank = run_ranks(
        _every_run, [(fn, (wavs[clips], *args)) for _, clips, fn, args in runs.values()]
    )
    return {
        name: (folder, wavs[clips], [rank[i] for rank in per_rank])
        for i, (name, (folder, clips, _, _)) in enumerate(runs.items())
    }


def test_each_clip_is_decoded_once_per_job_and_never_on_a_rerun(ranks):
    folder, wavs, first = ranks["first"]
    assert first[0] == first[1]  # every rank knows every clip's key
    keys, dropped = first[0]
    assert dropped == {} and keys[0] == keys[5] and len(set(keys)) == 5
    reads = _reads(folder / "reads1")
    assert sorted(reads) == sorted(wavs[:5])  # five files, five decodes, split across the ranks
    assert _reads(folder / "reads1", 1) and len(_reads(folder / "reads1", 1)) < 5
    again = ranks["again"][2]  # the same clips and cache again (ran after the first)
    # every code came from the cache
    assert again[0] == first[0] and _reads(folder / "reads2") == []


def test_bad_audio_stops_every_rank_with_the_file_or_is_skipped_and_counted(ranks):
    folder, wavs, stopped = ranks["stopped"]
    assert stopped[0] == stopped[1] and "missing.wav" in stopped[0] and "sample 3" in stopped[0]
    assert "data.bad_audio: skip" in stopped[0]
    keys, dropped = ranks["skipped"][2][1]
    assert keys[3] is None and keys[4] is None and all(keys[:3])
    assert sorted(dropped) == [3, 4] and "corrupt.wav" in dropped[4]
    # one process, no group: the same answer
    assert (
        _prepare_on(one_process(), wavs, str(folder / "c2"), str(folder / "r3"), "skip")[0] == keys
    )


def test_a_node_that_cannot_see_the_shared_cache_encodes_what_it_misses(ranks):
    folder, wavs, results = ranks["node"]
    assert results[0] == results[1]
    # each rank encoded its share, then the rest that the other wrote where it cannot see: every clip twice in all
    assert sorted(_reads(folder / "reads")) == sorted(wavs * 2)
    for rank in (0, 1):
        assert len(list((folder / f"node{rank}" / "fp").glob("*.npy"))) == 4


def test_a_crash_while_encoding_on_one_rank_stops_every_rank(ranks):
    rank0, rank1 = ranks["crash"][2]
    assert rank1 == "RuntimeError: CUDA out of memory (a stand-in)"
    assert rank0.startswith("RuntimeError: encoding audio failed on rank 1: CUDA out of memory"), (
        rank0
    )
