"""What is trained on what: the model, its datasets, how a batch becomes a loss, what a checkpoint holds.

`build_workload(cfg, rt, log)` is the one place that looks at `model.kind` and `data.kind`;
the training loop, the DDP check and the checkpoints only see a `Workload`:

    gpt    + text    token windows of the corpus; loss from GPT(x, y)
    hf     + chatml  chat-template tokens, labels on assistant turns; loss from the model's output
    hf     + audio   decoded audio -> feature extractor; transcript labels; duration-bucketed order
    hf     + custom  your Dataset of dicts; loss from the model's output
    custom + custom  your model and Dataset (dicts, tuples or dataclasses); loss from output or your function
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from lockstep.collectives import computed_once, failed_ranks
from lockstep.config import Config, ConfigError
from lockstep.data.text import (
    DataError,
    TokenCache,
    TokenWindows,
    load_token_cache,
    prepare_tokens,
)
from lockstep.runtime import Runtime


def collate_samples(samples: list[Any], where: str = "sample") -> Any:
    """torch's default_collate, plus dataclass samples (collated field by field into one dataclass) and optional
    fields: a field that is None in every sample of the batch stays None (the model's "absent" case)."""
    first = samples[0]
    nones = sum(s is None for s in samples)
    if nones == len(samples):
        return None
    if nones:
        other = next(type(s).__name__ for s in samples if s is not None)
        raise DataError(f"{where} is None in {nones} of the {len(samples)} samples of a batch and a {other} in the "
                        "others, which cannot be stacked into one batch; give every sample a value of one shape (e.g. "
                        "zeros plus a mask for 'absent'), or pass data.collate to batch it yourself")
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{
            f.name: collate_samples([getattr(s, f.name) for s in samples], f"{where}.{f.name}")
            for f in dataclasses.fields(first) if f.init})
    if isinstance(first, Mapping):  # recursed here so that dataclasses inside dicts batch too
        out = {key: collate_samples([s[key] for s in samples], f"{where}[{key!r}]") for key in first}
        try:
            return type(first)(out)  # keeps OrderedDict, BatchEncoding, ...
        except TypeError:
            return out
    try:
        return default_collate(samples)
    except TypeError as e:  # torch names the type, not where it sits in the sample
        raise DataError(f"{where} cannot be batched: {e}; make it a tensor, a number or a string (or a dataclass, "
                        "dict or tuple of them), or pass data.collate to batch it yourself") from None


@dataclass
class Workload:
    model: nn.Module
    train_ds: Dataset
    eval_ds: Dataset | None
    forward_loss: Callable[[nn.Module, Any], torch.Tensor]  # (model or its DDP wrapper, batch on device) -> loss
    collate: Callable[[list[Any]], Any] = collate_samples  # a list of samples -> one batch
    count_tokens: Callable[[Any], int] | None = None  # tokens in a (CPU) batch, for tokens/s and MFU
    lengths: np.ndarray | None = None  # per-sample lengths for a bucketed order (audio durations)
    flops_per_token: float | None = None  # for MFU; None = not reported
    describe: str = ""  # one line for the log
    extra_files: dict[str, bytes] = field(default_factory=dict)  # saved into every checkpoint (tokenizer.json)
    # what a checkpoint holds and how it goes back: LoRA runs keep only the adapters
    state_dict: Callable[[], dict[str, torch.Tensor]] | None = None
    load_state_dict: Callable[[dict[str, torch.Tensor]], None] | None = None
    finalize: Callable[[nn.Module, Path], Path | None] | None = None  # rank 0, after training: e.g. an HF directory
    tokenizer: Any = None  # the GPT's tokenizer, for the sample at the end
    # every forward reaches every trainable parameter, whatever the batch (the built-in GPT): plain DDP is safe
    uses_all_parameters: bool = False

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return self.state_dict() if self.state_dict else self.model.state_dict()

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], source: Path) -> None:
        if self.load_state_dict:
            self.load_state_dict(tensors)
            return
        from lockstep.checkpoint import check_shapes

        check_shapes(tensors, self.model.state_dict(), source)
        self.model.load_state_dict(tensors)


