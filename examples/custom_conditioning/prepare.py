"""Write the stand-in TTS data: JSONL rows of text tokens, the speech tokens to predict, and the conditioning.

    python prepare.py            # writes ./data/tts.jsonl (no downloads)

The speech tokens follow from the text, the speaker, the prompt (when there is one) and the style, so the
loss falls as the model learns each part. About 1 row in 10 has a prompt; 1 row in 2,048 is whispered, so in an
epoch one rank sees the whisper adapter used once and the other ranks never.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tts_model import PROMPT, SEQ, SPEAKERS, VOCAB

ROWS, WHISPERED = 2048, 1500  # row 1500 is whispered


def row(i: int, rng: random.Random) -> dict:
    text = [rng.randrange(VOCAB) for _ in range(SEQ)]
    speaker = rng.randrange(SPEAKERS)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT)] if rng.random() < 0.1 else None
    style = "whisper" if i == WHISPERED else "neutral"
    shift = speaker + (sum(prompt) % 5 if prompt else 0) + (7 if style == "whisper" else 0)
    return {
        "text": text,
        "speech": [(t + shift) % VOCAB for t in text],
        "speaker": speaker,
        "prompt": prompt,
        "style": style,
        "emotion": round(rng.random(), 3),
    }


def main(out: Path = Path(".")) -> Path:
    rng = random.Random(0)
    path = out / "data" / "tts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row(i, rng)) + "\n" for i in range(ROWS)))
    print(f"wrote {path} ({ROWS} rows)")
    return path


if __name__ == "__main__":
    main()
