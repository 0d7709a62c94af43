"""Hugging Face models for a plan: built from model.path's config.json alone (no weight is read) as
`lockstep train` builds them (lockstep.models.hf: the task's Auto class, activation checkpointing,
LoRA adapters), with a micro-batch of the shapes the task's data makes.

    fake_hf_model(cfg) -> FakeModel    under FakeTensorMode or the meta device

A micro-batch: causal and seq2seq LMs and sequence classifiers read model.max_seq_length tokens a
sample (the training window); a Whisper-style speech model its encoder's whole input (num_mel_bins x
2 x max_source_positions features) and model.max_seq_length label tokens at most its decoder's
positions; a Higgs Audio v2 model the longest sample train keeps (its max_position_embeddings
unless model.max_seq_length is set), half text, half audio frames. CTC
models read audio of any length: no batch, and the plan estimates by formula
(lockstep.plan.formula), as it does when a model's forward cannot run on fake tensors (Higgs Audio
v2 picks its audio frames with boolean masks, whose sizes fake tensors do not know).

A 4-bit base (model.load_in_4bit, QLoRA) is built in model.dtype: bitsandbytes quantizes real
weights on a GPU only. The plan counts each frozen Linear weight at NF4's 4.127 bits instead (4
bits and the double-quantized block scales; Dettmers et al. 2023, "QLoRA", section 3).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lockstep.config import Config
from lockstep.models.loss import Loss
from lockstep.plan.models import FakeModel, ModelShape, NotSimulated

NF4_BYTES = 4.127 / 8  # per weight of a frozen Linear layer of a 4-bit base


def fake_hf_model(cfg: Config) -> FakeModel:
    from lockstep.models.hf import (
        apply_training_options,
        auto_class,
        check_task,
        hf_flops_per_token,
        load_hf_config,
        resolve_hf_path,
    )
    from lockstep.models.hf_loss import hf_forward_loss
    from lockstep.models.higgs import check_higgs_options, higgs_forward_loss, is_higgs

    m = cfg.model
    path, _ = resolve_hf_path(m.path)
    config = load_hf_config(path, m.path)
    dtype = getattr(torch, m.dtype)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # training keeps no key-value cache (and transformers says so)
    higgs = is_higgs(config)
    # a Higgs model trains on whole samples up to its own context (lockstep.train.tts_workload)
    own = "model.max_seq_length" in cfg.set_keys
    seq = config.max_position_embeddings if higgs and not own else m.max_seq_length
    if higgs:
        check_higgs_options(m)
        from transformers import HiggsAudioV2ForConditionalGeneration

        build = HiggsAudioV2ForConditionalGeneration._from_config
    else:
        auto_cls = auto_class(m.task)
        check_task(config, auto_cls, m.task, m.path)
        build = auto_cls.from_config
    model = _on_meta(lambda: apply_training_options(build(config, dtype=dtype), m))
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if fake is not None:
        _to_fake(model)
    shape, flops = _shape(config, model, seq, hf_flops_per_token)
    return FakeModel(
        model=model,
        # the mean rule: a token-weighted loss counts its targets, which fake tensors do not hold;
        # the memory of a step is the same
        loss=Loss(higgs_forward_loss if higgs else hf_forward_loss),
        batch=_batch_maker(config, m.task, shape, dtype, higgs),
        flops_per_token=flops,
        shape=shape,
        uses_all_parameters=True,
        dtype=dtype,
        base_4bit=m.load_in_4bit,
        notes=[f"{type(config).__name__.replace('Config', '')} from {m.path} (config.json only)"],
    )


def _on_meta(build):
    """build() on the meta device, outside any fake mode: peft moves each adapter it adds to its
    base layer's device, and torch cannot swap a fake parameter for its copy (Module._apply)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("meta"):
        return build()


