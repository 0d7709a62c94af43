"""lockstep.models.hf_loss on tiny random models saved locally: which sum each model gets, decided once per
class, and the values of both (against cross-entropy computed here)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lockstep.config import ModelConfig  # noqa: E402
from lockstep.errors import ConfigError  # noqa: E402
from lockstep.models.hf import build_hf_model  # noqa: E402
from lockstep.models.hf_loss import (  # noqa: E402
    _summed_by_model,
    _summed_from_logits,
    count_label_targets,
    hf_forward_loss,
    hf_loss,
    takes_num_items,
)


def padded_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """2 rows of 12 tokens whose labels are -100 past 3 and 9 tokens: 2 + 8 = 10 shifted targets."""
    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, 3:], labels[1, 9:] = -100, -100
    return {"input_ids": ids, "labels": labels}


def causal_token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    predicted, targets = logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
    return torch.nn.functional.cross_entropy(predicted, targets, ignore_index=-100, reduction="sum")


def test_each_class_gets_its_sum_once_by_what_its_forward_refers_to(tiny_llama, tiny_whisper):
    from transformers import LlamaForCausalLM, WhisperForConditionalGeneration

    assert takes_num_items(LlamaForCausalLM)  # hands **kwargs to self.loss_function
    assert not takes_num_items(WhisperForConditionalGeneration)  # an inline mean
    llama = build_hf_model(ModelConfig(kind="hf", path=str(tiny_llama)))
    assert hf_loss(llama, "causal-lm", token_weighted=True).forward is _summed_by_model
    lora = build_hf_model(ModelConfig(kind="hf", path=str(tiny_llama), use_lora=True, lora_rank=4))
    # under LoRA the base model's class decides
    assert hf_loss(lora, "causal-lm", token_weighted=True).forward is _summed_by_model
    whisper = build_hf_model(ModelConfig(kind="hf", path=str(tiny_whisper), task="speech-seq2seq"))
    from_logits = hf_loss(whisper, "speech-seq2seq", token_weighted=True).forward
    assert from_logits.func is _summed_from_logits
    assert from_logits.args == (True,)  # an encoder-decoder: its labels are not shifted
    # the mean rule: not asked for (custom data), or a loss that is no per-token mean (CTC, classification)
    for task, weighted in (("causal-lm", False), ("ctc", True), ("sequence-classification", True)):
        loss = hf_loss(llama, task, token_weighted=weighted)
        assert not loss.token_weighted and loss.forward is hf_forward_loss, (task, weighted)


def test_a_token_weighted_loss_is_the_batchs_token_sum_over_the_divisor(tiny_llama):
    llama = build_hf_model(ModelConfig(kind="hf", path=str(tiny_llama)))
    batch = padded_batch()
    assert count_label_targets(batch, shifted=True) == 10
    assert count_label_targets(batch, shifted=False) == 12
    want = causal_token_sum(llama(**batch).logits, batch["labels"])
    by_model = hf_loss(llama, "causal-lm", token_weighted=True)
    assert by_model.count_targets(batch) == 10
    torch.testing.assert_close(by_model(llama, batch, 25), want / 25)  # the step's 25 targets
    torch.testing.assert_close(by_model(llama, batch), want / 10)  # its own: transformers' mean
    torch.testing.assert_close(by_model(llama, batch), llama(**batch).loss)
    # the sum from the logits, as a model that computes its mean inline gets it: the same value
    torch.testing.assert_close(_summed_from_logits(False, llama, batch, 25), want / 25)


def test_forward_loss_without_labels(tiny_llama):
    model = build_hf_model(ModelConfig(kind="hf", path=str(tiny_llama)))
    with pytest.raises(ConfigError, match=r"no loss .*\['input_ids'\].*labels.*-100"):
        hf_forward_loss(model, {"input_ids": padded_batch()["input_ids"]})
    for weighted in (True, False):
        loss = hf_loss(model, "causal-lm", token_weighted=weighted)
        with pytest.raises(ConfigError, match=r"no loss .*\['input_ids'\].*labels"):
            loss(model, {"input_ids": padded_batch()["input_ids"]}, 3)
    with pytest.raises(ConfigError, match=r"no loss .*\['input_ids'\].*labels"):
        _summed_from_logits(False, model, {"input_ids": padded_batch()["input_ids"]}, 3)
