"""hf (Higgs Audio v2) + audio ChatML: the text-to-speech workload.

model.path                  HiggsAudioV2ForConditionalGeneration (+ LoRA): what trains
model.audio_tokenizer_path  the codec: encodes every clip once (lockstep.data.codes), then is dropped; it is
                            never optimized, never wrapped by DDP, and checkpoints record only its path
data.path                   Higgs-format ChatML (lockstep.data.audio_chatml); assistant audio is the target
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from lockstep.config import Config
from lockstep.errors import ConfigError, DataError
from lockstep.runtime import Runtime


def tts_parts(cfg: Config, rt: Runtime, run_dir: Path, log: logging.Logger) -> dict[str, Any]:
    """The Workload's fields for a Higgs model (lockstep.train.workload builds it: this module does not import it)."""
    from lockstep.data.audio_chatml import (
        HiggsTokens,
        TTSCollator,
        TTSDataset,
        audio_refs,
        count_audio_targets,
        count_batch_tokens,
        encode_sample,
        load_tts_samples,
    )
    from lockstep.data.codes import CodesCache, codec_fingerprint, prepare_codes
    from lockstep.models.hf import (
        hf_flops_per_token,
        load_hf_processor,
        load_trainable_state_dict,
        save_hf_model,
        trainable_state_dict,
    )
    from lockstep.models.higgs import build_higgs_model, check_codec, higgs_forward_loss, load_codec
    from lockstep.models.loss import Loss

    m, d = cfg.model, cfg.data
    if not m.audio_tokenizer_path:
        raise ConfigError(
            f"model.path = {m.path!r} is a Higgs Audio v2 model, which trains on audio codes: set "
            "model.audio_tokenizer_path (--audio_tokenizer_path) to its codec's directory"
        )
    if d.kind != "chatml":
        raise ConfigError(
            f"a Higgs Audio v2 model trains on audio ChatML (data.kind: chatml), not data.kind = "
            f"{d.kind!r}; set data.kind: chatml and data.path to the samples' .json/.jsonl"
        )
    tokenizer = load_hf_processor(m).tokenizer
    model = build_higgs_model(m)
    config = model.config
    codec = load_codec(m.audio_tokenizer_path, rt.device)
    check_codec(config, codec, m.path, m.audio_tokenizer_path)
    tokens = HiggsTokens.of(tokenizer, config)
    samples = load_tts_samples(d.path, d.max_files)
    cache = CodesCache(
        Path(d.cache_dir or "~/.cache/lockstep") / "codes",
        codec_fingerprint(codec_dir(m.audio_tokenizer_path)),
    )
    read_log = run_dir / "reads" / f"rank{rt.rank}.txt" if d.log_reads else None
    if read_log:
        read_log.parent.mkdir(parents=True, exist_ok=True)

    @torch.no_grad()
    def encode(wave):
        codes = codec.encode(torch.from_numpy(wave)[None, None].to(rt.device)).audio_codes
        return codes[0].cpu().numpy()  # (1, codebooks, T) -> (codebooks, T)

    # the codec lives only in this function: once the codes are on disk nothing holds it during training
    refs = audio_refs(samples)
    keys, dropped = prepare_codes(
        refs, cache, encode, codec.config.sample_rate, rt, bad_audio=d.bad_audio, read_log=read_log
    )
    by_ref = dict(zip(refs, keys))
    # lockstep's default context (128) is the built-in GPT's; a TTS model's own is what its clips need
    own = "model.max_seq_length" in cfg.set_keys
    limit = m.max_seq_length if own else config.max_position_embeddings
    found = [encode_sample(sample, by_ref, cache, tokenizer, tokens) for sample in samples]
    encoded = _trainable(
        found, limit=limit, dropped=dropped, path=d.path, log=log if rt.is_main else None
    )
    n_eval = int(len(encoded) * d.eval_fraction)
    train_ds = TTSDataset(encoded[: len(encoded) - n_eval], cache, tokens)
    eval_ds = TTSDataset(encoded[len(encoded) - n_eval :], cache, tokens) if n_eval else None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    frames = sum(cache.frames(k) for k in set(keys) if k is not None)
    return dict(
        model=model,
        train_ds=train_ds,
        eval_ds=eval_ds,
        # no text targets: from_pretrained builds the model without its optional text head (the released 3B has
        # no weights for one), so its loss is the audio codebooks' alone, and their count weighs it
        loss=Loss(higgs_forward_loss, count_audio_targets),
        collate=TTSCollator(tokens),
        count_tokens=count_batch_tokens,
        lengths=train_ds.lengths(),
        flops_per_token=hf_flops_per_token(model),
        describe=(
            f"{type(config).__name__.replace('Config', '')} from {m.path}: {total / 1e6:.2f}M params, "
            f"{trainable / 1e6:.3f}M trainable{f' (LoRA r={m.lora_rank})' if m.use_lora else ''}; codec "
            f"{m.audio_tokenizer_path} (frozen, {len(set(keys) - {None})} clips, {frames} frames cached in "
            f"{cache.dir}); {len(train_ds)} train / {n_eval} eval samples"
        ),
        state_dict=lambda: trainable_state_dict(model),
        load_state_dict=lambda tensors: load_trainable_state_dict(model, tensors),
        finalize=lambda trained, out: _save_tts(
            trained, out, tokenizer, m.audio_tokenizer_path, save_hf_model
        ),
    )