def _to_fake(model: nn.Module) -> None:
    """Each meta parameter and buffer of `model` a fake CPU tensor of its shape and dtype (under the
    active FakeTensorMode), shared ones (tied embeddings) still shared."""
    made: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if parameter else new
        return made[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake_of(p, parameter=True)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake_of(b, parameter=False)


def _shape(config: Any, model: nn.Module, seq: int, flops_of) -> tuple[ModelShape, float]:
    """The shape facts, and training FLOPs per token (an encoder-decoder's two stacks each over
    its own positions)."""
    if getattr(config, "is_encoder_decoder", False) and hasattr(config, "max_source_positions"):
        labels = min(seq, config.max_target_positions)
        frames = config.max_source_positions
        base = model.get_base_model() if hasattr(model, "peft_config") else model
        encoder = base.get_encoder()
        whole, enc = flops_of(model), _flops_of_module(encoder)
        per_sample = enc * frames + (whole - enc) * labels
        shape = ModelShape(
            hidden=config.d_model,
            layers=config.encoder_layers + config.decoder_layers,
            intermediate=config.encoder_ffn_dim,
            logits=config.vocab_size,
            tokens_per_sample=frames + labels,
            targets_per_sample=labels,
            layer_tokens=config.encoder_layers * frames + config.decoder_layers * labels,
        )
        return shape, per_sample / shape.tokens_per_sample
    logits = config.vocab_size
    if hasattr(config, "num_codebooks"):  # an audio head: each frame's codes of every codebook
        logits = config.num_codebooks * config.codebook_size
    shares = ()
    if hasattr(config, "num_codebooks"):  # each token through one MLP: text's, or audio's
        shares = (("mlp", (seq - seq // 2) / seq), ("audio_mlp", seq // 2 / seq))
    shape = ModelShape(
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
        logits=logits,
        tokens_per_sample=seq,
        token_shares=shares,
    )
    return shape, flops_of(model)


def _flops_of_module(module: nn.Module) -> float:
    """4 x N + 2 x N_trainable of one part of a model (lockstep.models.hf.hf_flops_per_token's
    rule without its embedding correction: an encoder's input is features, not an embedding)."""
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return float(4 * total + 2 * trainable)


def _batch_maker(config: Any, task: str, shape: ModelShape, dtype: torch.dtype, higgs: bool):
    seq, vocab = shape.tokens_per_sample, config.vocab_size

    def tokens(micro: int, n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (micro, n))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def batch(micro: int) -> dict[str, torch.Tensor]:
        if higgs:
            frames = seq // 2  # _shape's token shares follow this cut
            out = tokens(micro, seq)
            out["input_ids"][:, seq - frames :] = config.audio_token_id
            codes = (micro, frames, config.num_codebooks)
            out["audio_input_ids"] = torch.randint(0, config.codebook_size, codes)
            out["audio_input_ids_mask"] = torch.ones(micro, frames, dtype=torch.bool)
            out["audio_labels"] = torch.randint(0, config.codebook_size, codes)
            return out
        if task in ("causal-lm", "seq2seq-lm"):
            out = tokens(micro, seq)
            return {**out, "labels": out["input_ids"].clone()}
        if task == "sequence-classification":
            labels = torch.randint(0, max(config.num_labels, 1), (micro,))
            return {**tokens(micro, seq), "labels": labels}
        if task == "speech-seq2seq":
            features = (micro, config.num_mel_bins, 2 * config.max_source_positions)
            labels = torch.randint(0, vocab, (micro, min(seq, config.max_target_positions)))
            return {"input_features": torch.randn(features, dtype=dtype), "labels": labels}
        raise NotSimulated(
            f"model.task = {task!r} reads audio of any length, so a plan has no batch shape for it"
        )

    return batch


def nf4_saving(model: nn.Module) -> int:
    """Bytes a 4-bit base saves on this rank: each frozen Linear weight at NF4_BYTES."""
    saved = 0.0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and weight is not None and not weight.requires_grad:
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            saved += local.numel() * (local.element_size() - NF4_BYTES)
    return int(saved)
