"""Audio manifests -> one decode per sample -> feature-extractor inputs and token labels.

    load_manifest(path, cfg)       CSV / JSONL / parquet file(s) -> Manifest(rows, skipped)
                                   durations the manifest lacks come from each file's header (no decoding)
    build_audio_datasets(...)      Manifest -> (train, eval) AudioDatasets, eval = the last rows
    AudioDataset[i]                decode_audio once -> feature extractor -> {"input_features"|"input_values", "labels"}
    collate_audio(...)(samples)    AudioCollator: drops skipped (None) samples, pads features with 0, labels with -100

Each use of a sample decodes its audio file exactly once: the manifest pass reads headers only,
and `__getitem__` hands its single decoded array to the feature extractor. With `read_log` set
(data.log_reads), every decode appends the file's path to that log, so the claim can be audited.

A missing or unreadable file follows `data.bad_audio`: "stop" raises a DataError naming the file,
the manifest row it came from and the fix; "skip" drops it (`Manifest.skipped` at load time, a
warning on the "lockstep" logger at decode time).
"""

from __future__ import annotations

import importlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lockstep.config import DataConfig
from lockstep.data.files import list_data_files
from lockstep.errors import DataError

MANIFEST_SUFFIXES = (".csv", ".jsonl", ".parquet")
LABEL_PAD = -100  # the ignore_index of Hugging Face seq2seq / CTC losses
# header reads are I/O-bound (network filesystems); libsndfile runs without the GIL
_PROBE_THREADS = 16
_FIX = (
    "fix or replace the file, or set data.bad_audio: skip to drop unreadable files and count them"
)

log = logging.getLogger("lockstep")