def build_workload(cfg: Config, rt: Runtime, run_dir: Path, log: logging.Logger) -> Workload:
    match cfg.model.kind:
        case "gpt":
            return _gpt_workload(cfg, rt)
        case "hf":
            return _hf_workload(cfg, rt, run_dir, log)
        case "custom":
            return _custom_workload(cfg, log if rt.is_main else None)  # warnings once, not per rank
        case _:
            raise ConfigError(f"model.kind = {cfg.model.kind!r} is not one of 'gpt', 'hf', 'custom'")


# ---------------------------------------------------------------- gpt + text

def _prepare_tokens_once(cfg: Config, rt: Runtime, seq_len: int) -> TokenCache:
    """The corpus is tokenized once per node (local rank 0); the others open the cached file."""
    cache, error = None, None
    if rt.local_rank == 0:
        try:
            cache = prepare_tokens(cfg.data, seq_len=seq_len)
        except Exception as e:  # reported on every rank below instead of leaving them waiting
            error = e
    bad = failed_ranks(rt, error is None)
    if error is not None:
        raise error
    if bad:
        raise DataError(f"preparing the corpus failed on rank(s) {bad}; their log files say why")
    return cache if cache is not None else load_token_cache(cfg.data, seq_len=seq_len)


def _gpt_forward_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return model(x, y)[1]


def _count_gpt_tokens(batch: Any) -> int:
    return batch[0].numel()


def _gpt_workload(cfg: Config, rt: Runtime) -> Workload:
    from lockstep.data.tokenizer import tokenizer_from_json
    from lockstep.models.gpt import build_gpt

    seq = cfg.model.max_seq_length
    cache = _prepare_tokens_once(cfg, rt, seq)
    tokenizer = tokenizer_from_json(cache.tokenizer_json)
    cfg.model.vocab_size = max(cfg.model.vocab_size, tokenizer.vocab_size)  # a BPE tokenizer sets the size
    train_ds = TokenWindows(cache, seq, "train", cfg.data.eval_fraction)
    eval_ds = TokenWindows(cache, seq, "eval", cfg.data.eval_fraction)
    model = build_gpt(cfg.model)
    return Workload(
        model=model, train_ds=train_ds, eval_ds=eval_ds if len(eval_ds) else None,
        forward_loss=_gpt_forward_loss, count_tokens=_count_gpt_tokens, flops_per_token=model.flops_per_token(),
        describe=(f"GPT {model.num_params() / 1e6:.2f}M params (vocab {cfg.model.vocab_size}); {cache.num_tokens} "
                  f"tokens: {len(train_ds)} train / {len(eval_ds)} eval windows of {seq}"),
        extra_files={"tokenizer.json": cache.tokenizer_json.encode()} if cache.tokenizer_json else {},
        tokenizer=tokenizer, uses_all_parameters=True,
    )


# ---------------------------------------------------------------- hugging face

def _hf_forward_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    from lockstep.models.hf import hf_forward_loss

    return hf_forward_loss(model, batch)


def _count_mask_tokens(batch: Any) -> int:
    return int(batch["attention_mask"].sum())


