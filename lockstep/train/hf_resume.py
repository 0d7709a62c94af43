"""`--resume checkpoint-500/` of an HF Trainer run: its weights (or LoRA adapters) become this run's starting point.

Only the tensors are taken (lockstep.checkpoint.hf_trainer reads them, never unpickling the Trainer's
optimizer, scheduler, RNG or arguments). Training then starts at step 0 of lockstep's own schedule: HF's
global_step is not carried over, since lockstep's data order and learning-rate schedule are not HF Trainer's
and counting on from its step would not continue its run. What cannot be loaded is refused with the reason:

    a model that is not a Hugging Face model (the built-in GPT, a custom factory)
    LoRA adapters into a run without LoRA, or a full model into a LoRA run (whose checkpoints rebuild the base
    from model.path, which would silently drop the loaded weights at the next resume)
    a sharded layout (FSDP): not supported yet
    a different architecture: the first tensor name or shape that differs
"""

from __future__ import annotations

from torch import nn

from lockstep.checkpoint.hf_trainer import HFTrainerCheckpoint, load_hf_trainer_tensors
from lockstep.errors import CheckpointError


def load_hf_trainer_weights(ckpt: HFTrainerCheckpoint, model: nn.Module, sharded: bool) -> str:
    """Load `ckpt` into `model` (unwrapped, on its device); return the note to log, or raise CheckpointError."""
    where = f"--resume {ckpt.path} is an HF Trainer checkpoint ({ckpt.weights.name})"
    if not (hasattr(model, "config") and hasattr(model, "save_pretrained")):
        raise CheckpointError(
            f"{where}: it holds a Hugging Face model's weights, and this run trains {type(model).__name__}, not a "
            "Hugging Face model (model.kind gpt or custom); to fine-tune it pass --model-kind hf and --model with the "
            "directory of its base model (or the checkpoint itself, which from_pretrained loads)"
        )
    if sharded:
        raise CheckpointError(
            f"{where}: loading one into a sharded layout (parallel.data_parallel: fsdp) is not supported yet; "
            + (
                "use it as the base instead: --model " + str(ckpt.path)
                if not ckpt.is_adapter
                else "start with data_parallel: ddp, then resume the run's own checkpoint under fsdp"
            )
        )
    lora = hasattr(model, "peft_config")
    if ckpt.is_adapter and not lora:
        raise CheckpointError(
            f"{where}: it holds LoRA adapters (r={ckpt.adapter_config.get('r')}), and this run trains without LoRA; "
            f"pass --use-lora --lora-rank {ckpt.adapter_config.get('r')} (and --set model.lora_alpha="
            f"{ckpt.adapter_config.get('lora_alpha')}), or merge the adapters into the base first"
        )
    if lora and not ckpt.is_adapter:
        raise CheckpointError(
            f"{where}: it holds a whole model, and this run trains LoRA adapters, whose checkpoints hold the adapters "
            "alone and rebuild the frozen base from model.path (the loaded weights would be lost at the next resume); "
            f"train LoRA on top of it with --model {ckpt.path} --resume none, or drop --use-lora to train all weights"
        )
    tensors = load_hf_trainer_tensors(ckpt)
    return _load_adapters(ckpt, model, tensors) if lora else _load_full(ckpt, model, tensors)


def _load_full(ckpt: HFTrainerCheckpoint, model: nn.Module, tensors: dict) -> str:
    state = model.state_dict()
    tied = _tied_names(state)
    missing = [
        k for k in state if k not in tensors and not any(t in tensors for t in tied.get(k, ()))
    ]
    _check(ckpt, model, state, tensors, missing)
    model.load_state_dict(tensors, strict=False)
    return _note(ckpt, f"weights ({len(tensors)} tensors)")


