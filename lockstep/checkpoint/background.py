"""Checkpoints committed in the background: the step path waits only for the copy of the state to host memory.

The write, the fsyncs, the manifest, the rename and the `latest` move run in a thread, through the same code as a
synchronous save: lockstep.checkpoint.plain.save_checkpoint for plain layouts, DCP's async_save and then
ShardedSave.write_and_commit (lockstep.checkpoint.sharded) for sharded ones. So `latest` still moves only after
the commit, and a crash or a failed write leaves the last committed checkpoint and `latest` as they were.

    writer = BackgroundWriter(rt, group)   # group: a gloo group for the background's collectives (sharded layouts)
    start_plain_save(writer, ...)          # global rank 0 of a plain layout; returns once the copy is taken
    start_sharded_save(writer, rt, ...)    # every rank of a sharded layout; returns once the copy is taken
    writer.failed()                        # this rank's save ended with an error: no waiting, no collective
    writer.wait(rt)                        # every rank: the committed checkpoint, or CheckpointError everywhere

At most one save is in flight per rank: the caller waits for one before it starts the next. A sharded save's
background half holds collectives (DCP's planning, the shard reports, the commit's outcome); they run on `group`,
never on the group the training thread uses meanwhile, where the two threads' collectives would interleave.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.checkpoint.commit import check_save_args
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.staging import copy_to_host, host_stager
from lockstep.collectives import gather_objects
from lockstep.errors import CheckpointError
from lockstep.runtime import Runtime


class BackgroundWriter:
    """This rank's checkpoint save in flight (at most one), run by a thread of its own, and how it ended.

    Use it as a context manager: leaving the block (an exception included) waits for the thread, so nothing is
    still writing, or in a collective, when the process group goes.
    """

    def __init__(self, rt: Runtime, group: Any = None) -> None:
        # the background's collectives go over `group`: a Runtime whose control group it is
        self.rt = dataclasses.replace(rt, control_group=group) if group is not None else rt
        self.group = group
        self.stager = None  # host_stager's, kept from save to save (sharded layouts)
        # of the save in flight, or of the last one until wait() reports it
        self.step: int | None = None
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._error: str | None = None
        self.seconds = 0.0  # how long the last save took in the background, once it ended

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.join()
        if self.stager is not None:
            self.stager.close()

    def start(self, step: int, job: Callable[[], Path | None]) -> None:
        """Run job() (the write and the commit) in the background; its CheckpointError's text is what wait() reports."""
        assert self._thread is None, (
            f"the save of step {self.step} is still in flight: wait() for it first"
        )
        self.step, self._path, self._error = step, None, None
        self._thread = threading.Thread(
            target=self._run, args=(step, job), name=f"lockstep-checkpoint-{step}", daemon=True
        )
        self._thread.start()

    def _run(self, step: int, job: Callable[[], Path | None]) -> None:
        start = time.perf_counter()
        try:
            self._path = job()
        except CheckpointError as e:
            self._error = str(e)
        # whatever ends it (DCP's CheckpointException is a BaseException) is reported
        except BaseException as e:
            self._error = (
                f"saving the checkpoint of step {step} failed on rank {self.rt.rank} "
                f"({type(e).__name__}: {e}); the previous checkpoint is untouched"
            )
        finally:
            self.seconds = time.perf_counter() - start

    def failed(self) -> bool:
        """This rank's save has ended, with an error (it stays so until wait())."""
        return self._thread is not None and not self._thread.is_alive() and self._error is not None

    def join(self) -> None:
        """Wait for this rank's save in flight to end; no collective, nothing raised (wait() reports)."""
        if self._thread is not None:
            self._thread.join()

    def outcome(self) -> tuple[Path | None, str | None]:
        """This rank's save in flight, waited for by this rank alone (no collective): (the path it
        committed, its error), or (None, None) when none was in flight."""
        self.join()
        mine = (self._path, self._error)
        self._thread, self._path, self._error = None, None, None
        return mine

    def wait(self, rt: Runtime) -> Path | None:
        """Every rank, on the training thread (a collective on rt.control_group): wait for this rank's save in flight,
        then learn every rank's outcome. Returns the checkpoint it committed, None when none was in flight; raises
        CheckpointError on every rank, with every rank's error, when a save failed anywhere."""
        path, error = self.outcome()
        outcomes = gather_objects(rt, (str(path) if path else None, error))
        # a sharded save fails alike on every rank: once
        errors = list(dict.fromkeys(e for _, e in outcomes if e))
        if errors:
            raise CheckpointError("; ".join(errors))
        return next((Path(p) for p, _ in outcomes if p), None)


