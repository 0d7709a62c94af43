"""Pipeline parallelism for the built-in GPT with torch.distributed.pipelining: one stage per rank
of the pipeline group, with data-parallel replicas of each stage and tensor-parallel peers in it.

    stage 0:     tok_emb, pos_emb, blocks 0 .. a-1
    stage s:     blocks of stage s
    last stage:  blocks .. layers-1, ln_f, head

Each stage is the GPT itself with the other stages' parts set to None, so its parameters keep their
full-model names (blocks.3.attn.qkv.weight) and the stages' state_dicts partition the model's.
Blocks are split as evenly as possible; the first stages take the extra ones.

The head is tied to the token embedding, and they live on the last and the first stage: each holds a
copy, the two start equal (stage 0's is sent to the last), and after every backward each adds the other's
gradient, which is what the single tied tensor gets. Equal gradients, equal optimizer steps: the copies
stay identical.

Replicas (dp > 1): after the schedule, each stage's gradients are averaged over its data-parallel
group in one all-reduce per dtype (written here: DDP takes no tensor-parallel DTensor parameters,
and its reducer fails under torch's schedules at its first bucket rebuild, having seen each
parameter's gradient once per micro-batch; the average comes before the tied copies are summed, so
every replica sums the same values). Tensor parallelism (tp > 1) is applied to the whole GPT before
the cut (lockstep.parallel.tp): every parameter is then a DTensor, and what stages send each other
are plain activations, the same on every tensor-parallel peer; the tied copies are exchanged as
local tensors.

torch.distributed.pipelining sizes its send/receive buffers from the first batch it sees (again after
switching between training and evaluation); a batch of another shape would abort the processes inside
gloo, so `Pipeline` refuses it with an error instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from lockstep.models.gpt import GPT, lm_loss

# (logits (b, T, V), targets (b, T)) -> mean loss
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_layers(layers: int, num_stages: int) -> list[range]:
    """The block indices of each stage: as even as possible, the first stages one more.

    stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    """
    if not 1 <= num_stages <= layers:
        raise ValueError(
            f"{num_stages} pipeline stages for {layers} layers: each stage needs at least one block; "
            f"use 1 to {layers} stages"
        )
    base, extra = divmod(layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class _StageForward(nn.Module):
    """What the pipeline runs: the stage's part of the GPT, under autocast, passing on one tensor
    (hidden states (b, T, C), or the logits (b, T, V) on the last stage)."""

    def __init__(self, module: GPT, autocast: contextlib.AbstractContextManager) -> None:
        super().__init__()
        self.module = module
        self.autocast = autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast:
            return self.module(x)[0]


Lap = Callable[[str], None]  # StepClock.lap: the time since the last lap went to this phase


class ChunkLaps:
    """A step clock's laps inside the schedule, for the bubble as a cause of its own: the time up to
    each of this stage's forward and backward chunks is `bubble` (waiting for a neighbouring stage,
    and the sends and receives), the chunk itself `compute` (and the last stage's loss after it).

    For one step, timing() puts timed stand-ins for the stage's forward_one_chunk and
    backward_one_chunk (what every torch.distributed.pipelining schedule calls) on the stage
    object, and takes them off after; a torch whose stage has neither keeps the step in compute."""

    CHUNKS = ("forward_one_chunk", "backward_one_chunk")

    def __init__(self) -> None:
        self.lap: Lap | None = None

    def __call__(self, phase: str) -> None:
        if self.lap is not None:
            self.lap(phase)

    @contextlib.contextmanager
    def timing(self, stage: PipelineStage, lap: Lap | None) -> Iterator[bool]:
        """Yields whether the chunks are timed."""
        names = [n for n in self.CHUNKS if lap is not None and callable(getattr(stage, n, None))]
        for name in names:
            setattr(stage, name, self._timed(getattr(stage, name)))
        self.lap = lap
        try:
            yield bool(names)
        finally:
            self.lap = None
            for name in names:
                delattr(stage, name)  # the class's method again

    def _timed(self, chunk: Callable) -> Callable:
        def timed(*args, **kwargs):
            self("bubble")
            try:
                return chunk(*args, **kwargs)
            finally:
                self("compute")

        return timed


class Pipeline:
    """One rank's stage of a pipelined GPT; build it with `build_pipeline`."""

    def __init__(
        self,
        module: GPT,
        stage: PipelineStage,
        schedule: ScheduleGPipe | Schedule1F1B,
        group: dist.ProcessGroup,
        n_microbatches: int,
        laps: ChunkLaps | None = None,
        replicas: dist.ProcessGroup | None = None,
    ) -> None:
        # this stage's part of the model: for the optimizer, clipping and checkpoints
        self.module = module
        self.replicas = replicas  # the stage's data-parallel group (None: one replica)
        self.laps = laps or ChunkLaps()
        self.stage = stage
        self.schedule = schedule
        self.group = group
        self.n_microbatches = n_microbatches
        self._shapes: dict[
            str, tuple[int, ...]
        ] = {}  # "step" / "evaluate" -> the batch shape the buffers fit

    @property
    def stage_index(self) -> int:
        return self.stage.stage_index

    @property
    def num_stages(self) -> int:
        return self.stage.num_stages

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of the token embedding = head, if it holds one."""
        if self.module.tok_emb is not None:
            return self.module.tok_emb.weight
        return self.module.head.weight if self.module.head is not None else None

    def step(self, x: torch.Tensor, y: torch.Tensor, lap: Lap | None = None) -> torch.Tensor:
        """Forward and backward over token ids x and targets y (n_microbatches * micro, T), the same
        batch on every stage (the first reads x, the last y). Returns the mean loss, on every stage.

        Leaves the gradients of the mean loss in `module`'s .grad, tied copies included. Zero the
        gradients before (optimizer.zero_grad()): the schedule divides every .grad by n_microbatches.
        `lap` (a step clock's, lockstep.train.step_clock) is told where compute, the bubble and the
        tied gradients' exchange end (ChunkLaps).
        """
        self._check_shape("step", x)
        losses: list[torch.Tensor] = []
        with self.laps.timing(self.stage, lap) as timed:
            # every micro-batch loss is a mean: the schedule divides the gradients by n_microbatches
            self.schedule.step(
                *self._inputs(x),
                target=y if self.stage.is_last else None,
                losses=losses,
                return_outputs=False,
            )
            self.laps("bubble" if timed else "compute")  # the last sends' waits
        self._average_over_replicas()
        self._sum_tied_grads()
        loss = self._mean_loss(losses)
        if lap is not None:
            lap("comm")
        return loss

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss of x, y in eval mode (forward only), on every stage."""
        self._check_shape("evaluate", x)
        was_training = self.module.training
        self.module.eval()
        losses: list[torch.Tensor] = []
        try:
            self.schedule.eval(
                *self._inputs(x), target=y if self.stage.is_last else None, losses=losses
            )
        finally:
            self.module.train(was_training)
        return self._mean_loss(losses)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the whole model's gradients to 2-norm max_norm (max_norm <= 0 only measures); returns the
        norm before clipping, the same on every stage. The tied copies count once (on the first stage)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        counted_twice = self.tied_weight if self.stage.is_last and not self.stage.is_first else None
        grads = [p.grad for p in params if p is not counted_twice]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(norm, DTensor):  # tensor-parallel gradients: the norm over the peers' shards
            norm = norm.full_tensor()
        sq = norm.float() ** 2
        dist.all_reduce(sq, group=self.group)
        total = sq.sqrt()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def _check_shape(self, kind: str, x: torch.Tensor) -> None:
        if x.size(0) % self.n_microbatches:
            raise ValueError(
                f"batch of {x.size(0)} sequences does not split into {self.n_microbatches} equal "
                f"micro-batches; pass a multiple of {self.n_microbatches}"
            )
        first = self._shapes.setdefault(kind, tuple(x.shape))
        if tuple(x.shape) != first:
            raise ValueError(
                f"pipeline {kind}() got a batch of shape {tuple(x.shape)}, the first was {first}: the pipeline's "
                f"send/receive buffers fit one shape; pad or drop the odd batch so that every {kind}() batch is {first}"
            )

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x,) if self.stage.is_first else ()

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        loss = (
            torch.stack(losses).detach().float().mean() if self.stage.is_last else torch.zeros(())
        )
        dist.broadcast(loss, group_src=self.num_stages - 1, group=self.group)
        return loss

    def _average_over_replicas(self) -> None:
        if self.replicas is None:
            return
        grads = [_local(p.grad) for p in self.module.parameters() if p.grad is not None]
        n = dist.get_world_size(self.replicas)
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.replicas)  # a sum: gloo has no average
            flat.div_(n)
            for g, part in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(part.view_as(g))

    def _sum_tied_grads(self) -> None:
        if self.num_stages == 1 or not (self.stage.is_first or self.stage.is_last):
            return
        grad = _local(self.tied_weight.grad)
        peer = self.num_stages - 1 if self.stage.is_first else 0
        theirs = torch.empty_like(grad)
        ops = [
            dist.P2POp(dist.isend, grad, group=self.group, group_peer=peer),
            dist.P2POp(dist.irecv, theirs, group=self.group, group_peer=peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        # a + b == b + a exactly in floating point: both copies get the same bits
        grad.add_(theirs)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel (DTensor) parameter's or gradient's local tensor, its storage shared."""
    return t.to_local() if isinstance(t, DTensor) else t


def build_pipeline(
    model: GPT,
    pp_mesh: DeviceMesh,
    schedule: str,
    n_microbatches: int,
    loss_fn: LossFn = lm_loss,
    autocast: contextlib.AbstractContextManager | None = None,
    *,
    dp_mesh: DeviceMesh | None = None,
) -> Pipeline:
    """Cut `model` in place down to this rank's stage of the 1-D `pp_mesh` and return its pipeline.

    The stage index is this rank's position in `pp_mesh`. Every rank builds the full model first
    (same config; the tied embedding is copied from stage 0, the rest each stage keeps as it is).
    `dp_mesh`: the stage's data-parallel replicas (a 1-D mesh), whose gradients are averaged once
    a step.
    `schedule`: "gpipe" (all forwards, then all backwards) or "1f1b" (one forward, one backward in the
    steady state: at most num_stages micro-batches of activations alive; needs n_microbatches >= stages).
    `loss_fn` must return a mean over its micro-batch; `autocast` wraps every stage's forward and the loss.
    """
    group = pp_mesh.get_group()
    stage_index, num_stages = pp_mesh.get_local_rank(), pp_mesh.size()
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches = {n_microbatches} must be >= 1")
    match schedule:
        case "gpipe":
            schedule_cls = ScheduleGPipe
        case "1f1b":
            schedule_cls = Schedule1F1B
            if n_microbatches < num_stages:
                raise ValueError(
                    f"the 1f1b schedule needs at least as many micro-batches as stages: {n_microbatches} < "
                    f"{num_stages}; raise the micro-batch count (train.grad_accum) to >= {num_stages} or use gpipe"
                )
        case _:
            raise ValueError(f"pipeline schedule {schedule!r} is not one of 'gpipe', '1f1b'")

    mine = stage_layers(model.cfg.layers, num_stages)[stage_index]
    for i in range(model.cfg.layers):
        if i not in mine:
            model.blocks[i] = None
    is_first, is_last = stage_index == 0, stage_index == num_stages - 1
    if not is_first:
        model.tok_emb = model.pos_emb = None
    if not is_last:
        model.ln_f = model.head = None

    if num_stages > 1:  # both tied copies start from stage 0's values
        if is_first:
            dist.send(_local(model.tok_emb.weight.detach()), group_dst=num_stages - 1, group=group)
        elif is_last:
            dist.recv(_local(model.head.weight.detach()), group_src=0, group=group)
    autocast = autocast or contextlib.nullcontext()
    device = next(model.parameters()).device
    stage = PipelineStage(
        _StageForward(model, autocast), stage_index, num_stages, device, group=group
    )

    laps = ChunkLaps()

    def loss_under_autocast(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast:
            loss = loss_fn(logits, targets)
        laps("compute")  # the last stage's loss, after its forward chunk, is its compute too
        return loss

    return Pipeline(
        model,
        stage,
        schedule_cls(stage, n_microbatches, loss_fn=loss_under_autocast),
        group,
        n_microbatches,
        laps,
        replicas=dp_mesh.get_group() if dp_mesh is not None and dp_mesh.size() > 1 else None,
    )