def _require(module: str) -> Any:
    """Import an optional audio dependency, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"audio data needs {module.split('.')[0]}, which is not installed: "
            "pip install 'lockstep[audio]'"
        ) from e


class AudioRow(NamedTuple):
    audio: str  # path of the audio file (relative manifest paths made absolute)
    text: str  # transcript
    speaker: str | None  # None when the manifest has no speaker column
    # seconds; load_manifest fills it from the header when the manifest lacks it
    duration: float | None
    source: str  # "manifest_file:row" (row counts data rows from 1; in a JSONL file it is the line)


@dataclass
class Manifest:
    rows: list[AudioRow]
    files: list[Path]  # the manifest files read, in order
    # (audio path, reason), bad_audio: skip
    skipped: list[tuple[str, str]] = field(default_factory=list)


# ---------------------------------------------------------------- manifest


def load_manifest(path: str, cfg: DataConfig) -> Manifest:
    """Every row of the manifest file(s) `path` names, durations filled, bad files handled per cfg.bad_audio."""
    files = list_data_files(path, MANIFEST_SUFFIXES, cfg.max_files, what="audio manifest")
    rows: list[AudioRow] = []
    for file in files:
        rows.extend(_read_rows(file, cfg))
    manifest = Manifest(rows, files)
    _fill_durations(manifest, cfg.bad_audio)
    if manifest.skipped:
        first_path, first_reason = manifest.skipped[0]
        log.warning(
            "skipped %d of %d audio files (data.bad_audio: skip); first: %s (%s)",
            len(manifest.skipped),
            len(rows),
            first_path,
            first_reason,
        )
    return manifest


def _read_rows(file: Path, cfg: DataConfig) -> list[AudioRow]:
    pa = _require("pyarrow")
    wanted = [cfg.audio_column, cfg.text_column, cfg.speaker_column, cfg.duration_column]
    match file.suffix.lower():
        case ".parquet":
            pq = _require("pyarrow.parquet")
            names = pq.read_schema(file).names
            _check_columns(file, names, cfg)
            # only the columns used: a parquet manifest may also carry large ones (raw bytes, embeddings)
            table = pq.read_table(file, columns=[c for c in wanted if c in names])
        case ".csv":
            pcsv = _require("pyarrow.csv")
            # strings stay strings: a transcript "42" or a speaker "007" must not be parsed as a number
            types = {c: pa.string() for c in wanted[:3]} | {cfg.duration_column: pa.float64()}
            table = pcsv.read_csv(file, convert_options=pcsv.ConvertOptions(column_types=types))
        case ".jsonl":
            table = _require("pyarrow.json").read_json(file)
        case suffix:
            raise DataError(
                f"manifest {str(file)!r} has suffix {suffix!r}; use one of {', '.join(MANIFEST_SUFFIXES)}"
            )
    _check_columns(file, table.column_names, cfg)

    def column(key: str, kind: Any) -> list:
        name = getattr(cfg, key)
        if name not in table.column_names:  # only the optional speaker / duration columns get here
            return [None] * table.num_rows
        col = table.column(name)
        try:
            return col.cast(kind).to_pylist()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            hint = (
                " (embedded audio, as Hugging Face datasets writes it? lockstep reads file paths)"
            )
            raise DataError(
                f"column {name!r} of manifest {str(file)!r} holds {col.type}, not {kind}"
                + (hint if key == "audio_column" else "")
                + f"; set data.{key} to a column of {kind} values"
            ) from None

    audio, text = column("audio_column", pa.string()), column("text_column", pa.string())
    speaker, duration = (
        column("speaker_column", pa.string()),
        column("duration_column", pa.float64()),
    )
    base = os.path.abspath(file.parent)
    rows = []
    for i in range(table.num_rows):
        source = f"{file}:{i + 1}"
        if audio[i] is None or text[i] is None:
            empty = cfg.audio_column if audio[i] is None else cfg.text_column
            raise DataError(f"{source}: column {empty!r} is empty; fill it in or remove the row")
        # relative paths are relative to the manifest, so a dataset folder can move as a whole
        path = os.path.normpath(os.path.join(base, os.path.expanduser(audio[i])))
        rows.append(AudioRow(path, text[i], speaker[i], duration[i], source))
    return rows


def _check_columns(file: Path, names: list[str], cfg: DataConfig) -> None:
    for key, name in (("audio_column", cfg.audio_column), ("text_column", cfg.text_column)):
        if name not in names:
            raise DataError(
                f"manifest {str(file)!r} has no column {name!r} (its columns: {', '.join(names)}); "
                f"set data.{key} to the column that holds the "
                + ("audio file paths" if key == "audio_column" else "transcripts")
            )


def _fill_durations(manifest: Manifest, bad_audio: str) -> None:
    """Read the header of every file whose duration the manifest lacks; drop or stop on bad files."""
    todo = [i for i, row in enumerate(manifest.rows) if row.duration is None]
    if not todo:
        return
    sf = _require("soundfile")

    def probe(i: int) -> tuple[float | None, str | None]:
        path = manifest.rows[i].audio
        try:
            return sf.info(path).duration, None
        except (OSError, RuntimeError) as e:  # soundfile raises LibsndfileError, a RuntimeError
            return None, _reason(path, e)

    with ThreadPoolExecutor(min(_PROBE_THREADS, len(todo))) as pool:
        probed = dict(zip(todo, pool.map(probe, todo), strict=True))
    kept = []
    for i, row in enumerate(manifest.rows):
        duration, reason = probed.get(i, (row.duration, None))
        if reason is None:
            kept.append(row._replace(duration=duration))
        elif bad_audio == "skip":
            manifest.skipped.append((row.audio, reason))
        else:
            raise DataError(f"audio file {row.audio!r} (from {row.source}) {reason}; {_FIX}")
    manifest.rows = kept


def _reason(path: str, err: Exception) -> str:
    if not os.path.exists(path):
        return "does not exist"
    return f"is unreadable ({err})"


# ---------------------------------------------------------------- decoding and samples


def decode_audio(path: str, target_rate: int) -> np.ndarray:
    """The file at `path` as a float32 mono waveform at `target_rate` Hz, shape (samples,)."""
    sf = _require("soundfile")
    audio, rate = sf.read(path, dtype="float32", always_2d=True)  # (frames, channels)
    audio = audio.mean(axis=1)  # (frames,): a mono model hears every channel
    if rate != target_rate:
        audio = _require("soxr").resample(audio, rate, target_rate)
    return np.ascontiguousarray(audio, dtype=np.float32)


class AudioDataset(Dataset):
    """Manifest rows -> {"input_features" | "input_values": Tensor, "labels": LongTensor}, one decode each.

    Holds no open files, so DataLoader workers can pickle it. In bad_audio "skip" mode a file
    that fails to decode gives None, which AudioCollator drops.
    """

    def __init__(
        self,
        rows: list[AudioRow],
        feature_extractor: Any,
        tokenizer: Any,
        sample_rate: int | None = None,
        bad_audio: str = "stop",
        read_log: str | Path | None = None,
    ):
        if bad_audio not in ("stop", "skip"):
            raise DataError(
                f"data.bad_audio = {bad_audio!r} is not one of 'stop', 'skip'; pick one of those"
            )
        fe_rate = getattr(feature_extractor, "sampling_rate", None)
        if sample_rate is not None and fe_rate is not None and sample_rate != fe_rate:
            # the extractor would reject (or silently mis-read) audio at any other rate
            raise DataError(
                f"data.sample_rate = {sample_rate} but the feature extractor expects {fe_rate} Hz; "
                f"unset data.sample_rate (audio is resampled to the extractor's rate)"
            )
        self.sample_rate = sample_rate or fe_rate
        if self.sample_rate is None:
            raise DataError(
                f"{type(feature_extractor).__name__} has no sampling_rate; set data.sample_rate"
            )
        self.rows = list(rows)
        self.feature_extractor = feature_extractor
        self.tokenizer = tokenizer
        self.bad_audio = bad_audio
        self.read_log = str(read_log) if read_log is not None else None
        if self.read_log:
            Path(self.read_log).parent.mkdir(parents=True, exist_ok=True)

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> np.ndarray:
        """Duration in seconds of each sample (NaN where unknown), for duration-bucketed batching."""
        return np.array(
            [np.nan if r.duration is None else r.duration for r in self.rows], dtype=np.float64
        )

    def __getitem__(self, i: int) -> dict[str, torch.Tensor] | None:
        row = self.rows[i]
        try:
            audio = decode_audio(row.audio, self.sample_rate)
        except (OSError, RuntimeError) as e:  # soundfile raises LibsndfileError, a RuntimeError
            reason = _reason(row.audio, e)
            if self.bad_audio == "stop":
                raise DataError(
                    f"audio file {row.audio!r} (from {row.source}) {reason}; {_FIX}"
                ) from None
            log.warning(
                "skipping audio file %s (from %s): %s (data.bad_audio: skip)",
                row.audio,
                row.source,
                reason,
            )
            return None
        if self.read_log:
            _append_line(self.read_log, row.audio)
        feats = self.feature_extractor(audio, sampling_rate=self.sample_rate, return_tensors="pt")
        key = "input_features" if "input_features" in feats else "input_values"
        if key not in feats:
            raise DataError(
                f"{type(self.feature_extractor).__name__} returned {', '.join(feats)}; "
                "lockstep expects input_features (Whisper) or input_values (wav2vec2)"
            )
        labels = torch.tensor(self.tokenizer(row.text).input_ids, dtype=torch.long)
        return {key: feats[key][0], "labels": labels}  # [0]: drop the extractor's batch dimension


def _append_line(path: str, line: str) -> None:
    # One write(2) of a whole line on an O_APPEND descriptor: DataLoader workers are separate processes,
    # and appends this small are not interleaved. Opened per write, so the dataset stays picklable.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def build_audio_datasets(
    manifest: Manifest,
    feature_extractor: Any,
    tokenizer: Any,
    cfg: DataConfig,
    eval_fraction: float,
    read_log: str | Path | None = None,
) -> tuple[AudioDataset, AudioDataset | None]:
    """(train, eval): eval is the manifest's last round(eval_fraction * n) rows (at least 1), None for 0."""
    rows = manifest.rows
    n_eval = max(1, round(eval_fraction * len(rows))) if eval_fraction > 0 else 0
    if len(rows) - n_eval < 1:
        raise DataError(
            f"the manifest has {len(rows)} usable rows ({len(manifest.skipped)} skipped), "
            f"{n_eval} of them held out by data.eval_fraction = {eval_fraction}, leaving none to "
            "train on; add rows or lower data.eval_fraction"
        )

    def build(part: list[AudioRow]) -> AudioDataset:
        return AudioDataset(
            part, feature_extractor, tokenizer, cfg.sample_rate, cfg.bad_audio, read_log
        )

    return build(rows[: len(rows) - n_eval]), (
        build(rows[len(rows) - n_eval :]) if n_eval else None
    )


