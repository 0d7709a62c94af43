"""One line of `--help` per config flag: what it does, its default, and the config key it sets.

The text is the comment beside the field in lockstep/config/__init__.py (lockstep.config.field_help), so it is
written once; the few flags whose meaning needs more than the field's comment (the batch sizes, where a run
resumes from) have their own text here.

    --learning-rate LR   peak learning rate after warmup (optim.learning_rate, default 0.001)
"""

from __future__ import annotations

import functools
import typing

from lockstep.config import Config
from lockstep.config.field_help import field_default, field_help

# flag -> what it does, where the field's comment alone would not say it well enough
TEXT = {
    "--global-batch-size": "samples per optimizer step over all ranks together (the global batch); each device's "
    "micro-batch and the accumulation steps are derived from it",
    "--micro-batch-size": "samples per device per forward inside the global batch; the accumulation steps make up the "
    "rest (global / (ranks x this)); unset: derived",
    "--grad-accum": "micro-batches per optimizer step (forward+backward each, one all-reduce per step); unset: derived",
    "--learning-rate": "peak learning rate, reached at the end of warmup (then --lr-schedule)",
    "--warmup-steps": "optimizer steps of linear warmup from ~0 to the peak learning rate",
    "--warmup-ratio": "warmup as a share of the run's optimizer steps, rounded up (as HF Trainer); "
    "replaces --warmup-steps",
    "--lr-schedule": "after warmup: cosine or linear decay to --min-lr-ratio x the peak at the "
    "last step, or constant at the peak",
    "--min-lr-ratio": "where cosine and linear decay end, as a share of the peak learning rate "
    "(0: HF's decay to 0)",
    "--resume": "where to resume from: auto (the newest committed checkpoint in --output-dir), none, a checkpoint or "
    "run directory, or an HF Trainer checkpoint-N directory (its weights only)",
    "--model": "Hugging Face model to train: a local directory saved with save_pretrained (or a hub id in the local "
    "cache)",
    "--model-kind": "which model: the built-in GPT, a Hugging Face model (--model) or your factory",
    "--data": "training data: a text file, folder or glob (GPT); a ChatML .json/.jsonl; an audio manifest",
    "--world-size": "processes in all; outside a launcher, starts this many local workers (default: one per GPU)",
    "--backend": "process-group backend; auto: nccl on CUDA, gloo on CPU",
    "--device": "device each rank trains on; auto: cuda when available",
    "--vocab-size": "built-in GPT's vocabulary size; the byte tokenizer needs 256, a BPE tokenizer sets its own",
    "--attention-heads": "built-in GPT's attention heads per block; must divide --hidden-size",
    "--task": "what the Hugging Face model does: which Auto class loads --model",
    "--data-kind": "what --data holds: text (GPT), chatml, audio, or custom (data.factory)",
    "--lora-rank": "rank r of the LoRA adapters (with --use-lora): more = more trainable parameters",
    "--layers": "built-in GPT's transformer blocks",
    "--epochs": "passes over the data; stops at whichever of --epochs and --max-steps comes first",
}
METAVARS = {int: "N", float: "X", str: "TEXT"}
PATH_KEYS = {"data.path", "model.path", "checkpoint.output_dir", "checkpoint.resume"}


def flag_help(flag: str, key: str) -> str:
    """`what it does (key, default D)`."""
    what = TEXT.get(flag) or field_help(key) or key
    # argparse formats help with %
    return f"{what} ({key}, default {_shown(field_default(key))})".replace("%", "%%")


def flag_metavar(key: str) -> str:
    """N, X, TEXT, PATH or {choice,...}: what the flag's value is."""
    if key in PATH_KEYS:
        return "PATH"
    section, name = key.split(".")
    ftype = _field_types(section)[name]
    inner = (
        [a for a in typing.get_args(ftype) if a is not type(None)]
        if typing.get_origin(ftype) is not None
        else []
    )
    if typing.get_origin(ftype) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(ftype))) + "}"
    return METAVARS.get(inner[0] if inner else ftype, "V")


@functools.cache
def _field_types(section: str) -> dict[str, object]:
    # get_type_hints evaluates every annotation of the class: once per section, not once per flag
    # (180 flags; BENCHMARKS.md, "Command start": building the parser, which every command does)
    return typing.get_type_hints(type(getattr(Config(), section)))


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
