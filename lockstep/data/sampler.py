"""The global data cursor: which samples each rank reads at each step, independent of world size.

Epoch e's order is a permutation seeded by (seed, e). An optimizer step takes the next
`global_batch` indices of that order and splits them into world_size x grad_accum
micro-batches; rank r reads its slices by *global* rank. The cursor (epoch, samples of the
epoch consumed) is all a checkpoint needs to resume at the exact sample, in O(1), at any
world size that keeps the global batch.

    permutation of epoch e:  [ step 0 (global_batch) | step 1 | ... | dropped tail < global_batch ]
    one step, world 2, accum 2, micro 2:  [m0 r0 | m0 r1 | m1 r0 | m1 r1]
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lockstep.errors import ConfigError, DataError
from lockstep.parallel.mesh import BatchPlan


@dataclass
class Cursor:
    epoch: int = 0  # epoch of the next step
    offset: int = 0  # samples of this epoch's permutation already consumed

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cursor:
        return cls(epoch=int(d["epoch"]), offset=int(d["offset"]))


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order of 0..num_samples-1, a function of (seed, epoch) only."""
    return np.random.default_rng((seed, epoch)).permutation(num_samples)


def bucketed_permutation(
    lengths: np.ndarray, seed: int, epoch: int, global_batch: int, pool_batches: int = 32
) -> np.ndarray:
    """Epoch `epoch`'s order with samples of similar length in the same global batch.

    A function of (lengths, seed, epoch, global_batch) only, so the cursor protocol is unchanged:
    a seeded permutation; its first len % global_batch samples become the (dropped) tail; the rest
    is cut into pools of `pool_batches` global batches, each pool sorted by length and cut into
    batches, and the batches are shuffled. Every sample still appears exactly once per epoch, and
    a step's micro-batches hold neighbouring lengths (less padding), with no batch-length pattern
    over the epoch.
    """
    n = len(lengths)
    rng = np.random.default_rng((seed, epoch))
    perm = rng.permutation(n)
    tail, body = perm[: n % global_batch], perm[n % global_batch :]
    pool = global_batch * pool_batches
    batches = []
    for start in range(0, len(body), pool):
        chunk = body[start : start + pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches.extend(chunk[i : i + global_batch] for i in range(0, len(chunk), global_batch))
    order = rng.permutation(len(batches))
    return np.concatenate([batches[i] for i in order] + [tail]).astype(np.int64)


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    return num_samples // global_batch


def _check_batch(num_samples: int, global_batch: int) -> None:
    if global_batch < 1:
        raise DataError(f"global batch {global_batch} must be >= 1")
    if global_batch > num_samples:
        raise DataError(
            f"global batch {global_batch} is larger than the {num_samples} training samples, so no step can be "
            f"formed; lower train.batch_size to at most {num_samples}, or add data"
        )


def _start_of_step(num_samples: int, cursor: Cursor, global_batch: int) -> Cursor:
    """Where a step from `cursor` really starts: the next epoch if fewer than global_batch remain."""
    if cursor.offset + global_batch > num_samples:
        return Cursor(cursor.epoch + 1, 0)
    return cursor


class _Permutations:
    """The current epoch's permutation (length-bucketed when lengths are given), rebuilt only when the epoch changes."""

    def __init__(
        self, num_samples: int, seed: int, lengths: np.ndarray | None = None, global_batch: int = 1
    ):
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"{len(lengths)} lengths for {num_samples} samples")
        self.num_samples, self.seed, self.lengths, self.global_batch = (
            num_samples,
            seed,
            lengths,
            global_batch,
        )
        self.epoch: int | None = None
        self.perm: np.ndarray | None = None

    def get(self, epoch: int) -> np.ndarray:
        if epoch != self.epoch:
            self.epoch = epoch
            self.perm = (
                epoch_permutation(self.num_samples, self.seed, epoch)
                if self.lengths is None
                else bucketed_permutation(self.lengths, self.seed, epoch, self.global_batch)
            )
        return self.perm


def _next_step(
    perms: _Permutations, cursor: Cursor, global_batch: int
) -> tuple[np.ndarray, Cursor]:
    n = perms.num_samples
    start = _start_of_step(n, cursor, global_batch)
    indices = perms.get(start.epoch)[start.offset : start.offset + global_batch]
    after = _start_of_step(n, Cursor(start.epoch, start.offset + global_batch), global_batch)
    return indices, after