# ---------------------------------------------------------------- batching


class AudioCollator:
    """collate_fn: drops None samples, pads features with 0 along time and labels with -100.

    Whisper's model builds decoder_input_ids by shifting labels right behind decoder_start_token_id,
    so a label sequence that already starts with that token (Whisper's tokenizer adds it) would
    start with it twice; it is stripped here, as in Hugging Face's fine-tuning recipe.
    """

    def __init__(self, decoder_start_token_id: int | None = None):
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, samples: list[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
        kept = [s for s in samples if s is not None]
        if not kept:
            raise DataError(
                f"all {len(samples)} samples of a micro-batch failed to decode (the warnings above "
                "name the files); fix the files or remove them from the manifest"
            )
        key = "input_features" if "input_features" in kept[0] else "input_values"
        feats = [s[key] for s in kept]  # each (n_mels, T) or (T,)
        t = max(f.shape[-1] for f in feats)
        x = torch.stack([F.pad(f, (0, t - f.shape[-1])) for f in feats])  # (B, n_mels, T) or (B, T)
        labels = [self._strip(s["labels"]) for s in kept]
        # (B, L)
        y = torch.full((len(labels), max(len(lab) for lab in labels)), LABEL_PAD, dtype=torch.long)
        for b, lab in enumerate(labels):
            y[b, : len(lab)] = lab
        return {key: x, "labels": y}

    def _strip(self, labels: torch.Tensor) -> torch.Tensor:
        if (
            self.decoder_start_token_id is not None
            and len(labels)
            and labels[0] == self.decoder_start_token_id
        ):
            return labels[1:]
        return labels


def collate_audio(
    pad_token_id: int | None = None, decoder_start_token_id: int | None = None
) -> AudioCollator:
    """The collate_fn for audio batches, called like collate_chat(pad_id).

    pad_token_id is not needed: labels pad with -100, which the loss ignores and Whisper's
    shift_tokens_right turns into its own pad token for decoder_input_ids.
    """
    return AudioCollator(decoder_start_token_id)