def _trainable(
    found: list, *, limit: int, dropped: dict, path: str, log: logging.Logger | None
) -> list:
    """The encoded samples that fit model.max_seq_length (`limit`); the others counted and said once
    (`log`: rank 0's), and none left refused."""
    too_long = sum(1 for e in found if e is not None and e.length > limit)
    bad = sum(1 for e in found if e is None)
    if too_long and log:
        log.warning(
            "%d of %d samples are longer than model.max_seq_length = %d tokens and were skipped (a clip "
            "cannot be cut mid-stream); raise model.max_seq_length to train on them",
            too_long,
            len(found),
            limit,
        )
    if bad and log:
        log.warning(
            "%d sample(s) use unreadable audio and were skipped (data.bad_audio: skip): %s",
            bad,
            "; ".join(sorted(set(dropped.values())))[:600],
        )
    encoded = [e for e in found if e is not None and e.length <= limit]
    if not encoded:
        raise DataError(
            f"no sample of {path} is left to train on ({too_long} longer than model.max_seq_length = "
            f"{limit}, {bad} with unreadable audio); raise model.max_seq_length or fix the data"
        )
    return encoded


def is_tts_model(m) -> bool:
    """A Higgs Audio v2 model, by its config.json (read without loading transformers), or a codec given."""
    if m.audio_tokenizer_path:
        return True
    from lockstep.models.hf import resolve_hf_path

    config = Path(resolve_hf_path(m.path)[0]) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") == "higgs_audio_v2"
    except (OSError, ValueError):
        return False  # the HF loader says what is wrong with the directory


def codec_dir(path: str) -> Path:
    from lockstep.models.hf import resolve_hf_path

    return Path(resolve_hf_path(path)[0])


def _save_tts(model, out: Path, tokenizer, codec_path: str, save_hf_model) -> Path:
    """The HF directory (adapters or full model + tokenizer), and the codec by reference in lockstep.json."""
    from lockstep.models.hf import HFProcessor

    path = save_hf_model(model, out, HFProcessor(tokenizer))
    info = json.loads((path / "lockstep.json").read_text())
    from lockstep.models.hf import resolve_hf_path

    # a hub id stays a hub id (found in whichever cache the sampling machine has); a directory becomes absolute,
    # so the reference holds from any working directory
    local, is_hub_id = resolve_hf_path(codec_path)
    info["audio_tokenizer_path"] = codec_path if is_hub_id else local
    (path / "lockstep.json").write_text(json.dumps(info, indent=2) + "\n")
    return path
