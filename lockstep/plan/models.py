"""The model a plan simulates, built as `lockstep train` builds it but on fake tensors (no storage),
with its loss, a micro-batch of the shape its data makes, and the shape facts the step's estimate
and the fallback formula (lockstep.plan.formula) read.

    FakeModel, ModelShape, NotSimulated  what every kind's builder returns or raises
    fake_gpt(cfg) -> FakeModel           the built-in GPT (Hugging Face models:
                                         lockstep.plan.hf_models; lockstep.plan.simulate picks)

The GPT's vocabulary is model.vocab_size as configured: a BPE tokenizer that `train` builds from the
corpus may raise it (lockstep.train.workload), which a plan cannot know without the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lockstep.config import Config
from lockstep.models.loss import Loss


class NotSimulated(Exception):
    """The step cannot run on fake tensors (why, in its message): the plan estimates by formula."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int  # width of the residual stream
    layers: int  # transformer blocks (an encoder's and a decoder's together)
    intermediate: int  # width of a block's MLP
    logits: int  # logits per target token: the vocabulary (or an audio head's codebooks x codes)
    tokens_per_sample: int  # the tokens a sample trains on (throughput counts these)
    tied_embedding: int = 0  # elements a pipeline's first and last stage share (the GPT's)
    targets_per_sample: int = 0  # rows of logits a sample makes (0: tokens_per_sample)
    layer_tokens: int = 0  # tokens a sample passes through, summed over layers (0: all, all)
    # (a module's name, the share of a sample's tokens it reads) where not all: Higgs Audio v2's
    # mlp reads the text tokens, its audio_mlp the audio frames
    token_shares: tuple[tuple[str, float], ...] = ()


@dataclass
class FakeModel:
    model: nn.Module
    loss: Loss
    batch: Callable[[int], Any]  # micro-batch size -> one fake micro-batch (may raise NotSimulated)
    flops_per_token: float  # training FLOPs per token, forward and backward
    shape: ModelShape
    uses_all_parameters: bool
    dtype: torch.dtype = torch.float32  # the parameters' (model.dtype for Hugging Face models)
    base_4bit: bool = False  # frozen Linear weights are NF4 in training (QLoRA)
    notes: list[str] = field(default_factory=list)  # what the plan assumed about this model


def fake_gpt(cfg: Config) -> FakeModel:
    """Under an active FakeTensorMode (or the meta device): the GPT, its loss and batches."""
    from lockstep.models.gpt import batch_loss, build_gpt

    m = cfg.model
    model = build_gpt(m)
    seq, vocab = m.max_seq_length, m.vocab_size

    def batch(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, vocab, (micro, seq)), torch.randint(0, vocab, (micro, seq))

    return FakeModel(
        model=model,
        loss=Loss(batch_loss),
        batch=batch,
        flops_per_token=model.flops_per_token(),
        shape=ModelShape(
            hidden=m.hidden_size,
            layers=m.layers,
            intermediate=4 * m.hidden_size,
            logits=vocab,
            tokens_per_sample=seq,
            tied_embedding=vocab * m.hidden_size,
        ),
        uses_all_parameters=True,
    )
