"""A TTS-style model with dataclass conditioning and a branch that only some batches take.

The shape of the third TTS team's model, small enough for a CPU: token inputs plus a
`Conditioning` dataclass (speaker id, optional emotion id). The emotion adapter runs only
when a batch has an emotion label, so in some steps, on some ranks, its parameters get no
gradient: exactly what makes plain DDP stop ("Expected to have finished reduction"). lockstep's
DDP check sees it and turns on find_unused_parameters.

    model.factory: tts_model:build_model      data.factory: tts_model:build_data
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

VOCAB, SPEAKERS, EMOTIONS, SEQ = 64, 8, 4, 32


@dataclass
class Conditioning:
    speaker: torch.Tensor  # (B,) speaker ids
    emotion: torch.Tensor  # (B,) emotion ids, -1 = none


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, T) input ids
    targets: torch.Tensor  # (B, T) ids to predict
    cond: Conditioning


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor  # (B, T, VOCAB)


class ConditionedDecoder(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.speaker = nn.Embedding(SPEAKERS, width)
        self.emotion = nn.Embedding(EMOTIONS, width)  # used only by batches with an emotion label
        self.emotion_proj = nn.Linear(width, width)
        self.mix = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, batch: Batch) -> Output:
        h = self.embed(batch.tokens) + self.speaker(batch.cond.speaker)[:, None, :]  # (B, T, W)
        has_emotion = batch.cond.emotion >= 0
        if bool(has_emotion.any()):  # the data-dependent branch
            e = self.emotion_proj(self.emotion(batch.cond.emotion.clamp(min=0)))  # (B, W)
            h = h + (e * has_emotion[:, None])[:, None, :]
        logits = self.head(h + self.mix(h))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())
        return Output(loss=loss, logits=logits)


class SpeechTokens(torch.utils.data.Dataset):
    """Synthetic "speech tokens": the target shifts each token by the speaker and (if any) the emotion.

    About 1 sample in 8 carries an emotion label, so small micro-batches often have none.
    """

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.speaker = torch.randint(0, SPEAKERS, (n,), generator=g)
        emotion = torch.randint(0, EMOTIONS, (n,), generator=g)
        self.emotion = torch.where(torch.rand(n, generator=g) < 0.125, emotion, torch.full_like(emotion, -1))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Batch:
        shift = self.speaker[i] + 3 * self.emotion[i].clamp(min=0)
        return Batch(self.tokens[i], (self.tokens[i] + shift) % VOCAB, Conditioning(self.speaker[i], self.emotion[i]))


def build_model() -> nn.Module:
    return ConditionedDecoder()


def build_data() -> tuple[SpeechTokens, SpeechTokens]:
    return SpeechTokens(2048, seed=0), SpeechTokens(128, seed=1)
