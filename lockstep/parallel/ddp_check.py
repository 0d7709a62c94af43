"""The DDP compatibility check, and the gradient-hash debug mode.

DDP must know which parameters a step leaves without a gradient: when some go unused and it
was not told (`find_unused_parameters`), it waits forever for their all-reduce or stops with
"Expected to have finished reduction". Teams that hit that concluded "DDP cannot work" for
models with conditional branches. The check runs the first steps' real micro-batches forward
and backward on the bare model (no DDP, no optimizer step, RNG restored afterwards, so the run
that follows is unchanged), gathers every rank's unused parameters per step, and chooses:

    nothing unused anywhere                    -> plain DDP (cheapest)
    the same parameters unused in every step   -> static_graph=True (DDP marks them once;
      and on every rank                           if a later step differs, DDP stops with
                                                  "graph has changed", and the log says what to set)
    the unused set changes between steps/ranks -> find_unused_parameters=True (DDP walks the
                                                  autograd graph each step: correct, a little slower)

`parallel.find_unused_parameters` / `parallel.static_graph` set to true/false override the choice.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep.collectives import gather_objects
from lockstep.config import ParallelConfig
from lockstep.rng import capture_rng_state, restore_rng_state
from lockstep.runtime import Runtime


@dataclass
class DDPChoice:
    find_unused_parameters: bool
    static_graph: bool
    reason: str


@dataclass
class UsageReport:
    """Which trainable parameters got no gradient: unused[rank][step] = sorted names."""

    steps: int
    num_trainable: int
    unused: list[list[list[str]]]

    @property
    def any_unused(self) -> bool:
        return any(names for rank in self.unused for names in rank)

    @property
    def constant(self) -> bool:
        sets = {tuple(names) for rank in self.unused for names in rank}
        return len(sets) <= 1

    def format(self, limit: int = 8) -> str:
        if not self.any_unused:
            return (f"all {self.num_trainable} trainable parameters received a gradient in each of the "
                    f"{self.steps} checked step(s) on every rank")
        lines = [f"parameters without a gradient ({self.num_trainable} trainable, {self.steps} step(s) checked):"]
        for rank, per_step in enumerate(self.unused):
            for step, names in enumerate(per_step):
                shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
                lines.append(f"  rank {rank} step {step + 1}: {shown or '(none)'}")
        return "\n".join(lines)


def find_unused_parameters(
    model: nn.Module,
    steps: Iterable[list[Any]],
    forward_loss: Callable[[nn.Module, Any], torch.Tensor],
    autocast: contextlib.AbstractContextManager,
) -> list[list[str]]:
    """Run each step's micro-batches forward and backward on `model`; per step, the trainable parameters left
    without a gradient. Gradients are cleared and the RNG restored afterwards: the check changes nothing."""
    rng = capture_rng_state()
    was_training = model.training
    model.train()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    unused: list[list[str]] = []
    try:
        for micro_batches in steps:
            model.zero_grad(set_to_none=True)
            for batch in micro_batches:
                with autocast:
                    loss = forward_loss(model, batch)
                loss.backward()
            unused.append(sorted(n for n, p in trainable if p.grad is None))
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        restore_rng_state(rng)
    return unused


def gather_usage(rt: Runtime, unused: list[list[str]], num_trainable: int) -> UsageReport:
    every = gather_objects(rt, unused)
    return UsageReport(steps=len(unused), num_trainable=num_trainable, unused=every)


def choose_ddp_options(report: UsageReport | None, cfg: ParallelConfig) -> DDPChoice:
    """The check's choice, then the user's explicit settings on top (logged either way)."""
    if report is None:
        find_unused, static, reason = False, False, "the check did not run (parallel.check_steps = 0)"
    elif not report.any_unused:
        find_unused, static, reason = False, False, "every parameter received a gradient in every checked step"
    elif report.constant:
        find_unused, static = False, True
        reason = ("the same parameters went unused in every checked step on every rank; if a later step uses "
                  "them DDP stops with 'graph has changed': then set parallel.find_unused_parameters: true")
    else:
        find_unused, static, reason = True, False, "the unused parameters differ between steps or ranks"
    overridden = []
    if cfg.find_unused_parameters != "auto":
        find_unused = cfg.find_unused_parameters == "true"
        overridden.append(f"find_unused_parameters={find_unused}")
    if cfg.static_graph != "auto":
        static = cfg.static_graph == "true"
        overridden.append(f"static_graph={static}")
    if overridden:
        reason += f"; set in the config: {', '.join(overridden)}"
    return DDPChoice(find_unused, static, reason)


class GradientDivergence(RuntimeError):
    """`parallel.check_grads`: ranks hold different gradients after the all-reduce."""


def gradient_digests(model: nn.Module) -> list[tuple[str, str]]:
    """(name, 16-hex-digit hash of the gradient's bytes) for every parameter that has a gradient.

    Bytes, not a float sum: after DDP's all-reduce every rank must hold bit-identical gradients,
    and a sum can hide a difference.
    """
    out = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            data = p.grad.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            out.append((name, hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()))
        elif p.requires_grad:
            out.append((name, "no-grad"))
    return out


def check_gradients_agree(rt: Runtime, model: nn.Module, step: int) -> None:
    """Raise GradientDivergence on every rank, naming the first parameter whose gradient differs."""
    every = gather_objects(rt, gradient_digests(model))
    reference = dict(every[0])
    for rank, digests in enumerate(every[1:], start=1):
        if [n for n, _ in digests] != list(reference):
            raise GradientDivergence(
                f"step {step}: rank {rank} has gradients for other parameters than rank 0; the model differs "
                "between ranks (built from different code or config?)")
    for name, digest in every[0]:
        values = {rank: dict(d)[name] for rank, d in enumerate(every)}
        if len(set(values.values())) > 1:
            differing = [r for r, v in values.items() if v != digest]
            raise GradientDivergence(
                f"step {step}: the gradient of {name!r} differs between ranks (rank 0 != rank(s) {differing}; "
                f"hashes {values}). After DDP's all-reduce every rank must hold the same gradient: something "
                "changed it outside DDP (a hook, a rank-dependent scaling, a parameter DDP does not know of), "
                "or the all-reduce skipped it (an unused parameter with find_unused_parameters off)")