def _load_adapters(ckpt: HFTrainerCheckpoint, model: nn.Module, tensors: dict) -> str:
    run = model.peft_config["default"]
    saved = ckpt.adapter_config
    for name, ours in (("r", run.r), ("lora_alpha", run.lora_alpha)):
        if saved.get(name) is not None and saved[name] != ours:
            flag = "--lora-rank" if name == "r" else "--set model.lora_alpha="
            raise CheckpointError(
                f"--resume {ckpt.path}: its adapter_config.json has {name} = {saved[name]}, this run "
                f"{ours}; pass {flag}{' ' if name == 'r' else ''}{saved[name]} to load its adapters"
            )
    # peft saves adapter tensors without the adapter's name: `...q_proj.lora_A.weight` is `...lora_A.default.weight`
    ours = {
        k.replace(".default.", ".").removesuffix(".default"): k
        for k, p in model.named_parameters()
        if p.requires_grad
    }
    state = {k: p for k, p in model.named_parameters() if p.requires_grad}
    renamed = {ours.get(k, k): v for k, v in tensors.items()}
    missing = [ours[k] for k in ours if k not in tensors]
    _check(ckpt, model, state, renamed, missing)
    model.load_state_dict(renamed, strict=False)
    note = _note(
        ckpt,
        f"LoRA adapters (r={run.r}, alpha {run.lora_alpha:g}, {len(tensors)} tensors; the frozen base "
        "from model.path)",
    )
    base = saved.get("base_model_name_or_path")
    if base and base != run.base_model_name_or_path:
        note += (
            f". Its adapter_config.json names base model {base!r}, this run's is {run.base_model_name_or_path!r}: "
            "adapters only fit the base they were trained on"
        )
    return note


def _check(
    ckpt: HFTrainerCheckpoint, model: nn.Module, state: dict, tensors: dict, missing: list[str]
) -> None:
    """The first difference between the checkpoint's tensors and the model's, named, or nothing."""
    unexpected = [k for k in tensors if k not in state]
    shape = next(
        (k for k in tensors if k in state and tuple(tensors[k].shape) != tuple(state[k].shape)),
        None,
    )
    what = f"--resume {ckpt.path}: the HF Trainer checkpoint does not fit {type(model).__name__} built from model.path"
    fix = "pass the model.path (and LoRA settings) the checkpoint was trained from"
    if shape:
        raise CheckpointError(
            f"{what}: {shape} has shape {tuple(tensors[shape].shape)} in the checkpoint, "
            f"{tuple(state[shape].shape)} in the model; {fix}"
        )
    if missing or unexpected:
        parts = (
            [f"{len(missing)} of the model's tensors are not in it (first: {missing[0]})"]
            if missing
            else []
        )
        parts += (
            [f"{len(unexpected)} of its tensors are not in the model (first: {unexpected[0]})"]
            if unexpected
            else []
        )
        raise CheckpointError(f"{what}: {'; '.join(parts)}; {fix}")


def _tied_names(state: dict) -> dict[str, tuple[str, ...]]:
    """name -> the other names of the same storage (tied embeddings: safetensors keeps one of them)."""
    groups: dict[int, list[str]] = {}
    for k, v in state.items():
        groups.setdefault(v.data_ptr(), []).append(k)
    return {
        k: tuple(n for n in names if n != k)
        for names in groups.values()
        if len(names) > 1
        for k in names
    }


def _note(ckpt: HFTrainerCheckpoint, what: str) -> str:
    skipped = (
        f" ({', '.join(ckpt.not_read)}: HF Trainer's pickled formats, never unpickled)"
        if ckpt.not_read
        else ""
    )
    step = (
        (
            f"; HF's global_step {ckpt.global_step} is not carried over (lockstep's data order and schedule are not "
            "HF Trainer's)"
        )
        if ckpt.global_step is not None
        else ""
    )
    return (
        f"resuming from an HF Trainer checkpoint: {what} loaded from {ckpt.path}; its optimizer, scheduler, RNG "
        f"and data position are not loaded{skipped}, so training starts at step 0 of lockstep's schedule with a "
        f"fresh optimizer, warmup and data order{step}"
    )
