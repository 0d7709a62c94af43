"""`lockstep export CKPT -o OUT`: a checkpoint as files other tools load.

    gpt     OUT/model.safetensors + config.yaml (+ tokenizer.json)   -> safetensors.torch.load_model(build_gpt(...))
    hf      OUT/ as save_pretrained writes it: the LoRA adapter, or with --merge-lora the merged full model
    custom  OUT/model.safetensors + config.yaml
"""

from __future__ import annotations

from pathlib import Path

import yaml

from lockstep.checkpoint import check_shapes, load_checkpoint, resolve_resume
from lockstep.config import ConfigError, config_from_dict, config_to_dict


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory as given, or a run directory's newest checkpoint that verifies."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a checkpoint directory or a run directory")
    chosen = resolve_resume(path, str(path)) if (path / "checkpoints").is_dir() else path
    if chosen is None:
        raise FileNotFoundError(f"{path} has no committed checkpoint yet; train first or pass a checkpoint directory")
    return chosen


def export_checkpoint(path: str | Path, out: str | Path, merge_lora: bool = False) -> Path:
    from safetensors.torch import save_model

    ckpt_dir = resolve_checkpoint(path)
    ckpt = load_checkpoint(ckpt_dir)
    cfg = config_from_dict(ckpt.state["config"], source=str(ckpt_dir / "state.json"))
    out = Path(out)
    if merge_lora and not (cfg.model.kind == "hf" and cfg.model.use_lora):
        raise ConfigError(f"--merge-lora needs a LoRA checkpoint; {ckpt_dir} was trained with model.kind = "
                          f"{cfg.model.kind!r}, use_lora = {cfg.model.use_lora}: drop --merge-lora")
    match cfg.model.kind:
        case "hf":
            from lockstep.models.hf import build_hf_model, load_hf_processor, load_trainable_state_dict, save_hf_model

            model = build_hf_model(cfg.model)
            if set(model.state_dict()) <= set(ckpt.tensors):  # a sharded (fsdp) checkpoint holds every tensor
                model.load_state_dict(ckpt.tensors)
            else:  # a plain LoRA checkpoint holds the adapters alone
                load_trainable_state_dict(model, ckpt.tensors)
            return save_hf_model(model, out, load_hf_processor(cfg.model), merge_lora=merge_lora)
        case "gpt":
            from lockstep.models.gpt import build_gpt

            model = build_gpt(cfg.model)
        case "custom":
            from lockstep.models.custom import build_custom_model

            model = build_custom_model(cfg.model)
        case _:
            raise ConfigError(f"model.kind {cfg.model.kind!r} in {ckpt_dir} is not one lockstep knows")
    check_shapes(ckpt.tensors, model.state_dict(), ckpt_dir)
    model.load_state_dict(ckpt.tensors)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / "model.safetensors"))  # save_model drops the duplicate of tied tensors
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    for name, data in ckpt.extra.items():
        (out / name).write_bytes(data)
    return out
