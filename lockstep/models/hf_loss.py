"""The loss of a Hugging Face model (lockstep.models.loss.Loss), decided once per model when the workload is built.

    hf_forward_loss(model, batch)   model(**batch).loss: the mean rule (classification, CTC, custom data)
    hf_loss(model, task, weighted)  the workload's Loss; token-weighted for the per-token cross-entropies
                                    of causal-lm, seq2seq-lm and speech-seq2seq on ChatML or audio data

A token-weighted loss needs each batch's *sum* of per-token cross-entropies over the step's count N.
transformers' loss functions (ForCausalLMLoss, ...) take N as the keyword `num_items_in_batch`, which
a model's forward passes on through **kwargs to `self.loss_function`; 185 of the 237 causal-LM,
seq2seq and speech-seq2seq classes of transformers 5.24 do. The others (Whisper, T5, Bart, ...)
compute a plain mean inline: for those the sum is computed here from the logits, as transformers
does (fp32, labels -100 ignored). Which of the two a model gets is read once, from its class's
forward: whether its code refers to `loss_function` at all.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError
from lockstep.models.loss import Loss

NUM_ITEMS = "num_items_in_batch"  # transformers' keyword for a loss's divisor
IGNORE_INDEX = -100  # the label transformers' losses skip
# the tasks whose loss is a per-token cross-entropy over `labels`
TOKEN_TASKS = ("causal-lm", "seq2seq-lm", "speech-seq2seq")


def hf_loss(model: nn.Module, task: str, token_weighted: bool) -> Loss:
    """The Loss of `model` (built for model.task `task`): token-weighted where asked and the task's loss is
    a per-token cross-entropy (CTC and classification losses are no per-token mean: they stay means)."""
    if not token_weighted or task not in TOKEN_TASKS:
        return Loss(hf_forward_loss)
    count = functools.partial(count_label_targets, shifted=task == "causal-lm")
    base = model.get_base_model() if hasattr(model, "peft_config") else model  # under LoRA
    if takes_num_items(type(base)):
        return Loss(_summed_by_model, count)
    encoder_decoder = bool(getattr(base.config, "is_encoder_decoder", False))
    return Loss(functools.partial(_summed_from_logits, encoder_decoder), count)


def takes_num_items(model_class: type) -> bool:
    """Whether the class's forward hands its loss to transformers' `self.loss_function` (which divides by
    `num_items_in_batch` when given it): read from the names its code refers to, once per class."""
    forward = inspect.unwrap(model_class.forward)  # under transformers' decorators
    return "loss_function" in forward.__code__.co_names


def count_label_targets(batch: dict[str, Any], shifted: bool) -> int:
    """Labels != -100 of a batch; `shifted`: a causal LM's, of which nothing predicts labels[:, 0]."""
    labels = batch["labels"][:, 1:] if shifted else batch["labels"]
    return int((labels != IGNORE_INDEX).sum())


def hf_forward_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """model(**batch).loss; Hugging Face models compute it only when the batch has labels."""
    return _require_loss(model(**batch).loss, batch)


def _summed_by_model(model: nn.Module, batch: dict[str, Any], num_items: int) -> torch.Tensor:
    return _require_loss(model(**batch, **{NUM_ITEMS: num_items}).loss, batch)


def _summed_from_logits(
    encoder_decoder: bool, model: nn.Module, batch: dict[str, Any], num_items: int
) -> torch.Tensor:
    out = model(**batch)
    _require_loss(out.loss, batch)  # its mean is not used, but a batch without labels is refused
    labels = batch["labels"].to(out.logits.device)
    if not encoder_decoder:  # a causal LM's logits[t] predicts t + 1; an encoder-decoder's line up
        labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    logits = out.logits.float().flatten(0, -2)
    token_sum = nn.functional.cross_entropy(
        logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return token_sum / num_items


def _require_loss(loss: torch.Tensor | None, batch: dict[str, Any]) -> torch.Tensor:
    if loss is None:
        raise ConfigError(
            f"the model returned no loss for a batch with keys {sorted(batch)}: Hugging Face models "
            "compute the loss only when the batch has 'labels'; have the collate function add them "
            "(input_ids with padding set to -100)"
        )
    return loss
