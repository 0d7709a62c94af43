"""The DDP compatibility check, the choice of DDP settings, and the gradient-hash debug mode.

DDP must know whether a step can leave a parameter without a gradient. Told "never"
(find_unused_parameters=False), it waits for every parameter's all-reduce, and a micro-batch
whose loss skips one breaks the run (a hang or a gloo abort). Teams that hit that concluded "DDP
cannot work" for models with conditional branches. With find_unused_parameters=True, DDP walks the
loss's autograd graph each step and handles any pattern of unused parameters, across ranks and
across no_sync micro-batches alike (tested); on the CPUs measured it costs about nothing
(BENCHMARKS.md, "DDP settings").

The choice (`choose_ddp_options`), unless the config sets it:

    the built-in GPT                      -> plain DDP: its forward uses every parameter, always
    any other model                       -> find_unused_parameters=True: its forward may branch on
                                             the data, and no check of a few batches can rule out a
                                             branch that a rare batch takes
    static_graph                          -> never chosen; refused with grad_accum > 1, where torch's
                                             reducer fails under no_sync ("expect_autograd_hooks_")

The check runs the first steps' real micro-batches forward on the bare model, one micro-batch at a
time (as DDP sees them: under no_sync accumulation, the last micro-batch alone must reach every
parameter), and reports which parameters each one's loss left out. It leaves no trace in the model
(lockstep.parallel.buffers.no_trace): training then runs those micro-batches as their first forward.
Its report explains the choice;
when it sees parameters go unused, find_unused_parameters is chosen even for a model lockstep
trusts. A setting that the data then proves wrong is stopped by lockstep.parallel.ddp.UsageGuard.
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
from lockstep.errors import ConfigError, GradientDivergence
from lockstep.parallel.buffers import no_trace
from lockstep.parallel.ddp import reachable_parameters
from lockstep.rng import capture_rng_state, restore_rng_state
from lockstep.runtime import Runtime


@dataclass
class DDPChoice:
    find_unused_parameters: bool
    static_graph: bool
    reason: str
    # the UsageGuard checks every step (DDP was told what it cannot be sure of)
    guarded: bool = False
    hint: str = ""  # the faster setting, and when it is safe


@dataclass
class UsageReport:
    """Which trainable parameters each checked micro-batch's loss left out: unused[rank][step][micro] = names."""

    num_trainable: int
    unused: list[list[list[list[str]]]]
    # some graph held reentrant checkpointing: parameters inside it look unused
    opaque: bool = False

    @property
    def micro_batches(self) -> int:
        return sum(len(step) for rank in self.unused for step in rank)

    @property
    def any_unused(self) -> bool:
        return any(names for rank in self.unused for step in rank for names in step)

    def counts(self) -> dict[str, list[int]]:
        """name -> micro-batches that left it out, per rank."""
        out: dict[str, list[int]] = {}
        for rank, steps in enumerate(self.unused):
            for names in (names for step in steps for names in step):
                for name in names:
                    out.setdefault(name, [0] * len(self.unused))[rank] += 1
        return out

    def format(self, limit: int = 8) -> str:
        ranks, steps = len(self.unused), max((len(r) for r in self.unused), default=0)
        per_rank = self.micro_batches // max(ranks, 1)
        shape = f"{steps} step(s) x {per_rank // max(steps, 1)} micro-batch(es) x {ranks} rank(s)"
        if not self.any_unused:
            return (
                f"the loss of each of the {self.micro_batches} micro-batches checked ({shape}) reached all "
                f"{self.num_trainable} trainable parameters"
            )
        counts = self.counts()
        lines = [
            f"{len(counts)} of {self.num_trainable} trainable parameters went unused in some of the "
            f"{self.micro_batches} micro-batches checked ({shape}):"
        ]
        for name, per in sorted(counts.items(), key=lambda kv: (-sum(kv[1]), kv[0]))[:limit]:
            by_rank = ", ".join(f"rank {r}: {n}/{per_rank}" for r, n in enumerate(per))
            lines.append(f"  {name}: unused in {sum(per)} of {self.micro_batches} ({by_rank})")
        if len(counts) > limit:
            lines.append(f"  ... and {len(counts) - limit} more")
        if self.opaque:
            lines.append(
                "  (reentrant checkpointing hides the parameters used inside it: they may be used after all)"
            )
        return "\n".join(lines)


