"""Audio -> codec codes, once per file per job, cached on disk for every later epoch and run.

    AudioRef                    where a clip lives: a file (audio_url) or base64 bytes (raw_audio), plus offset/duration
    CodesCache(root, codec)     DIR/<codec fingerprint>/<content key>.npy, int16 (codebooks, frames), written atomically
    prepare_codes(...)          rank 0 hashes every clip once and lists the missing ones; each rank decodes and
                                encodes its share of those (missing[rank::world]); they wait for each other on a
                                gloo group of their own whose timeout covers encoding, not on the training group

A clip's key is the SHA-256 of its bytes, its offset and duration, and the codec's fingerprint (its config and
weight files), so a changed file, clip or codec never reads stale codes, and a renamed file reuses them. The
cache is shared by every rank when it sits on a filesystem all nodes see (the default under $HOME usually
does); a node that cannot see a code another node wrote encodes it itself, and says so.
With `read_log` set (data.log_reads), every decode appends the clip to that file, so "each file decoded
once per job, none on a re-run" can be audited.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.errors import DataError

log = logging.getLogger("lockstep")
_FIX = "fix or replace it, or set data.bad_audio: skip to drop the samples that use it (they are counted)"
# encoding a corpus takes what it takes; a crashed rank still ends it
PREPARE_TIMEOUT = datetime.timedelta(days=1)


@dataclass(frozen=True)
class AudioRef:
    url: str | None  # absolute path of the audio file, or None for inline bytes
    raw: str | None  # base64 audio bytes (the Higgs format's raw_audio), or None
    offset: float | None  # seconds into the file where the clip starts
    duration: float | None  # seconds of the clip; None = to the end
    # "file.json:sample N, message M", for messages; not part of its identity
    source: str = field(compare=False)

    def describe(self) -> str:
        where = self.url if self.url is not None else "raw_audio (inline bytes)"
        span = (
            f" [{self.offset or 0:g} s +{self.duration:g} s]"
            if self.duration is not None
            else (f" [from {self.offset:g} s]" if self.offset else "")
        )
        return f"{where}{span} (used by {self.source})"

    def read_bytes(self) -> bytes:
        if self.raw is not None:
            try:
                return base64.b64decode(self.raw, validate=True)
            except ValueError as e:
                raise DataError(
                    f"raw_audio of {self.source} is not valid base64 ({e}); {_FIX}"
                ) from None
        try:
            return Path(self.url).read_bytes()
        except OSError as e:
            raise DataError(
                f"audio file {self.url} (used by {self.source}) cannot be read "
                f"({e.strerror or e}); {_FIX}"
            ) from None


def decode_clip(ref: AudioRef, data: bytes, rate: int) -> np.ndarray:
    """The clip as float32 mono at `rate` Hz: channels mixed down (logged), other rates resampled with soxr."""
    import soundfile as sf
    import soxr

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            start = int(round((ref.offset or 0) * f.samplerate))
            frames = -1 if ref.duration is None else int(round(ref.duration * f.samplerate))
            f.seek(min(start, f.frames))
            audio = f.read(frames, dtype="float32", always_2d=True)
            file_rate, channels = f.samplerate, f.channels
    except (sf.LibsndfileError, RuntimeError, ValueError) as e:
        raise DataError(f"audio {ref.describe()} cannot be decoded ({e}); {_FIX}") from None
    if audio.shape[0] == 0:
        raise DataError(
            f"audio {ref.describe()} holds no samples (offset past the end, or an empty file); {_FIX}"
        )
    if channels > 1:
        log.info("audio %s has %d channels: mixed down to mono", ref.describe(), channels)
    audio = audio.mean(axis=1)
    if file_rate != rate:
        audio = soxr.resample(audio, file_rate, rate)
    return np.ascontiguousarray(audio, dtype=np.float32)


def codec_fingerprint(codec_dir: str | Path) -> str:
    """SHA-256 over the codec's config and weight files: codes from another codec never match."""
    h = hashlib.sha256()
    for path in sorted(Path(codec_dir).iterdir()):
        if path.suffix in (".json", ".safetensors", ".bin") and path.is_file():
            h.update(path.name.encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


class CodesCache:
    def __init__(self, root: str | Path, fingerprint: str):
        self.dir = Path(root).expanduser() / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def key(ref: AudioRef, data: bytes) -> str:
        h = hashlib.sha256(data)
        h.update(f"|{ref.offset}|{ref.duration}".encode())
        return h.hexdigest()

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.npy"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def frames(self, key: str) -> int:
        return int(np.load(self.path(key), mmap_mode="r").shape[1])  # reads the header only

    def load(self, key: str) -> np.ndarray:
        return np.load(self.path(key))

    def save(self, key: str, codes: np.ndarray) -> None:
        # write then rename: a reader (another rank, a crash mid-write) never sees half a file
        tmp = self.dir / f".{key}.{os.getpid()}.tmp.npy"
        np.save(tmp, codes.astype(np.int16))
        os.replace(tmp, self.path(key))


def _hash_all(
    refs: list[AudioRef], cache: CodesCache, bad_audio: str
) -> tuple[list[str | None], list[int], dict]:
    """(key per ref or None for a bad one, indices to encode, {ref index: reason})."""
    keys: list[str | None] = []
    missing, bad, seen = [], {}, set()
    for i, ref in enumerate(refs):
        try:
            key = cache.key(ref, ref.read_bytes())
        except DataError as e:
            if bad_audio == "stop":
                raise
            keys.append(None)
            bad[i] = str(e)
            continue
        keys.append(key)
        if key not in seen and not cache.has(key):  # a clip two samples use is encoded once
            missing.append(i)
        seen.add(key)
    return keys, missing, bad


def _encode(
    refs: list[AudioRef],
    indices: list[int],
    keys: list[str | None],
    cache: CodesCache,
    encode: Callable[[np.ndarray], np.ndarray],
    rate: int,
    bad_audio: str,
    read_log: Path | None,
) -> dict[int, str]:
    bad = {}
    for i in indices:
        ref = refs[i]
        try:
            wave = decode_clip(ref, ref.read_bytes(), rate)
        except DataError as e:
            if bad_audio == "stop":
                raise
            bad[i] = str(e)
            continue
        if read_log is not None:
            with open(read_log, "a") as f:
                f.write(f"{ref.url or 'raw_audio:' + ref.source}\n")
        cache.save(keys[i], encode(wave))
    return bad


def prepare_codes(
    refs: list[AudioRef],
    cache: CodesCache,
    encode: Callable[[np.ndarray], np.ndarray],
    rate: int,
    rt: Any,
    bad_audio: str = "stop",
    read_log: Path | None = None,
) -> tuple[list[str | None], dict]:
    """Every clip's cache key (None where bad_audio 'skip' dropped it) and {ref index: reason} of the dropped.

    Each missing clip is decoded and encoded by exactly one rank; a DataError on any rank (bad_audio 'stop')
    stops every rank with the same message.
    """
    from lockstep.collectives import computed_once, gather_objects

    group = _ranks_group(rt) if rt.world_size > 1 else rt
    keys, missing, bad = computed_once(group, lambda: _hash_all(refs, cache, bad_audio))
    mine = missing[rt.rank :: rt.world_size]
    error: Exception | None = None
    try:
        bad.update(_encode(refs, mine, keys, cache, encode, rate, bad_audio, read_log))
    # any failure reaches the other ranks below, or they would wait for this one a day
    except Exception as e:
        error = e
    if rt.world_size > 1:
        outcomes = gather_objects(
            group, (bad, error and (isinstance(error, DataError), str(error)))
        )
        for rank, (rank_bad, failed) in enumerate(outcomes):
            bad.update(rank_bad)
            if failed and error is None:
                is_data, message = failed
                error = (
                    DataError(message)
                    if is_data
                    else RuntimeError(
                        f"encoding audio failed on rank {rank}: {message}; its log says more"
                    )
                )
    if error is not None:
        raise error
    not_here = [i for i in missing if i not in bad and not cache.has(keys[i])]
    # a cache directory that is not shared across nodes: this node encodes what it cannot see
    if not_here:
        log.warning(
            "%d code file(s) written by other nodes are not visible in %s (not a shared filesystem?); "
            "encoding them here too (set data.cache_dir to a shared directory to encode each clip once)",
            len(not_here),
            cache.dir,
        )
        bad.update(_encode(refs, not_here, keys, cache, encode, rate, bad_audio, read_log))
    dropped = {keys[i] for i in bad}  # a bad clip is bad for every sample that uses it
    return [None if i in bad or k in dropped else k for i, k in enumerate(keys)], bad


class _GroupRuntime:
    """A Runtime-like view for gather_objects on the preparation group (timeout PREPARE_TIMEOUT)."""

    def __init__(self, rt: Any, group: Any):
        self.rank, self.world_size, self.distributed, self.control_group = (
            rt.rank,
            rt.world_size,
            True,
            group,
        )
        self.is_main = rt.rank == 0


def _ranks_group(rt: Any) -> Any:
    import torch.distributed as dist

    # a group of its own: the training group's timeout (distributed.timeout_seconds) is for collectives that
    # should take milliseconds, and encoding a corpus is not one (the seed's NCCL timeouts in preprocessing)
    group = dist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT)
    return _GroupRuntime(rt, group)
