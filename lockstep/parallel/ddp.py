"""Data parallelism with DistributedDataParallel, and the guard that keeps a wrong DDP setting from hanging a run.

DDP wraps the model *together with its loss function*: the wrapped forward takes a batch and returns
the scalar loss, so DDP looks for used parameters from the loss alone. A model's own output can hold
tensors the loss never touches, or be an object DDP cannot search (a SimpleNamespace with `.loss`);
with find_unused_parameters=True the latter stops DDP with "Expected to mark a variable ready only once"
(seen with torch 2.13).

DDP told that no parameter goes unused (find_unused_parameters=False, or static_graph=True) waits
for an all-reduce of every parameter in every step. A micro-batch whose loss does not reach one
leaves the ranks' all-reduces out of step: a hang, a gloo "collective mismatch" abort, or silently
different gradients. `UsageGuard` checks, before each step's all-reducing backward, that the loss
reaches what DDP expects, and all ranks agree on the answer: a wrong setting stops every rank with
one message instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lockstep.collectives import failed_ranks, gather_objects
from lockstep.errors import UnusedParameterError
from lockstep.runtime import Runtime

# (model, batch on the device[, divisor]) -> scalar loss: the workload's Loss (lockstep.models.loss), or a function
ForwardLoss = Callable[..., torch.Tensor]

# autograd nodes that run a backward of their own: parameters used inside them are not in the outer graph
_OPAQUE_NODES = ("CheckpointFunctionBackward",)  # torch.utils.checkpoint(use_reentrant=True)


class LossModule(nn.Module):
    """The model with its loss: forward(batch, divisor=None) = loss(model, batch[, divisor]), a scalar. What DDP
    wraps, and what the step calls in every layout (FSDP and TP reduce inside the model's own hooks)."""

    def __init__(self, model: nn.Module, loss: ForwardLoss):
        super().__init__()
        self.model = model
        self.loss = loss
        # parameters the model asked DDP to leave alone (torch's own convention), under their names here
        ignored = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
        if ignored:
            self._ddp_params_and_buffers_to_ignore = [f"model.{name}" for name in ignored]

    def forward(self, batch: Any, divisor: int | None = None) -> torch.Tensor:
        if divisor is None:
            return self.loss(self.model, batch)
        return self.loss(self.model, batch, divisor)


def apply_ddp(
    model: nn.Module,
    rt: Runtime,
    loss: ForwardLoss,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    bucket_cap_mb: float = 25.0,
    gradient_as_bucket_view: bool = True,
    broadcast_buffers: bool = True,
) -> nn.Module:
    """A module whose forward(batch[, divisor]) returns the loss, its gradients averaged across ranks by DDP.

    Built once: the trainer keeps both the wrapper (for forward/backward and no_sync) and the unwrapped
    model (for the optimizer, clipping and checkpoints). On one process it is the loss module alone.
    """
    loss_module = LossModule(model, loss)
    if not rt.distributed:
        return loss_module
    if find_unused_parameters and not static_graph:
        # torch's reducer prints "find_unused_parameters=True was specified ... but did not find any unused
        # parameters" from C++ on every rank (no Python warning filter reaches it) whenever a step uses them all,
        # which contradicts lockstep's logged reason: a branch that step skipped is what the setting is for.
        # A parameter that no forward uses, outside the model (never optimized or saved), keeps it quiet.
        loss_module.never_used = nn.Parameter(torch.zeros(1, device=rt.device))
    return DDP(
        loss_module,
        device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        bucket_cap_mb=bucket_cap_mb,  # parallel.bucket_cap_mb: smaller buckets start all-reducing earlier in backward
        gradient_as_bucket_view=gradient_as_bucket_view,  # gradients live in the buckets: one less copy per step
        **{
            _SYNC_BUFFERS: broadcast_buffers
        },  # rank 0's buffers to all before each forward (parallel/buffers.py)
    )


# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns); both mean the
# same here, as every rank builds the same model from the same seed (the init broadcast changes nothing)
_SYNC_BUFFERS = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DDP).parameters
    else "broadcast_buffers"
)


def syncs_buffers(module: nn.Module) -> bool:
    """Whether a DDP-wrapped module sends rank 0's buffers to every rank before each forward."""
    return bool(getattr(module, _SYNC_BUFFERS, True))