def step_indices(
    num_samples: int,
    seed: int,
    cursor: Cursor,
    global_batch: int,
    lengths: np.ndarray | None = None,
) -> tuple[np.ndarray, Cursor]:
    """The next step's global_batch indices, and the cursor of the step after.

    If fewer than global_batch indices remain in the cursor's epoch, that remainder is dropped
    and the step starts the next epoch at offset 0. The returned cursor is already normalised
    that way (it names the epoch the next step will read from). Builds one permutation, so the
    cost does not grow with the steps already taken.
    """
    _check_batch(num_samples, global_batch)
    return _next_step(_Permutations(num_samples, seed, lengths, global_batch), cursor, global_batch)


def cursor_after(
    num_samples: int, seed: int, start: Cursor, global_batch: int, steps: int
) -> Cursor:
    """The cursor after `steps` steps from `start`, by arithmetic; equals iterating step_indices.

    `seed` is unused (positions do not depend on the order) and kept so every function of the
    protocol takes the same arguments.
    """
    del seed
    _check_batch(num_samples, global_batch)
    if steps < 0:
        raise ValueError(f"steps = {steps} must be >= 0")
    if steps == 0:
        return start
    cur = _start_of_step(num_samples, start, global_batch)
    left_in_epoch = (num_samples - cur.offset) // global_batch  # >= 1 after normalising
    if steps < left_in_epoch:
        return Cursor(cur.epoch, cur.offset + steps * global_batch)
    steps -= left_in_epoch
    per_epoch = steps_per_epoch(num_samples, global_batch)
    return Cursor(cur.epoch + 1 + steps // per_epoch, (steps % per_epoch) * global_batch)


def rank_micro_batches(indices: np.ndarray, plan: BatchPlan, rank: int) -> list[np.ndarray]:
    """This global rank's grad_accum micro-batches of one step.

    Micro-step m of rank r is indices[(m * world + r) * mb : (m * world + r + 1) * mb]; over all
    ranks and micro-steps the slices tile the step exactly once.
    """
    if len(indices) != plan.global_batch:
        raise ValueError(
            f"got {len(indices)} indices for a step of global batch {plan.global_batch}"
        )
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is not in 0..{plan.world_size - 1}")
    w, mb = plan.world_size, plan.micro_batch
    return [indices[(m * w + rank) * mb : (m * w + rank + 1) * mb] for m in range(plan.grad_accum)]


class GlobalCursorSampler(torch.utils.data.Sampler[list[int]]):
    """A DataLoader batch_sampler: this rank's micro-batches for num_steps steps from `start`.

    Yields num_steps x grad_accum lists of indices, in order (step, micro-step). Each iteration
    starts again at `start`; the trainer derives checkpoint cursors with `cursor_after`, never
    from this (prefetching) iterator.
    """

    def __init__(
        self,
        num_samples: int,
        plan: BatchPlan,
        rank: int,
        seed: int,
        start: Cursor,
        num_steps: int,
        lengths: np.ndarray | None = None,
    ):
        if plan.world_size * plan.micro_batch * plan.grad_accum != plan.global_batch:
            raise ValueError(
                f"batch plan global {plan.global_batch} != world_size({plan.world_size}) x "
                f"micro_batch({plan.micro_batch}) x grad_accum({plan.grad_accum})"
            )
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is not in 0..{plan.world_size - 1}")
        _check_batch(num_samples, plan.global_batch)
        self.num_samples, self.plan, self.rank, self.seed = num_samples, plan, rank, seed
        self.start, self.num_steps, self.lengths = start, num_steps, lengths

    def __len__(self) -> int:
        return self.num_steps * self.plan.grad_accum

    def __iter__(self) -> Iterator[list[int]]:
        perms = _Permutations(self.num_samples, self.seed, self.lengths, self.plan.global_batch)
        cursor = self.start
        for _ in range(self.num_steps):
            indices, cursor = _next_step(perms, cursor, self.plan.global_batch)
            for micro in rank_micro_batches(indices, self.plan, self.rank):
                yield micro.tolist()


def eval_micro_batches(
    num_eval: int, micro_batch: int, rank: int, world_size: int, max_batches: int
) -> list[list[int]]:
    """Rank r's share of the eval split: windows r, r + world, r + 2 world, ..., in micro-batches.

    Every rank gets the same number of micro-batches of the same size (so collectives match and
    a plain mean of per-batch losses is exact): each rank keeps num_eval // world_size windows
    (the uneven tail is dropped), micro-batches hold min(micro_batch, that) windows, at most
    max_batches of them, and a tail shorter than a micro-batch is dropped. Ranks never share a window.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    per_rank = num_eval // world_size
    if per_rank == 0:
        raise DataError(
            f"the eval split has {num_eval} windows, fewer than world_size({world_size}), so some rank would get "
            "none; raise data.eval_fraction or add data"
        )
    size = min(micro_batch, per_rank)
    count = min(max_batches, per_rank // size)
    mine = list(range(rank, num_eval, world_size))[: count * size]
    return [mine[i * size : (i + 1) * size] for i in range(count)]


# "auto" gives a rank a DataLoader worker only when it has this many cores of its own
AUTO_WORKER_CORES = 2


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (what Slurm, a cgroup or taskset pinned
    it to), else all of the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity outside Linux
        return os.cpu_count() or 1


def resolve_num_workers(setting: int | str, local_world_size: int, cores: int) -> tuple[int, str]:
    """(DataLoader worker processes per rank, why) for data.num_workers = `setting`.

    An int is the user's choice and is kept. "auto" shares the `cores` this process may use among
    the `local_world_size` ranks of this node: a rank with fewer than AUTO_WORKER_CORES (2) cores
    of its own (cores // local_world_size) gets 0 workers and reads its batches itself, because a
    worker process would compete with the ranks for their cores (2 ranks on 2 cores: 5 processes
    instead of 3, less even steps and more memory; BENCHMARKS.md, "DataLoader workers on few
    cores"); a rank with 2 or more gets 1 worker, which reads the next micro-batches while the rank
    computes. Never more than 1: lockstep's token windows need a small part of a core. A dataset
    that decodes audio or images in __getitem__ may want more; set data.num_workers to a number.
    """
    number = isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0
    if not (number or setting == "auto"):
        raise ConfigError(
            f"data.num_workers = {setting!r} is not a number of DataLoader workers; "
            "set it to an int >= 0 (0: read batches in the rank itself) or to auto"
        )
    if local_world_size < 1:
        raise ValueError(f"local_world_size = {local_world_size} must be >= 1")
    if setting != "auto":
        return setting, f"{_workers(setting)} per rank (data.num_workers)"
    cores = max(1, cores)  # os.cpu_count() may not know
    per_rank = cores // local_world_size
    workers = 1 if per_rank >= AUTO_WORKER_CORES else 0
    why = (
        f"{_workers(workers)} per rank (data.num_workers auto: {cores} core(s) for "
        f"{local_world_size} rank(s) on this node, {per_rank} each; a worker needs "
        f"{AUTO_WORKER_CORES}+ cores per rank)"
    )
    return workers, why


def _workers(n: int) -> str:
    return f"{n} DataLoader worker{'' if n == 1 else 's'}"


def build_loader(
    dataset: Dataset,
    batch_sampler: Any,
    num_workers: int | str,
    prefetch_factor: int,
    pin_memory: bool,
    collate_fn: Any = None,
    local_world_size: int = 1,
) -> DataLoader:
    """A DataLoader over `batch_sampler`; workers persist across iterations when there are any.

    `num_workers` is data.num_workers: a number, or "auto" (resolve_num_workers, with the
    `local_world_size` ranks on this node sharing this process's cores).
    """
    num_workers, _ = resolve_num_workers(num_workers, local_world_size, available_cores())
    extra = (
        {
            "prefetch_factor": prefetch_factor,
            "persistent_workers": True,
            "worker_init_fn": _ignore_stop_signals,
        }
        if num_workers > 0
        else {}
    )
    # a generator of its own: each new iterator draws its workers' base seed from it, and drawing from the global
    # one would shift the training RNG (dropout) by one draw at every start, so a resumed run would not be exact
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(0),
        **extra,
    )


def _ignore_stop_signals(worker_id: int) -> None:
    # The launcher sends SIGTERM to the trainer's whole process group. Workers that died on it would make
    # the trainer raise ("DataLoader worker killed") before it commits its stop checkpoint; the trainer
    # shuts them down itself when it exits.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
