"""AdamW with weight-decay groups, batch-size learning-rate scaling, and the learning-rate schedule.

The schedule is linear warmup, then cosine or linear decay to optim.min_lr_ratio x the peak, or a
constant peak (optim.schedule); `lr_at` says how it lines up with HF Trainer's schedules.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

from lockstep.config import OptimConfig

# Devices where AdamW(fused=True) exists. On CPU (torch 2.13, 2 threads, 3.26M-param GPT) fused took
# 1.26 ms/step against 6.9-9.9 ms/step for the foreach default (~5.5x), and after 55 steps the
# parameters matched foreach's to 3e-8. Elsewhere (e.g. mps, xpu) keep torch's default (foreach).
_FUSED_DEVICES = ("cuda", "cpu")


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, lr: float, device_type: str
) -> torch.optim.AdamW:
    """AdamW over model's trainable parameters, in two groups.

    Matrices (dim >= 2: linear weights, embeddings) get cfg.weight_decay; vectors (biases, LayerNorm
    weights and biases) get none, since decaying a norm's gain or a bias toward 0 only hurts.
    `lr` is the already-scaled peak (see `scaled_learning_rate`); the scheduler multiplies it.
    """
    decay, no_decay = [], []
    # named_parameters() yields a tied tensor (token embedding = output head) once, so no tensor
    # lands in two groups, which AdamW would reject.
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device_type in _FUSED_DEVICES else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **extra)


def scaled_learning_rate(cfg: OptimConfig, global_batch: int) -> float:
    """Peak lr for a global batch of `global_batch` sequences, from the lr tuned at cfg.reference_batch_size.

    linear: lr grows with the batch (Goyal et al. 2017, suits SGD); sqrt: with its square root,
    which keeps Adam's update noise constant (Malladi et al. 2022).
    """
    if global_batch <= 0:
        raise ValueError(f"global batch {global_batch} must be > 0")
    ratio = global_batch / cfg.reference_batch_size
    match cfg.lr_scaling:
        case "none":
            return cfg.learning_rate
        case "linear":
            return cfg.learning_rate * ratio
        case "sqrt":
            return cfg.learning_rate * math.sqrt(ratio)
        case _:
            raise ValueError(
                f"optim.lr_scaling = {cfg.lr_scaling!r} is not one of 'none', 'linear', 'sqrt'"
            )


def warmup_steps_for(cfg: OptimConfig, total_steps: int) -> int:
    """Warmup steps of a run of `total_steps`: optim.warmup_ratio x total_steps rounded up, else
    optim.warmup_steps.

    Rounded up as transformers' TrainingArguments.get_warmup_steps does (math.ceil), so a ratio
    gives the same warmup in both: 0.1 of 25 steps is 3 steps.
    """
    if cfg.warmup_ratio is None:
        return cfg.warmup_steps
    return math.ceil(cfg.warmup_ratio * total_steps)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning-rate multiplier for optimizer step `step` (0-based), in [cfg.min_lr_ratio, 1].

    Steps 0..warmup-1 ramp linearly (step + 1) / warmup, so the first step already moves and step
    warmup-1 reaches 1 (warmup: `warmup_steps_for`). Then, by cfg.schedule:
    cosine / linear: from 1 at step `warmup` down to min_lr_ratio at `total_steps`, and
    min_lr_ratio after that; constant: 1.

    Against transformers' get_scheduler (linear, cosine, cosine_with_min_lr, constant_with_warmup),
    whose LambdaLR gives step s the multiplier f(s): after warmup the two are equal at every step;
    during warmup lockstep's step s is HF's step s + 1, one step ahead, because HF's first step
    trains at lr 0 (0 / warmup) and so changes nothing.
    """
    warmup = warmup_steps_for(cfg, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if step >= total_steps:
        return cfg.min_lr_ratio
    progress = (step - warmup) / max(1, total_steps - warmup)  # 0 -> 1 over the decay
    match cfg.schedule:
        case "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
        case "linear":
            decay = 1.0 - progress
        case _:
            raise ValueError(
                f"optim.schedule = {cfg.schedule!r} is not one of 'cosine', 'linear', "
                "'constant'; set one of those"
            )
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


class ScheduleLR(LambdaLR):
    """LambdaLR whose load_state_dict also puts the restored lr into the optimizer's groups.

    Plain LambdaLR restores only its own counters: if the optimizer state was loaded before the
    scheduler was built, the groups keep the step-0 warmup lr that construction wrote, and the first
    step after a resume silently uses it. Writing `_last_lr` back makes the load order irrelevant.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> LambdaLR:
    """optim.schedule (`lr_at`) applied to each group's initial lr; call `.step()` after each
    optimizer step.

    The multiplier is a plain closure on purpose: LambdaLR.state_dict() stores None for plain
    functions (only callable objects' __dict__ are saved), so the state is ints and floats that
    torch.load(weights_only=True) accepts. The schedule itself is rebuilt from the config on resume.
    """
    return ScheduleLR(optimizer, lambda step: lr_at(step, cfg, total_steps))