def find_unused_parameters(
    model: nn.Module,
    steps: Iterable[list[Any]],
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    autocast: contextlib.AbstractContextManager,
) -> tuple[list[list[list[str]]], bool]:
    """Per step, per micro-batch: the trainable parameters its loss does not reach; and whether some graph was
    opaque (reentrant checkpointing). Forward only, and it leaves no trace: the RNG, every buffer (BatchNorm
    statistics, counters, EMAs) and the modules' plain attributes are restored afterwards (no_trace), so
    training then sees each of these micro-batches once, as with parallel.check_steps: 0."""
    rng = capture_rng_state()
    was_training = model.training
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    unused: list[list[list[str]]] = []
    opaque = False
    try:
        with no_trace(model):
            model.train()
            for micro_batches in steps:
                unused.append([])
                for batch in micro_batches:
                    with autocast:
                        loss = loss_of(model, batch)
                    reached, hidden = reachable_parameters(loss)
                    opaque = opaque or hidden
                    unused[-1].append(sorted(n for i, n in trainable.items() if i not in reached))
                    del loss  # frees the graph before the next micro-batch
    finally:
        model.train(was_training)
        restore_rng_state(rng)
    return unused, opaque


def gather_usage(
    rt: Runtime, unused: list[list[list[str]]], num_trainable: int, opaque: bool
) -> UsageReport:
    every = gather_objects(rt, (unused, opaque))
    return UsageReport(num_trainable, [u for u, _ in every], any(o for _, o in every))


def check_static_graph(cfg: ParallelConfig, grad_accum: int) -> None:
    """static_graph cannot run with no_sync accumulation: refuse it before any process starts."""
    if cfg.static_graph == "true" and grad_accum > 1:
        raise ConfigError(
            f"parallel.static_graph: true with grad_accum {grad_accum}: DDP's static graph fails under no_sync "
            "gradient accumulation (torch's reducer stops with 'expect_autograd_hooks_ INTERNAL ASSERT FAILED'). "
            "Set parallel.static_graph to auto (lockstep then lets DDP find unused parameters), or make grad_accum 1 "
            "(train.micro_batch_size = train.batch_size / world size)"
        )


def choose_ddp_options(
    report: UsageReport | None, cfg: ParallelConfig, grad_accum: int, uses_all_parameters: bool
) -> DDPChoice:
    """The DDP settings for this model, the reason, and whether the UsageGuard must watch them.

    `uses_all_parameters`: every forward reaches every trainable parameter by construction (the built-in
    GPT). `report`: the check's evidence, None when it did not run.
    """
    check_static_graph(cfg, grad_accum)
    auto, reason = _choose_find_unused(report, uses_all_parameters)
    find_unused = (
        auto if cfg.find_unused_parameters == "auto" else cfg.find_unused_parameters == "true"
    )
    static = cfg.static_graph == "true"
    overridden = [
        f"{key}={value}"
        for key, value, setting in (
            ("find_unused_parameters", find_unused, cfg.find_unused_parameters),
            ("static_graph", static, cfg.static_graph),
        )
        if setting != "auto"
    ]
    hint = ""
    if overridden:
        hint = (
            f"lockstep's own choice would be find_unused_parameters={auto}: {reason}"
            if find_unused != auto
            else ""
        )
        reason = f"set in the config: {', '.join(overridden)}"
    elif find_unused and not (report is not None and report.any_unused):
        hint = (
            "if no batch can leave a parameter out, parallel.find_unused_parameters: false skips DDP's graph walk "
            '(a small saving; BENCHMARKS.md, "DDP settings"), and lockstep stops the run, naming the parameter, '
            "at the first micro-batch that proves it wrong"
        )
    guarded = (static or not find_unused) and not uses_all_parameters
    return DDPChoice(find_unused, static, reason, guarded, hint)


def _choose_find_unused(report: UsageReport | None, uses_all_parameters: bool) -> tuple[bool, str]:
    if report is not None and report.any_unused:
        return True, "needed: micro-batches of the check left parameters out"
    if uses_all_parameters:
        return False, "the built-in GPT uses every parameter in every forward pass"
    evidence = (
        f"the check saw every parameter used in each of its {report.micro_batches} micro-batches"
        if report is not None
        else "the check did not run (parallel.check_steps = 0)"
    )
    return True, (
        f"{evidence}, but this model's forward may branch on its data, and a branch that only a rare "
        "batch takes would hang plain DDP"
    )


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
                "between ranks (built from different code or config?)"
            )
    for name, digest in every[0]:
        values = {rank: dict(d)[name] for rank, d in enumerate(every)}
        if len(set(values.values())) > 1:
            differing = [r for r, v in values.items() if v != digest]
            raise GradientDivergence(
                f"step {step}: the gradient of {name!r} differs between ranks (rank 0 != rank(s) {differing}; "
                f"hashes {values}). After DDP's all-reduce every rank must hold the same gradient: something "
                "changed it outside DDP (a hook, a rank-dependent scaling, a parameter DDP does not know of), "
                "or the all-reduce skipped it (an unused parameter with find_unused_parameters off)"
            )
