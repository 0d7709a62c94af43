"""Build what the TTS team's job trains, tiny and local: a Higgs Audio v2 model, its audio tokenizer, voices, ChatML.

    python prepare.py [DIR]      # writes DIR/hf-cache (the two models under their hub ids) and
                                 # DIR/higgs-audio/training_data/chatml/ (wavs + train_chatml_samples.json)

The models are random and tiny (lockstep.tools.tiny: the released layout of 8 codebooks at 25 frames/s, small
widths) and are stored in a Hugging Face cache folder under the real ids, bosonai/higgs-audio-v2-generation-3B-base
and bosonai/higgs-audio-v2-tokenizer, so the team's command runs as written with HF_HUB_CACHE pointing there.
lockstep never downloads: with the real models in your cache (or local directories), the same command trains them.
The voices are synthetic tones whose pitch and length follow the sentence, so the loss has something to learn.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lockstep.tools.tiny import save_tiny_higgs, save_tiny_higgs_codec, write_tts_fixture

MODEL, CODEC = "bosonai/higgs-audio-v2-generation-3B-base", "bosonai/higgs-audio-v2-tokenizer"


def into_hub_cache(cache: Path, repo_id: str) -> Path:
    """The folder a hub snapshot of `repo_id` lives in (refs/main -> snapshots/<revision>), for save_pretrained."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    return repo / "snapshots" / "local"


def main(out: Path = Path(".")) -> None:
    cache = out / "hf-cache"
    save_tiny_higgs(into_hub_cache(cache, MODEL))
    save_tiny_higgs_codec(into_hub_cache(cache, CODEC))
    data = write_tts_fixture(out / "higgs-audio" / "training_data" / "chatml", samples=48)
    print(f"wrote {cache} ({MODEL}, {CODEC}) and {data}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("."))
