"""`lockstep export CKPT -o OUT`: a checkpoint as files other tools load.

gpt     OUT/model.safetensors + config.yaml (+ tokenizer.json)   -> safetensors.torch.load_model(build_gpt(...))
hf      OUT/ as save_pretrained writes it: the LoRA adapter, or with --merge-lora the merged full model
        (QLoRA: the adapters go onto the base reloaded in model.dtype; lockstep.models.quantize)
custom  OUT/model.safetensors + config.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import yaml

from lockstep.checkpoint.manifest import MANIFEST, MODEL, STATE
from lockstep.checkpoint.open import load_checkpoint, verify_checkpoint
from lockstep.checkpoint.plain import Checkpoint
from lockstep.checkpoint.resume import resolve_resume
from lockstep.config import Config, config_from_dict, config_to_dict
from lockstep.errors import CheckpointError, ConfigError
from lockstep.models.gpt import upgrade_format_1

# what sample, export and merge take; their messages name it, never train's --resume
_PASS = (
    "pass a run directory that has checkpoints, or one of its checkpoints (RUN/checkpoints/step_N)"
)


def _note(message: str) -> None:
    print(message, file=sys.stderr)  # stderr: `lockstep sample` prints its text on stdout


def resolve_checkpoint(path: str | Path, log: Callable[[str], None] = _note) -> Path:
    """A checkpoint directory as given, or a run directory's newest checkpoint that verifies (as train's
    --resume auto picks it); `log` hears which damaged ones were passed over."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; {_PASS}")
    if path.name == "checkpoints" and path.is_dir() and not (path / MANIFEST).exists():
        path = path.parent  # RUN/checkpoints: stands for RUN
    if (path / "checkpoints").is_dir():
        try:
            chosen = resolve_resume(path, "auto", log)
        except CheckpointError:  # none verifies; log has heard each one's problems
            raise CheckpointError(
                f"no checkpoint of {path} verifies (the problems of each are above; `lockstep "
                f"verify {path}` lists them again); pass another run directory, or a checkpoint "
                "that verifies"
            ) from None
        if chosen is None:
            raise CheckpointError(
                f"run directory {path} holds no committed checkpoint yet ({path / 'checkpoints'} "
                f"has no step_N directory: its training saved none); {_PASS}"
            )
        return chosen
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; {_PASS}")
    if not any((path / name).exists() for name in (MANIFEST, MODEL, STATE)):
        what = (
            "is an empty directory"
            if not any(path.iterdir())
            else f"holds no checkpoint (no {MANIFEST}, {MODEL} or checkpoints/ in it)"
        )
        raise CheckpointError(f"{path} {what}; {_PASS}")
    return path  # a checkpoint, maybe damaged: load_verified_checkpoint says how


def load_verified_checkpoint(ckpt_dir: Path) -> Checkpoint:
    """load_checkpoint, with a damaged checkpoint's fix fitting sample / export / merge (its own names --resume).
    A format-1 checkpoint of the built-in GPT is converted to its current qkv layout."""
    try:
        return load_checkpoint(ckpt_dir, upgrade=upgrade_format_1)
    except CheckpointError:
        problems = verify_checkpoint(ckpt_dir)  # hashed again only on this error path
        if not problems:
            raise
        raise CheckpointError(
            f"checkpoint {ckpt_dir} is damaged ({'; '.join(problems)}); pass another checkpoint "
            "of its run, or the run directory for its newest one that verifies (`lockstep verify "
            "RUN` checks each)"
        ) from None


def checkpoint_config(ckpt: Checkpoint) -> Config:
    """The config the checkpoint was trained with (its state.json 'config'): it rebuilds the model."""
    tree = ckpt.state.get("config") if isinstance(ckpt.state, dict) else None
    if not isinstance(tree, dict):
        raise CheckpointError(
            f"checkpoint {ckpt.path} has no 'config' in its {STATE}, so its model cannot be rebuilt; "
            "pass a checkpoint that lockstep train or lockstep merge wrote"
        )
    return config_from_dict(tree, source=str(ckpt.path / STATE))


def check_weights_fit(ckpt: Checkpoint, model_state: dict) -> None:
    """The checkpoint's tensors against the model its own state.json describes: sample and export rebuild the
    model from that config, so a mismatch means the checkpoint disagrees with itself."""
    have = {k: tuple(v.shape) for k, v in ckpt.tensors.items()}
    want = {k: tuple(v.shape) for k, v in model_state.items() if hasattr(v, "shape")}
    if have == want:
        return
    if key := next((k for k in want if k in have and have[k] != want[k]), None):
        what = f"tensor {key} has shape {have[key]} but its config's model has {want[key]}"
    elif missing := sorted(want.keys() - have.keys()):
        what = f"it lacks {len(missing)} tensor(s) its config's model has, e.g. {missing[0]}"
    else:
        extra = sorted(have.keys() - want.keys())
        what = f"it holds {len(extra)} tensor(s) its config's model lacks, e.g. {extra[0]}"
    raise CheckpointError(
        f"checkpoint {ckpt.path}: {what}, so its state.json 'config' does not describe its "
        "weights (edited by hand, or saved by other code?); pass a checkpoint that lockstep train "
        "or lockstep merge wrote"
    )


def export_checkpoint(path: str | Path, out: str | Path, merge_lora: bool = False) -> Path:
    from safetensors.torch import save_model

    ckpt_dir = resolve_checkpoint(path)
    ckpt = load_verified_checkpoint(ckpt_dir)
    cfg = checkpoint_config(ckpt)
    out = Path(out)
    if merge_lora and not (cfg.model.kind == "hf" and cfg.model.use_lora):
        raise ConfigError(
            f"--merge-lora needs a LoRA checkpoint; {ckpt_dir} was trained with model.kind = "
            f"{cfg.model.kind!r}, use_lora = {cfg.model.use_lora}: drop --merge-lora"
        )
    match cfg.model.kind:
        case "hf":
            from lockstep.models.hf import (
                build_hf_model,
                load_hf_processor,
                load_trainable_state_dict,
                save_hf_model,
            )
            from lockstep.models.quantize import full_precision_config

            # a QLoRA run's base is rebuilt in full precision: any machine exports it, without a GPU
            # or bitsandbytes, and --merge-lora merges into full-precision weights, not 4-bit ones
            model = build_hf_model(full_precision_config(cfg.model))
            # a sharded (fsdp) checkpoint holds every tensor
            if set(model.state_dict()) <= set(ckpt.tensors):
                model.load_state_dict(ckpt.tensors)
            else:  # a plain LoRA checkpoint holds the adapters alone
                load_trainable_state_dict(model, ckpt.tensors)
            return save_hf_model(
                model,
                out,
                load_hf_processor(cfg.model),
                merge_lora=merge_lora,
                trained_in_4bit=cfg.model.load_in_4bit,
            )
        case "gpt":
            from lockstep.models.gpt import build_gpt

            model = build_gpt(cfg.model)
        case "custom":
            from lockstep.models.custom import build_custom_model

            model = build_custom_model(cfg.model)
        case _:
            raise ConfigError(
                f"model.kind {cfg.model.kind!r} in {ckpt_dir} is not one lockstep knows"
            )
    check_weights_fit(ckpt, model.state_dict())
    model.load_state_dict(ckpt.tensors)
    out.mkdir(parents=True, exist_ok=True)
    # save_model drops the duplicate of tied tensors
    save_model(model, str(out / "model.safetensors"))
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    for name, data in ckpt.extra.items():
        (out / name).write_bytes(data)
    return out
