"""hf + chatml, audio or custom data: a Hugging Face model (+ LoRA) from a local directory, and its data.

    chatml   chat-template tokens, labels on assistant turns; rank 0 tokenizes, every rank gets the arrays
    audio    decoded audio -> the processor's feature extractor; transcript labels; duration buckets
    custom   your Dataset of dicts, the model's own loss of each batch

The loss is token-weighted for ChatML and audio labels (lockstep.models.hf_loss). The Higgs Audio v2
text-to-speech model is lockstep.train.tts_workload's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lockstep.collectives import computed_once
from lockstep.config import Config
from lockstep.data.custom import custom_data
from lockstep.errors import ConfigError
from lockstep.runtime import Runtime


def _count_mask_tokens(batch: Any) -> int:
    return int(batch["attention_mask"].sum())


def hf_parts(cfg: Config, rt: Runtime, run_dir: Path, log: logging.Logger) -> dict[str, Any]:
    """The Workload's fields for a Hugging Face model on ChatML, audio or your data
    (lockstep.train.workload builds it: this module does not import it)."""
    from lockstep.models.hf import (
        build_hf_model,
        hf_flops_per_token,
        load_hf_processor,
        load_trainable_state_dict,
        save_hf_model,
        trainable_state_dict,
    )
    from lockstep.models.hf_loss import hf_loss

    m, d = cfg.model, cfg.data
    processor = load_hf_processor(m)
    model = build_hf_model(m, rt.device)  # a 4-bit base loads straight onto this rank's GPU
    tok = processor.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    count_tokens, lengths, flops = None, None, None
    # chatml and audio labels are per-token targets: their loss weighs each token alike (models/loss.py)
    loss = hf_loss(model, m.task, token_weighted=d.kind in ("chatml", "audio"))
    match d.kind:
        case "chatml":
            train_ds, eval_ds, collate, what = _chatml_data(cfg, rt, tok, pad_id)
            count_tokens, flops = _count_mask_tokens, hf_flops_per_token(model)
        case "audio":
            start_token = getattr(model.config, "decoder_start_token_id", None)
            train_ds, eval_ds, collate, what = _audio_data(
                cfg, rt, run_dir, processor, (pad_id, start_token)
            )
            lengths = train_ds.lengths() if d.bucket_by_duration else None
        case "custom":
            train_ds, eval_ds, collate = custom_data(cfg, log if rt.is_main else None)
            what = f"{len(train_ds)} samples from {d.factory}"
        case _:
            raise ConfigError(
                f"model.kind = 'hf' takes data.kind 'chatml', 'audio' or 'custom', not {d.kind!r}; "
                "the built-in text pipeline feeds the built-in GPT"
            )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    lora = f" (LoRA r={m.lora_rank})" if m.use_lora else ""
    return dict(
        model=model,
        train_ds=train_ds,
        eval_ds=eval_ds,
        loss=loss,
        collate=collate,
        count_tokens=count_tokens,
        lengths=lengths,
        flops_per_token=flops,
        describe=(
            f"{type(model).__name__} from {m.path}: {total / 1e6:.2f}M params, "
            f"{trainable / 1e6:.3f}M trainable{lora}; {what}: {len(train_ds)} train / "
            f"{len(eval_ds) if eval_ds else 0} eval samples"
        ),
        state_dict=lambda: trainable_state_dict(model),
        load_state_dict=lambda tensors: load_trainable_state_dict(model, tensors),
        finalize=lambda trained, out: save_hf_model(trained, out, processor),
    )


def _chatml_data(cfg: Config, rt: Runtime, tok: Any, pad_id: int) -> tuple[Any, Any, Any, str]:
    """(train, eval, collate, what): the conversations through the tokenizer's chat template."""
    from lockstep.data.chat_files import load_conversations
    from lockstep.data.chatml import build_chat_datasets, collate_chat, require_chat_template

    m, d = cfg.model, cfg.data
    require_chat_template(tok, m.path)

    def tokenize_all():
        conversations = load_conversations(d.path, d.max_files)
        datasets = build_chat_datasets(
            conversations, tok, m.max_seq_length, d.pack, d.eval_fraction
        )
        return len(conversations), datasets

    # rank 0 tokenizes and sends the token arrays: every rank reading and tokenizing the same files
    # only multiplies the load on a shared filesystem
    num_conversations, (train_ds, eval_ds) = computed_once(rt, tokenize_all)
    what = f"{num_conversations} conversations ({'packed' if d.pack else 'padded'})"
    return train_ds, eval_ds, collate_chat(pad_id), what


def _audio_data(
    cfg: Config, rt: Runtime, run_dir: Path, processor: Any, ids: tuple[int, int | None]
) -> tuple[Any, Any, Any, str]:
    """(train, eval, collate, what): the manifest's clips through the processor's feature extractor;
    ids = (pad id, the decoder's start token)."""
    from lockstep.data.audio import build_audio_datasets, collate_audio, load_manifest

    m, d = cfg.model, cfg.data
    if processor.feature_extractor is None:
        raise ConfigError(
            f"data.kind = 'audio' needs a feature extractor in {m.path} "
            "(preprocessor_config.json); save the model's processor there"
        )
    # headers probed once, not per rank
    manifest = computed_once(rt, lambda: load_manifest(d.path, d))
    read_log = run_dir / "reads" / f"rank{rt.rank}.txt" if d.log_reads else None
    if read_log:
        read_log.parent.mkdir(parents=True, exist_ok=True)
    train_ds, eval_ds = build_audio_datasets(
        manifest,
        processor.feature_extractor,
        processor.tokenizer,
        d,
        eval_fraction=d.eval_fraction,
        read_log=read_log,
    )
    skipped = len(getattr(manifest, "skipped", []))
    what = f"{len(train_ds) + (len(eval_ds) if eval_ds else 0)} utterances" + (
        f" ({skipped} unreadable file(s) skipped)" if skipped else ""
    )
    return train_ds, eval_ds, collate_audio(*ids), what