def reachable_parameters(loss: torch.Tensor) -> tuple[set[int], bool]:
    """(ids of the leaf tensors that backward from `loss` reaches, whether the graph holds an opaque node).

    The same walk DDP does for find_unused_parameters, in Python (no API exposes DDP's): backward fires
    a parameter's gradient hook exactly when its AccumulateGrad node is reachable from the loss. Behind an
    opaque node (reentrant checkpointing) parameters are used but invisible, so the answer is incomplete.
    """
    reached: set[int] = set()
    opaque = False
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if variable is not None:
            reached.add(id(variable))
        opaque = opaque or type(node).__name__ in _OPAQUE_NODES
        stack.extend(fn for fn, _ in node.next_functions)
    return reached, opaque


class UsageGuard:
    """Before each step's all-reducing backward: does the loss reach what DDP waits for, on every rank?

    Plain DDP waits for every trainable parameter. static_graph=True waits for the parameters step 1
    used, on every rank alike. One all-reduce of a flag per step (on the CPU control group) lets every
    rank learn at once that one of them would break DDP; then they exchange the names and all raise
    UnusedParameterError with the same message, before any gradient bucket is all-reduced.
    """

    def __init__(self, rt: Runtime, model: nn.Module, static_graph: bool, why: str, log=None):
        self.rt, self.static_graph, self.why, self.log = rt, static_graph, why, log
        # DDP does not wait for these
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        self.names = {
            id(p): name
            for name, p in model.named_parameters()
            if p.requires_grad and name not in ignored
        }
        # static: after step 1
        self.expected: set[str] | None = None if static_graph else set(self.names.values())
        self.blind = False

    def __call__(self, loss: torch.Tensor, step: int) -> None:
        """Every rank calls this once per step, before the backward that all-reduces (it is a collective)."""
        reached, opaque = reachable_parameters(loss)
        if opaque and not self.blind and self.log is not None:
            self.log.warning(
                "DDP guard: the loss's graph holds reentrant checkpointing, which hides the parameters "
                "used inside it, so a parameter that a batch leaves out cannot be caught before DDP "
                "hangs; use torch.utils.checkpoint(..., use_reentrant=False)"
            )
        self.blind = self.blind or opaque
        # None: cannot tell
        names = None if opaque else {self.names[i] for i in reached if i in self.names}
        if self.expected is None:
            self._agree_on_first_step(names, step)
            return
        problem = None
        if names is not None and names != self.expected:
            problem = (sorted(self.expected - names), sorted(names - self.expected))
        if failed_ranks(self.rt, problem is None):
            self._raise(step, gather_objects(self.rt, problem))

    def _agree_on_first_step(self, names: set[str] | None, step: int) -> None:
        every = gather_objects(self.rt, names)
        known = [u for u in every if u is not None]
        union = set().union(*known) if known else set(self.names.values())
        problems = [
            (sorted(union - u), []) if u is not None and u != union else None for u in every
        ]
        if any(problems):
            self._raise(step, problems)
        self.expected = union

    def _raise(self, step: int, problems: list) -> None:
        lines = []
        for rank, problem in enumerate(problems):
            if problem is None:
                continue
            missing, extra = problem
            if missing:
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                lines.append(
                    f"rank {rank}: no gradient for {', '.join(map(repr, missing[:3]))}{more}"
                )
            if extra:
                lines.append(
                    f"rank {rank}: a gradient for {', '.join(map(repr, extra[:3]))}, which step 1 left out"
                )
        if self.static_graph:
            rule = "DDP runs with static_graph=True, which needs the same parameters used in every step on every rank"
            fix = (
                "set parallel.static_graph: false and leave parallel.find_unused_parameters at auto, which handles "
                "parameters that some batches skip"
            )
        else:
            rule = "DDP runs with find_unused_parameters=False and would wait forever for the missing all-reduce"
            fix = (
                "set parallel.find_unused_parameters: true (or auto, which chooses it for models whose forward "
                "lockstep cannot see into)"
            )
        raise UnusedParameterError(
            f"step {step}: the loss did not reach every parameter DDP expects ({'; '.join(lines)}). {rule} "
            f"({self.why}). Stopped before this step's gradients were all-reduced: {fix}"
        )
