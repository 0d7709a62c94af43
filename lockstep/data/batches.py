"""This rank's batches: its micro-batches of every step from the data cursor on, and its held-out share.

The trainer reads its data through one `Batches`, built once the resume point is known:

    peek(n)         the next n micro-batches, read ahead and served again (the DDP check looks at them)
    next_step()     one optimizer step's grad_accum micro-batches (StepBatches), the tokens in them and
                    the time spent waiting for the loader
    cursor_at(s)    the data cursor after step s: where a checkpoint of step s continues, at any world size
    epochs_done(s)  passes over the data done after step s, as HF's float epoch
    held_out()      this rank's held-out micro-batches, collated (empty: no evaluation)

Which samples a step reads is decided by the global cursor (lockstep.data.sampler), never by this
(prefetching) stream: a cursor is computed, so a resume at another world size reads the same samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lockstep.data.sampler import (
    Cursor,
    GlobalCursorSampler,
    available_cores,
    build_loader,
    cursor_after,
    eval_micro_batches,
    resolve_num_workers,
    steps_per_epoch,
)
from lockstep.parallel.mesh import BatchPlan


@dataclass
class StepBatches:
    """One optimizer step's micro-batches on this rank, as the loader gave them (on the CPU)."""

    micro_batches: list[Any]
    tokens: int  # tokens in them (the workload's count_tokens), 0 where it counts none
    wait: float  # seconds blocked on the loader while reading them


@dataclass(frozen=True)
class DataSource:
    """What a workload reads: its datasets and how their samples become batches."""

    train: Dataset
    collate: Callable[[list[Any]], Any]
    eval: Dataset | None = None
    lengths: np.ndarray | None = None  # per-sample lengths for a bucketed order (audio durations)
    count_tokens: Callable[[Any], int] | None = None  # tokens in a (CPU) batch, for tokens/s


@dataclass(frozen=True)
class Reading:
    """How this rank reads: where its share starts and ends, and the loader's settings."""

    plan: BatchPlan
    dp_rank: int  # the data is split by data-parallel rank: tp / pp peers read the same samples
    dp: int  # data-parallel ranks
    seed: int
    start: Cursor  # the data cursor at `start_step`
    start_step: int
    last_step: int
    num_workers: int | str = 0  # data.num_workers
    prefetch_factor: int = 2
    pin_memory: bool = False
    local_world_size: int = 1  # ranks on this node share its cores (data.num_workers auto)
    eval_batches: int = 0  # train.eval_batches: the most held-out micro-batches per rank


class Batches:
    """This rank's micro-batches from the cursor on (a DataLoader over GlobalCursorSampler), and its
    held-out share (eval_micro_batches). Built once; it serves each step once."""

    def __init__(self, source: DataSource, reading: Reading) -> None:
        self.source, self.reading, self.plan = source, reading, reading.plan
        steps = max(0, reading.last_step - reading.start_step)
        sampler = GlobalCursorSampler(
            len(source.train),
            reading.plan,
            reading.dp_rank,
            reading.seed,
            reading.start,
            steps,
            source.lengths,
        )
        workers, self.workers_note = resolve_num_workers(
            reading.num_workers, reading.local_world_size, available_cores()
        )
        loader = build_loader(
            source.train,
            sampler,
            workers,
            reading.prefetch_factor,
            pin_memory=reading.pin_memory,
            collate_fn=source.collate,
        )
        self._stream: Iterator[Any] = iter(loader)
        self._ahead: list[Any] = []  # read by peek(), served first
        self.step = reading.start_step  # the steps served so far end here
        self.eval_indices = (
            eval_micro_batches(
                len(source.eval),
                reading.plan.micro_batch,
                reading.dp_rank,
                reading.dp,
                reading.eval_batches,
            )
            if source.eval is not None
            else []
        )

    def peek(self, n: int) -> list[Any]:
        """The next n micro-batches, read ahead: next_step() serves them again, so none is read twice."""
        while len(self._ahead) < n:
            self._ahead.append(next(self._stream))
        return self._ahead[:n]

    def next_step(self) -> StepBatches:
        """The next optimizer step's grad_accum micro-batches."""
        micro_batches, wait, tokens = [], 0.0, 0
        count = self.source.count_tokens
        for _ in range(self.plan.grad_accum):
            start = time.perf_counter()
            batch = self._ahead.pop(0) if self._ahead else next(self._stream)
            wait += time.perf_counter() - start  # blocked on the loader (workers behind, or none)
            tokens += count(batch) if count else 0  # on the CPU copy: no device sync
            micro_batches.append(batch)
        self.step += 1
        return StepBatches(micro_batches, tokens, wait)

    def cursor_at(self, step: int) -> Cursor:
        """The data cursor after `step`, by arithmetic from the one the run started at."""
        r = self.reading
        return cursor_after(
            len(self.source.train), r.seed, r.start, self.plan.global_batch, step - r.start_step
        )

    def epochs_done(self, step: int) -> float:
        """Passes over the data done after `step`: whole epochs plus the share of this one's steps done
        (as HF's float epoch)."""
        return epochs_done(self.cursor_at(step), len(self.source.train), self.plan.global_batch)

    def steps_per_epoch(self) -> int:
        return steps_per_epoch(len(self.source.train), self.plan.global_batch)

    def held_out(self) -> Iterator[Any]:
        """This rank's held-out micro-batches, collated as training's; none when there is no eval split."""
        source = self.source
        return (source.collate([source.eval[i] for i in batch]) for batch in self.eval_indices)


def epochs_done(cursor: Cursor, num_samples: int, global_batch: int) -> float:
    """Passes over the data done at `cursor`, as HF's float epoch: whole epochs plus the share of
    this one's steps done (an epoch is its steps_per_epoch batches; a tail short of a batch is
    dropped, and a cursor too close to the end for another batch has finished its epoch)."""
    per_epoch = steps_per_epoch(num_samples, global_batch) * global_batch  # samples an epoch uses
    return cursor.epoch + min(1.0, cursor.offset / per_epoch)
