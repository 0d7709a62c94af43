"""Build what this example trains: a tiny random Llama with a ChatML chat template, and ChatML data.

    python prepare.py            # writes ./tiny-llama/ and ./data/train.jsonl (no downloads)

A real run points model.path at the team's 3B model directory and data.path at their ChatML files;
the tiny model stands in for it so the recipe runs on a CPU in a minute.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from lockstep.tools.tiny import save_tiny_llama

WORDS = "the quick brown fox jumps over lazy dog hello how are you fine thank weather today".split()


def conversation(rng: random.Random) -> dict:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
    # content as a string or as typed parts
    user = rng.choice([text, [{"type": "text", "text": text}]])
    return {
        "messages": [
            {"role": "system", "content": "speak the user's sentence"},
            {"role": "user", "content": user},
            {
                "role": "assistant",
                "content": text,
            },  # the model learns to echo: an easy, visible loss drop
        ]
    }


def main(out: Path = Path(".")) -> None:
    save_tiny_llama(out / "tiny-llama")
    rng = random.Random(0)
    (out / "data").mkdir(parents=True, exist_ok=True)
    with (out / "data" / "train.jsonl").open("w") as f:
        for _ in range(600):
            f.write(json.dumps(conversation(rng)) + "\n")
    print(f"wrote {out / 'tiny-llama'} and {out / 'data' / 'train.jsonl'}")


if __name__ == "__main__":
    main()