def _hf_workload(cfg: Config, rt: Runtime, run_dir: Path, log: logging.Logger) -> Workload:
    from lockstep.models.hf import (
        build_hf_model,
        hf_flops_per_token,
        load_hf_processor,
        load_trainable_state_dict,
        save_hf_model,
        trainable_state_dict,
    )

    m, d = cfg.model, cfg.data
    processor = load_hf_processor(m)
    model = build_hf_model(m)
    tok = processor.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    count_tokens, lengths, flops = None, None, None
    match d.kind:
        case "chatml":
            from lockstep.data.chatml import (
                build_chat_datasets,
                collate_chat,
                load_conversations,
                require_chat_template,
            )

            require_chat_template(tok, m.path)

            def tokenize_all():
                conversations = load_conversations(d.path, d.max_files)
                datasets = build_chat_datasets(conversations, tok, m.max_seq_length, d.pack, d.eval_fraction)
                return len(conversations), datasets

            # rank 0 tokenizes and sends the token arrays: every rank reading and tokenizing the same files only
            # multiplies the load on a shared filesystem
            num_conversations, (train_ds, eval_ds) = computed_once(rt, tokenize_all)
            collate = collate_chat(pad_id)
            count_tokens, flops = _count_mask_tokens, hf_flops_per_token(model)
            what = f"{num_conversations} conversations ({'packed' if d.pack else 'padded'})"
        case "audio":
            from lockstep.data.audio import (
                build_audio_datasets,
                collate_audio,
                load_manifest,
            )

            if processor.feature_extractor is None:
                raise ConfigError(f"data.kind = 'audio' needs a feature extractor in {m.path} "
                                  "(preprocessor_config.json); save the model's processor there")
            manifest = computed_once(rt, lambda: load_manifest(d.path, d))  # headers probed once, not per rank
            read_log = run_dir / "reads" / f"rank{rt.rank}.txt" if d.log_reads else None
            if read_log:
                read_log.parent.mkdir(parents=True, exist_ok=True)
            train_ds, eval_ds = build_audio_datasets(manifest, processor.feature_extractor, tok, d, d.eval_fraction,
                                                     read_log)
            collate = collate_audio(pad_id, getattr(model.config, "decoder_start_token_id", None))
            lengths = train_ds.lengths() if d.bucket_by_duration else None
            skipped = len(getattr(manifest, "skipped", []))
            what = f"{len(train_ds) + (len(eval_ds) if eval_ds else 0)} utterances" + (
                f" ({skipped} unreadable file(s) skipped)" if skipped else "")
        case "custom":
            train_ds, eval_ds, collate = _custom_data(cfg, log if rt.is_main else None)
            what = f"{len(train_ds)} samples from {d.factory}"
        case _:
            raise ConfigError(f"model.kind = 'hf' takes data.kind 'chatml', 'audio' or 'custom', not {d.kind!r}; "
                              "the built-in text pipeline feeds the built-in GPT")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return Workload(
        model=model, train_ds=train_ds, eval_ds=eval_ds, forward_loss=_hf_forward_loss, collate=collate,
        count_tokens=count_tokens, lengths=lengths, flops_per_token=flops,
        describe=(f"{type(model).__name__} from {m.path}: {total / 1e6:.2f}M params, {trainable / 1e6:.3f}M trainable"
                  f"{f' (LoRA r={m.lora_rank})' if m.use_lora else ''}; {what}: {len(train_ds)} train / "
                  f"{len(eval_ds) if eval_ds else 0} eval samples"),
        state_dict=lambda: trainable_state_dict(model),
        load_state_dict=lambda tensors: load_trainable_state_dict(model, tensors),
        finalize=lambda trained, out: save_hf_model(trained, out, processor),
    )


# ---------------------------------------------------------------- custom

def _custom_data(cfg: Config, log: logging.Logger | None) -> tuple[Dataset, Dataset | None, Callable]:
    from lockstep.data.custom import build_custom_datasets
    from lockstep.models.custom import import_object

    collate = import_object(cfg.data.collate, "data.collate") if cfg.data.collate else collate_samples
    train_ds, eval_ds = build_custom_datasets(cfg, collate, log)
    return train_ds, eval_ds, collate


class _CustomForwardLoss:
    def __init__(self, loss_fn: Callable | None):
        self.loss_fn = loss_fn

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        from lockstep.models.custom import call_model, extract_loss

        return extract_loss(call_model(model, batch), batch, self.loss_fn)


def _custom_workload(cfg: Config, log: logging.Logger | None) -> Workload:
    from lockstep.models.custom import build_custom_loss, build_custom_model

    model = build_custom_model(cfg.model)
    train_ds, eval_ds, collate = _custom_data(cfg, log)
    params = sum(p.numel() for p in model.parameters())
    return Workload(model=model, train_ds=train_ds, eval_ds=eval_ds, collate=collate,
                    forward_loss=_CustomForwardLoss(build_custom_loss(cfg.model)),
                    describe=(f"{type(model).__name__} from {cfg.model.factory}: {params / 1e6:.3f}M params; "
                              f"{len(train_ds)} train / {len(eval_ds) if eval_ds else 0} eval samples"))
