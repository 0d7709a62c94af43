"""Word and character error rates of a speech-to-text model on held-out audio: `lockstep evaluate`.

    evaluate_wer(PATH, data)     transcribe every row of the manifest `data` (or, without one, the eval split the
                                 run held out of its own data.path) and score it; writes RUN/eval/wer.json
    transcribe_rows(...)         manifest rows -> transcripts, in batches
    error_rates(refs, hyps)      WER / CER and their counts, by jiwer

Both sides are normalized before scoring unless told not to: lower case, punctuation removed, whitespace
collapsed, so "Hello, world." and "hello world" count as the same words.
"""

from __future__ import annotations

import dataclasses
import json
import time
import unicodedata
from pathlib import Path
from typing import Any

from torch import nn

from lockstep.data.audio import AudioRow, Manifest, load_manifest
from lockstep.errors import ConfigError, DataError
from lockstep.tools.sample import SPEECH_TO_TEXT, pick_device, read_audio_file, transcribe
from lockstep.tools.trained import Trained, load_trained_hf, resolve_trained

WER_FILE = Path("eval") / "wer.json"


def normalize_text(text: str) -> str:
    """Lower case, punctuation and symbols dropped (apostrophes inside words kept), whitespace collapsed."""
    kept = [" " if unicodedata.category(c)[0] in "PSZC" and c != "'" else c for c in text.lower()]
    return " ".join(w.strip("'") for w in "".join(kept).split() if w.strip("'"))


def error_rates(references: list[str], hypotheses: list[str]) -> dict[str, Any]:
    """WER and CER over all pairs (errors summed, then divided by the reference's words / characters)."""
    jiwer = _import_jiwer()
    words = jiwer.process_words(references, hypotheses)
    chars = jiwer.process_characters(references, hypotheses)
    n_words = words.hits + words.substitutions + words.deletions  # words in the references
    return {
        "wer": words.wer,
        "cer": chars.cer,
        "words": n_words,
        "substitutions": words.substitutions,
        "deletions": words.deletions,
        "insertions": words.insertions,
    }


def _import_jiwer() -> Any:
    try:
        import jiwer
    except ImportError as e:
        raise ConfigError(
            f"WER needs jiwer ({e}); install it: pip install 'lockstep[audio]'"
        ) from None
    return jiwer


def transcribe_rows(
    model: nn.Module,
    processor: Any,
    rows: list[AudioRow],
    batch_size: int = 8,
    max_new_tokens: int | None = None,
) -> list[str]:
    rate = processor.feature_extractor.sampling_rate
    out: list[str] = []
    for start in range(0, len(rows), batch_size):
        part = rows[start : start + batch_size]
        waves = []
        for row in part:
            try:
                waves.append(read_audio_file(row.audio, rate))
            except DataError as e:
                raise DataError(f"{e} (from {row.source})") from None
        out.extend(transcribe(model, processor, waves, max_new_tokens))
    return out


def score_rows(
    model: nn.Module,
    processor: Any,
    rows: list[AudioRow],
    normalize: bool = True,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Transcribe `rows` and score them: error_rates(...) plus "utterances", one dict per row."""
    hyps = transcribe_rows(model, processor, rows, batch_size)
    refs = [r.text for r in rows]
    if normalize:
        refs_n, hyps_n = [normalize_text(t) for t in refs], [normalize_text(t) for t in hyps]
    else:
        refs_n, hyps_n = refs, hyps
    result = error_rates(refs_n, hyps_n)
    result["utterances"] = [
        {
            "audio": row.audio,
            "reference": ref,
            "hypothesis": hyp,
            "wer": error_rates([rn], [hn])["wer"],
        }
        for row, ref, hyp, rn, hn in zip(rows, refs, hyps, refs_n, hyps_n, strict=True)
    ]
    return result


def held_out_rows(trained: Trained, data: str | None) -> tuple[list[AudioRow], str]:
    """(rows, what they are): every row of the manifest `data`, or the eval split of the run's own data."""
    d = trained.cfg.data
    if data is not None:
        cfg = dataclasses.replace(d, path=str(data), max_files=None)  # every file the user named
        return _rows(load_manifest(str(data), cfg)), str(data)
    if not trained.from_checkpoint or d.kind != "audio" or not d.path:
        raise ConfigError(
            f"{trained.path} names no audio data of its own (its run's config is not at hand, or its "
            "data.kind is not 'audio'); pass --data MANIFEST (.csv, .jsonl or .parquet with "
            f"{d.audio_column!r} and {d.text_column!r} columns)"
        )
    if d.eval_fraction <= 0:
        raise ConfigError(
            f"the run held out no audio (data.eval_fraction = {d.eval_fraction}); pass --data MANIFEST "
            "with audio it did not train on"
        )
    rows = _rows(load_manifest(d.path, d))
    n_eval = max(1, round(d.eval_fraction * len(rows)))  # the split build_audio_datasets made
    return rows[len(rows) - n_eval :], f"{d.path} (eval split: last {n_eval} of {len(rows)} rows)"


def _rows(manifest: Manifest) -> list[AudioRow]:
    if not manifest.rows:
        raise DataError(
            f"the manifest {', '.join(map(str, manifest.files))} has no usable rows; pass one with audio"
        )
    return manifest.rows


def evaluate_wer(
    path: str | Path,
    data: str | None = None,
    *,
    normalize: bool = True,
    batch_size: int = 8,
    limit: int | None = None,
    output: str | Path | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Score the model at `path` (run, checkpoint or model directory) on `data`; write the result to `output`
    (default RUN/eval/wer.json, or PATH/eval/wer.json for a model directory outside a run) and return it."""
    trained = resolve_trained(path)
    if trained.task not in SPEECH_TO_TEXT:
        raise ConfigError(
            f"lockstep evaluate scores speech-to-text models (model.task {' or '.join(SPEECH_TO_TEXT)})"
            f"; {trained.describe()} is not one; try `lockstep sample {path}`"
        )
    if batch_size < 1 or (limit is not None and limit < 1):
        raise ConfigError(f"--batch-size {batch_size} and --limit {limit} must be >= 1")
    rows, what = held_out_rows(trained, data)
    rows = rows[:limit] if limit else rows
    start = time.perf_counter()
    model, processor = load_trained_hf(trained, pick_device(device))
    result = {
        "model": str(trained.path),
        "task": trained.task,
        "data": what,
        "normalized": normalize,
        **score_rows(model, processor, rows, normalize, batch_size),
    }
    result["seconds"] = round(time.perf_counter() - start, 3)
    result["written"] = str(
        save_wer(
            result,
            Path(output) if output is not None else (trained.run_dir or trained.path) / WER_FILE,
        )
    )
    return result


def save_wer(result: dict[str, Any], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    return out


def format_total(result: dict[str, Any]) -> str:
    """One line: WER and CER with their counts, e.g. `WER 25.00% (1 sub, 0 del, 0 ins / 4 words) ...`."""
    return (
        f"WER {100 * result['wer']:.2f}% ({result['substitutions']} sub, {result['deletions']} del, "
        f"{result['insertions']} ins / {result['words']} words), CER {100 * result['cer']:.2f}% on "
        f"{len(result['utterances'])} utterances"
    )


def format_utterance(u: dict[str, Any]) -> str:
    return f"{Path(u['audio']).name}  WER {100 * u['wer']:.0f}%\n  REF: {u['reference']}\n  HYP: {u['hypothesis']}"