def start_plain_save(
    writer: BackgroundWriter,
    run_dir,
    step: int,
    tensors: dict[str, torch.Tensor],
    optimizer_state: dict | None,
    rng_states: list | None,
    state: dict,
    extra: dict[str, bytes] | None,
    keep_last: int,
    compression: dict | None = None,
) -> None:
    """Global rank 0 of a plain layout: copy the tensors and the optimizer state to host memory, then commit them
    with save_checkpoint in the background. Returns once the copy is taken: training may change the live state."""
    check_save_args(step, keep_last, state, extra)  # a wrong argument fails here, in the step path
    tensors, optimizer_state = copy_to_host(tensors), copy_to_host(optimizer_state)
    state = copy.deepcopy(state)  # its scheduler entry can share lists with the live scheduler

    def job() -> Path:
        try:
            return save_checkpoint(
                run_dir,
                step,
                tensors,
                optimizer_state,
                rng_states,
                state,
                extra,
                keep_last,
                compression,
            )
        except Exception as e:  # as a synchronous save words it (lockstep.train.checkpointer)
            raise CheckpointError(
                f"saving the checkpoint of step {step} failed on rank 0 ({type(e).__name__}: {e}); "
                "the previous checkpoint is untouched"
            ) from e

    writer.start(step, job)


def start_sharded_save(
    writer: BackgroundWriter,
    rt: Runtime,
    run_dir,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rng_states: list | None,
    state: dict,
    extra: dict[str, bytes] | None,
    keep_last: int,
) -> None:
    """Every rank of a sharded layout: the temporary dir and this rank's state dict, as a synchronous save makes them
    (collectives on rt.control_group); DCP's async_save copies the shards to host memory here and writes them in
    its own thread (collectives on writer.group); once every rank's are written, rank 0 commits, in the background.
    A failure before the background half raises CheckpointError on every rank, as a synchronous save does."""
    from lockstep.checkpoint.sharded import begin_sharded_save

    assert writer.group is not None or not rt.distributed, (
        "a sharded background save needs a process group of its own"
    )
    save, to_save = begin_sharded_save(
        rt, run_dir, step, model, optimizer, rng_states, state, extra, keep_last
    )
    written, errors = async_shards(writer, rt, step, to_save, save.tmp, pinned=True)
    if any(errors):
        raise save.fail(rt, "copying the state to host memory", errors)
    writer.start(step, lambda: save.write_and_commit(writer.rt, written.result))


def async_shards(
    writer: BackgroundWriter, rt: Runtime, step: int, to_save: dict, tmp: Path, *, pinned: bool
) -> tuple[Any, list]:
    """Every rank: DCP's async_save of this rank's `to_save` into the dir `tmp`, copied to host
    memory here (through the writer's host_stager; `pinned`: on a GPU, into pinned memory kept from
    save to save) and written in DCP's thread (collectives on writer.group); (its future, every
    rank's problem or None). Where a rank failed, DCP's thread waits in collectives for it: the writer
    waits for that thread, which ends (with the group's timeout) unreported."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from lockstep.checkpoint.sharded import shard_writer

    written, problem = None, None
    if writer.stager is None:
        writer.stager = host_stager(rt.device, pinned)
    try:
        written = dcp.async_save(
            to_save,
            storage_writer=shard_writer(tmp),
            process_group=writer.group,
            async_stager=writer.stager,
            no_dist=not rt.distributed,
        )
    except (Exception, CheckpointException) as e:
        problem = f"{type(e).__name__}: {str(e).strip()[:2000]}"
    errors = gather_objects(rt, problem)
    if any(errors) and written is not None:
        writer.start(step, lambda: written.exception() and None)
    return written, errors
