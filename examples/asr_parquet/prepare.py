"""Build what this example trains: a tiny random Whisper, synthesized speech-like audio, parquet manifests.

    python prepare.py            # writes ./tiny-whisper/, ./audio/*.wav and ./manifests/part-*.parquet

Each "word" is a tone of its own pitch, so a transcript is learnable from the audio. Files are
written at 8, 16 and 22.05 kHz: lockstep resamples them to the feature extractor's 16 kHz.
The config trains on 3 of the 4 manifests; the 4th (manifests/part-3.parquet) is audio it never
hears, for `lockstep evaluate runs/asr --data manifests/part-3.parquet` (see README.md).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from lockstep.tools.tiny import save_tiny_whisper

WORDS = {"hello": 300.0, "fox": 450.0, "dog": 600.0, "today": 800.0, "fine": 1000.0}
RATES = [8000, 16000, 22050]


def utterance(rng: random.Random, rate: int) -> tuple[np.ndarray, str]:
    words = [rng.choice(list(WORDS)) for _ in range(rng.randint(1, 3))]
    pieces = []
    for w in words:
        t = np.arange(int(0.25 * rate)) / rate
        pieces.append(0.5 * np.sin(2 * np.pi * WORDS[w] * t))
        pieces.append(np.zeros(int(0.05 * rate)))
    return np.concatenate(pieces).astype(np.float32), " ".join(words)


def main(out: Path = Path("."), utterances: int = 96, parts: int = 4) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import soundfile as sf

    # its transcripts end with the end-of-text token: it learns to stop
    save_tiny_whisper(out / "tiny-whisper")
    rng = random.Random(0)
    (out / "audio").mkdir(parents=True, exist_ok=True)
    (out / "manifests").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(utterances):
        rate = RATES[i % len(RATES)]
        wave, text = utterance(rng, rate)
        path = out / "audio" / f"utt{i:04d}.wav"
        sf.write(path, wave, rate)
        rows.append(
            {
                "audio": f"../audio/{path.name}",
                "text": text,
                "speaker": f"spk{i % 3}",
                "duration": len(wave) / rate,
            }
        )
    per = len(rows) // parts
    for p in range(parts):
        pq.write_table(
            pa.Table.from_pylist(rows[p * per : (p + 1) * per]),
            out / "manifests" / f"part-{p}.parquet",
        )
    print(f"wrote {out / 'tiny-whisper'}, {len(rows)} wav files and {parts} parquet manifests")


if __name__ == "__main__":
    main()
