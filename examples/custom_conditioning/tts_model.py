"""A stand-in of the third TTS team's Chatterbox-style model (T3): speech tokens from text, conditioned on a
`T3Cond` dataclass, small enough for a CPU.

It has the two kinds of data-dependent branches that made the team give up on DDP:

- the prompt encoder runs only for samples that carry a reference-speech prompt (about 1 in 10), so many
  micro-batches leave its parameters without a gradient, on one rank and not the other;
- the whisper adapter runs only for the whispered style, which 1 sample in 2,048 has: in a whole epoch
  one rank sees it once and the others never.

Plain DDP stops or hangs on it; lockstep's default trains it (find_unused_parameters).

    python prepare.py                            # writes data/tts.jsonl (no downloads)
    model.factory: tts_model:build_model         data.factory: tts_model:build_data
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

VOCAB, SPEAKERS, SPEAKER_DIM, SEQ, PROMPT = 64, 8, 16, 32, 8
STYLES = ("neutral", "whisper")


@dataclass
class T3Cond:
    speaker_emb: torch.Tensor  # (B, SPEAKER_DIM) speaker embedding
    # (B, PROMPT) reference speech tokens; zeros where has_prompt is False
    prompt_tokens: torch.Tensor
    has_prompt: torch.Tensor  # (B,) bool
    style: torch.Tensor  # (B,) index into STYLES
    emotion_adv: torch.Tensor  # (B,) emotion exaggeration in [0, 1]


@dataclass
class Batch:
    text_tokens: torch.Tensor  # (B, SEQ) input ids
    speech_tokens: torch.Tensor  # (B, SEQ) speech ids to predict
    cond: T3Cond


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor  # (B, SEQ, VOCAB)


class T3(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.text_emb = nn.Embedding(VOCAB, width)
        self.speaker_proj = nn.Linear(SPEAKER_DIM, width)
        self.emotion_proj = nn.Linear(1, width)
        # prompt samples only
        self.prompt_encoder = nn.Sequential(nn.Embedding(VOCAB, width), nn.Linear(width, width))
        self.whisper_adapter = nn.Linear(width, width)  # whispered samples only
        self.mix = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.speech_head = nn.Linear(width, VOCAB)

    def forward(self, batch: Batch) -> Output:
        c = batch.cond
        h = (
            self.text_emb(batch.text_tokens)
            + self.speaker_proj(c.speaker_emb)[:, None, :]
            + self.emotion_proj(c.emotion_adv[:, None])[:, None, :]
        )  # (B, SEQ, W)
        if bool(c.has_prompt.any()):  # data-dependent branch 1
            prompt = self.prompt_encoder(c.prompt_tokens).mean(dim=1)  # (B, W)
            h = h + (prompt * c.has_prompt[:, None])[:, None, :]
        whisper = c.style == STYLES.index("whisper")
        if bool(whisper.any()):  # data-dependent branch 2
            h = h + self.whisper_adapter(h) * whisper[:, None, None]
        logits = self.speech_head(h + self.mix(h))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch.speech_tokens.flatten())
        return Output(loss=loss, logits=logits)


def speaker_embedding(speaker: int) -> list[float]:
    g = torch.Generator().manual_seed(1000 + speaker)
    return torch.randn(SPEAKER_DIM, generator=g).tolist()


class SpeechSamples(torch.utils.data.Dataset):
    """JSONL rows {"text", "speech", "speaker", "prompt" (list or null), "style", "emotion"} as `Batch` samples."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Batch:
        r = self.rows[i]
        prompt = r["prompt"]
        cond = T3Cond(
            speaker_emb=torch.tensor(speaker_embedding(r["speaker"])),
            prompt_tokens=torch.tensor(prompt if prompt is not None else [0] * PROMPT),
            has_prompt=torch.tensor(prompt is not None),
            style=torch.tensor(STYLES.index(r["style"])),
            emotion_adv=torch.tensor(float(r["emotion"])),
        )
        return Batch(torch.tensor(r["text"]), torch.tensor(r["speech"]), cond)


def build_model() -> nn.Module:
    return T3()


def build_data(
    path: str, eval_fraction: float, seed: int
) -> tuple[SpeechSamples, SpeechSamples | None]:
    """All rows of the JSONL file at `path` (data.path, or --data), split into train and eval by a seeded shuffle."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = int(len(rows) * eval_fraction)
    train = SpeechSamples([rows[i] for i in order[n_eval:]])
    return train, SpeechSamples([rows[i] for i in order[:n_eval]]) if n_eval else None
