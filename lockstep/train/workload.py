"""What is trained on what: the model, its datasets, how a batch becomes a loss, what a checkpoint holds.

`build_workload(cfg, rt, log)` is the one place that looks at `model.kind` and `data.kind`;
the training loop, the DDP check and the checkpoints only see a `Workload`:

    gpt    + text    token windows of the corpus; loss from GPT(x, y)
    hf     + chatml  chat-template tokens, labels on assistant turns; loss from the model's output
    hf     + audio   decoded audio -> feature extractor; transcript labels; duration-bucketed order
    hf     + custom  your Dataset of dicts; loss from the model's output
    custom + custom  your model and Dataset (dicts, tuples or dataclasses); loss from output or your function

The Hugging Face kinds are built by lockstep.train.hf_workload, the Higgs text-to-speech model by
lockstep.train.tts_workload; each workload's Loss is decided here, once (lockstep.models.loss).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep.collectives import failed_ranks
from lockstep.config import Config
from lockstep.data.batch import collate_samples
from lockstep.data.custom import custom_data
from lockstep.data.text import TokenCache, TokenWindows, load_token_cache, prepare_tokens
from lockstep.errors import ConfigError, DataError
from lockstep.models.loss import Loss
from lockstep.runtime import Runtime


@dataclass
class Workload:
    model: nn.Module
    train_ds: Dataset
    eval_ds: Dataset | None
    loss: (
        Loss  # how a batch becomes the loss, and how batches weigh in a step (lockstep.models.loss)
    )
    collate: Callable[[list[Any]], Any] = collate_samples  # a list of samples -> one batch
    # tokens in a (CPU) batch, for tokens/s and MFU
    count_tokens: Callable[[Any], int] | None = None
    lengths: np.ndarray | None = None  # per-sample lengths for a bucketed order (audio durations)
    flops_per_token: float | None = None  # for MFU; None = not reported
    describe: str = ""  # one line for the log
    # saved into every checkpoint (tokenizer.json)
    extra_files: dict[str, bytes] = field(default_factory=dict)
    # what a checkpoint holds and how it goes back: LoRA runs keep only the adapters
    state_dict: Callable[[], dict[str, torch.Tensor]] | None = None
    load_state_dict: Callable[[dict[str, torch.Tensor]], None] | None = None
    # rank 0, after training: e.g. an HF directory
    finalize: Callable[[nn.Module, Path], Path | None] | None = None
    tokenizer: Any = None  # the GPT's tokenizer, for the sample at the end
    # every forward reaches every trainable parameter, whatever the batch (the built-in GPT): plain DDP is safe
    uses_all_parameters: bool = False

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return self.state_dict() if self.state_dict else self.model.state_dict()

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], source: Path) -> None:
        if self.load_state_dict:
            self.load_state_dict(tensors)
            return
        from lockstep.checkpoint.plain import check_shapes

        check_shapes(tensors, self.model.state_dict(), source)
        self.model.load_state_dict(tensors)


def build_workload(cfg: Config, rt: Runtime, run_dir: Path, log: logging.Logger) -> Workload:
    match cfg.model.kind:
        case "gpt":
            # warnings once, not per rank
            return _gpt_workload(cfg, rt, log if rt.is_main else None)
        case "hf":
            from lockstep.train.tts_workload import is_tts_model, tts_parts

            if is_tts_model(cfg.model):
                return Workload(**tts_parts(cfg, rt, run_dir, log))
            from lockstep.train.hf_workload import hf_parts

            return Workload(**hf_parts(cfg, rt, run_dir, log))
        case "custom":
            return _custom_workload(cfg, log if rt.is_main else None)  # warnings once, not per rank
        case _:
            raise ConfigError(
                f"model.kind = {cfg.model.kind!r} is not one of 'gpt', 'hf', 'custom'"
            )


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


def _count_gpt_tokens(batch: Any) -> int:
    return batch[0].numel()


def unused_vocab_rows(
    vocab_size: int, tokenizer: Any, hidden: int, model_params: int
) -> str | None:
    """A warning when model.vocab_size gives the token embedding rows no token id reaches, or None.

    The configured size is kept (a checkpoint or a tokenizer swapped in later may need it);
    padding up to a multiple of 64 within the next multiple of 128 (256 -> 320 or 384,
    50257 -> 50304) is the usual speed-up for the matmuls and is not warned about.
    """
    have = tokenizer.vocab_size
    padded = vocab_size % 64 == 0 and vocab_size <= (have // 128 + 1) * 128
    if vocab_size <= have or padded:
        return None
    unused = (vocab_size - have) * hidden  # the head is tied to the embedding: one (V, C) matrix
    share = 100 * unused / model_params
    if tokenizer.kind == "byte":
        fix = f"tokenize with data.tokenizer: bpe and data.bpe_vocab_size: {vocab_size} to use them"
    else:
        fix = f"train the tokenizer with data.bpe_vocab_size: {vocab_size}"
    return (
        f"model.vocab_size = {vocab_size} but the {tokenizer.kind} tokenizer has {have} token ids: "
        f"rows {have}..{vocab_size - 1} of the token embedding (tied to the output head) are never "
        f"reached and hold {unused:,} of the model's {model_params:,} parameters ({share:.1f}%); "
        f"drop --vocab-size / set model.vocab_size to {have}, or {fix}"
    )


def _gpt_workload(cfg: Config, rt: Runtime, log: logging.Logger | None) -> Workload:
    from lockstep.data.tokenizer import tokenizer_from_json
    from lockstep.models.gpt import batch_loss, build_gpt

    seq = cfg.model.max_seq_length
    cache = _prepare_tokens_once(cfg, rt, seq)
    tokenizer = tokenizer_from_json(cache.tokenizer_json)
    # a BPE tokenizer sets the size
    cfg.model.vocab_size = max(cfg.model.vocab_size, tokenizer.vocab_size)
    train_ds = TokenWindows(cache, seq, "train", cfg.data.eval_fraction)
    eval_ds = TokenWindows(cache, seq, "eval", cfg.data.eval_fraction)
    model = build_gpt(cfg.model)
    warning = unused_vocab_rows(
        cfg.model.vocab_size,
        tokenizer,
        cfg.model.hidden_size,
        sum(p.numel() for p in model.parameters()),
    )
    if warning and log:
        log.warning("%s", warning)
    return Workload(
        model=model,
        train_ds=train_ds,
        eval_ds=eval_ds if len(eval_ds) else None,
        loss=Loss(batch_loss),
        count_tokens=_count_gpt_tokens,
        flops_per_token=model.flops_per_token(),
        describe=(
            f"GPT {model.num_params() / 1e6:.2f}M params (vocab {cfg.model.vocab_size}); {cache.num_tokens} "
            f"tokens: {len(train_ds)} train / {len(eval_ds)} eval windows of {seq}"
        ),
        extra_files={"tokenizer.json": cache.tokenizer_json.encode()}
        if cache.tokenizer_json
        else {},
        tokenizer=tokenizer,
        uses_all_parameters=True,
    )


# ---------------------------------------------------------------- custom


class _CustomForwardLoss:
    def __init__(self, loss_fn: Callable | None):
        self.loss_fn = loss_fn

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        from lockstep.models.custom import call_model, extract_loss

        return extract_loss(call_model(model, batch), batch, self.loss_fn)


def _custom_workload(cfg: Config, log: logging.Logger | None) -> Workload:
    from lockstep.models.custom import build_custom_loss, build_custom_model

    model = build_custom_model(cfg.model)
    train_ds, eval_ds, collate = custom_data(cfg, log)
    params = sum(p.numel() for p in model.parameters())
    return Workload(
        model=model,
        train_ds=train_ds,
        eval_ds=eval_ds,
        collate=collate,
        loss=Loss(_CustomForwardLoss(build_custom_loss(cfg.model))),
        describe=(
            f"{type(model).__name__} from {cfg.model.factory}: {params / 1e6:.3f}M params; "
            f"{len(train_ds)} train / {len(eval_ds) if eval_ds else 0} eval samples"
        ),
    )


def unused_settings(cfg: Config) -> list[str]:
    """A line for each key the user set (to a value other than its default) that the chosen model / data
    kinds (or layout) never read.

    Keys a custom data factory may take (data.path, max_files, eval_fraction) are judged where the
    factory is called, against its signature (lockstep.data.custom).
    """
    defaults, lines = Config(), []
    for keys, read, ignored_by, purpose in _reading_rules(cfg):
        for key in keys:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            # a value equal to the default changes nothing either way (--print-config's output sets them all)
            if (
                key in cfg.set_keys
                and not read
                and value != getattr(getattr(defaults, section), name)
            ):
                lines.append(
                    f"{key} = {value!r} has no effect: {ignored_by} does not read it ({purpose}); drop "
                    "it, or pick the kind that uses it"
                )
    return lines


def _reading_rules(cfg: Config) -> list[tuple[list[str], bool, str, str]]:
    """(keys, read in this run?, what ignores them, what they are for), one row per group of keys."""
    m, d, par = cfg.model.kind, cfg.data.kind, cfg.parallel
    tts = m == "hf" and cfg.model.audio_tokenizer_path is not None
    no_codec = f"data.kind {d!r} without model.audio_tokenizer_path"
    # fmt: off
    return [
        (["model.vocab_size", "model.hidden_size", "model.attention_heads", "model.layers", "model.dropout",
          "train.sample_tokens"], m == "gpt", f"model.kind {m!r}", "it shapes or samples the built-in GPT"),
        (["model.max_seq_length"], m == "gpt" or d == "chatml", f"model.kind {m!r} with data.kind {d!r}",
         "it is the GPT's context and the ChatML window"),
        (["model.path", "model.task", "model.dtype", "model.use_lora", "model.lora_rank", "model.lora_alpha",
          "model.lora_dropout", "model.lora_target_modules", "model.audio_tokenizer_path"], m == "hf",
         f"model.kind {m!r}", "it loads a Hugging Face model"),
        (["model.gradient_checkpointing"], m != "custom", "model.kind 'custom'",
         "checkpoint inside your own model"),
        (["data.tokenizer", "data.bpe_vocab_size", "data.tokenizer_path", "data.max_bytes"],
         d == "text", f"data.kind {d!r}", "it tokenizes a text corpus"),
        (["data.cache_dir"], d == "text" or tts, no_codec,
         "it caches a text corpus's tokens and audio ChatML's codes"),
        (["data.bad_audio", "data.log_reads"], d == "audio" or tts, no_codec, "it reads audio"),
        (["data.pack"], d == "chatml", f"data.kind {d!r}", "it packs ChatML conversations"),
        (["data.audio_column", "data.text_column", "data.speaker_column", "data.duration_column",
          "data.sample_rate", "data.bucket_by_duration"], d == "audio", f"data.kind {d!r}",
         "it reads audio manifests"),
        (["parallel.pipeline_schedule"], par.pipeline_parallel > 1, "parallel.pipeline_parallel 1",
         "it schedules pipeline stages"),
        (["parallel.fsdp_reshard_after_forward", "parallel.fsdp_reduce_every_micro_batch"],
         par.data_parallel == "fsdp",
         "parallel.data_parallel 'ddp'", "it tunes FSDP"),
    ]
    # fmt: on
