"""The run's checkpoint commits: what a Trainee and its Batches stand at, written synchronously or in the background.

Plain checkpoints (DDP, one process) are written by global rank 0 alone: every rank holds all weights.
Sharded ones (FSDP, tensor or pipeline parallel: no rank holds everything) are written by every rank
with torch.distributed.checkpoint (lockstep.checkpoint.sharded). With checkpoint.async_save the write
and the commit run in the background (lockstep.checkpoint.background). A save of either kind takes one
path: the state at the step, every rank's RNG and the compression hook's state gathered, then the
library's synchronous or background entry for the layout's kind.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from lockstep.checkpoint.background import BackgroundWriter, start_plain_save, start_sharded_save
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.collectives import gather_objects, run_on_main
from lockstep.config import Config, config_to_dict
from lockstep.data.batches import Batches
from lockstep.errors import CheckpointError
from lockstep.rng import capture_rng_state
from lockstep.runtime import side_group
from lockstep.train.snapshots import MemorySnapshots
from lockstep.train.state import TrainingState
from lockstep.train.trainee import Trainee


class Checkpointer:
    """Commits the run's checkpoints: synchronously, or with checkpoint.async_save in the background.

    Every rank calls save() together. In the background the step path waits only for the copy of the state
    to host memory; at most one save is in flight, and the next save, a stop and the end of the run wait for
    it (finish()). `committed` names a checkpoint only once it is committed. Use it as a context manager:
    leaving the block, an exception included, waits for the save in flight, so nothing writes when the
    process group goes.
    """

    def __init__(
        self,
        trainee: Trainee,
        batches: Batches,
        cfg: Config,
        committed: Path | None,
        log: logging.Logger,
        *,
        snapshots: MemorySnapshots | None = None,
    ) -> None:
        self.trainee, self.batches, self.log = trainee, batches, log
        self.snapshots = snapshots  # this node's in-memory snapshots (lockstep.train.snapshots)
        self.run_dir, self.keep_last = Path(cfg.checkpoint.output_dir), cfg.checkpoint.keep_last
        # state.json keeps the whole config: the tools rebuild the model from it
        self.config = config_to_dict(cfg)
        gpt = cfg.model.kind == "gpt"
        self.tokens_per_step = trainee.plan.global_batch * cfg.model.max_seq_length if gpt else None
        # the last committed checkpoint: the resumed one until a save commits
        self.committed = committed
        self.writer = None
        if cfg.checkpoint.async_save:
            self.writer = BackgroundWriter(trainee.rt, _save_group(cfg, trainee))

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.__exit__(*exc)
        if self.snapshots is not None:  # a run that ends without an error has committed its state
            self.snapshots.close(finished=exc[0] is None)

    def state_at(self, step: int) -> TrainingState:
        """What the checkpoint of `step` records in its state.json."""
        t = self.trainee
        return TrainingState(
            step=step,
            cursor=self.batches.cursor_at(step),
            scheduler=t.scheduler.state_dict(),
            config=self.config,
            world_size=t.rt.world_size,
            global_batch=t.plan.global_batch,
            tokens_seen=step * self.tokens_per_step if self.tokens_per_step else None,
            grad_scaler=t.scaler.state_dict() if t.scaler else None,
            layout=t.layout.describe(),
        )

    def save(self, step: int) -> None:
        """Commit a checkpoint of `step`, or start it in the background (after the one in flight commits)."""
        if self.writer is None:
            self.committed = self._save(step, None)
            return
        start = time.perf_counter()
        self.finish()  # at most one in flight: the previous save commits first, or its failure raises here
        waited, start = time.perf_counter() - start, time.perf_counter()
        self._save(step, self.writer)
        if self.trainee.rt.is_main:
            self.log.info(
                "checkpoint of step %d: copied to host memory in %.3f s, writing in the background%s",
                step,
                time.perf_counter() - start,
                f" (after waiting {waited:.2f} s for the save before it)" if waited >= 0.05 else "",
            )

    @property
    def writes_here(self) -> bool:
        """This rank writes files of each save: global rank 0 of a plain layout, every rank of a
        sharded one; the others only wait for it in the save's collectives (the step clock counts
        that as communication)."""
        return self.trainee.rt.is_main or self.trainee.layout.sharded_checkpoints

    def snapshot_due(self, step: int) -> bool:
        return self.snapshots is not None and self.snapshots.due(step)

    def snapshot(self, step: int) -> None:
        """Every rank, at a step snapshot_due() names: this node's in-memory snapshot of `step`, copied
        to host memory here and committed in the background by the node's writer."""
        began, t = time.perf_counter(), self.trainee
        what = self._what(step)
        compression = t.compression_state()
        if self.snapshots.sharded:
            if self.snapshots.on:
                self.snapshots.write_shards(what, t.model, t.optimizer, compression)
        elif self.snapshots.writes:
            tensors, optimizer_state = t.workload.checkpoint_tensors(), t.optimizer.state_dict()
            self.snapshots.write(step, what, tensors, optimizer_state, compression=compression)
        self.snapshots.took(began)

    def hold_snapshot(self) -> None:
        """This rank alone: wait for the node's memory snapshot in flight. The loop calls it before it
        logs a step, so a step on record means the one before it is held: a restart trains at most the
        last logged step again, even when the writer itself dies."""
        if self.snapshots is not None:
            self.snapshots.settle()

    def _what(self, step: int) -> dict:
        """Every rank (the RNG states are gathered): what a save of `step` writes besides tensors."""
        return dict(
            run_dir=self.run_dir,
            step=step,
            state=self.state_at(step).to_dict(),
            extra=self.trainee.workload.extra_files,
            keep_last=self.keep_last,
            rng_states=gather_objects(self.trainee.rt, capture_rng_state()),
        )

    def _save(self, step: int, writer: BackgroundWriter | None) -> Path | None:
        """Every rank: the checkpoint of `step`, committed (writer None: returns its path) or handed to the
        writer, which returns once the state is copied to host memory. A failure up to there raises
        CheckpointError on every rank, the previous checkpoint untouched."""
        t, rt = self.trainee, self.trainee.rt
        what = self._what(step)
        compression = t.compression_state()  # every rank: a collective where the hook keeps state
        if t.layout.sharded_checkpoints:
            from lockstep.checkpoint.sharded import save_sharded_checkpoint

            if writer is not None:
                return start_sharded_save(writer, rt, model=t.model, optimizer=t.optimizer, **what)
            path = save_sharded_checkpoint(rt, model=t.model, optimizer=t.optimizer, **what)
            if rt.is_main:
                self.log.info("checkpoint committed (sharded, %d ranks): %s", rt.world_size, path)
            return Path(path)

        def write() -> Any:  # rank 0 alone: every rank holds all weights
            tensors, optimizer_state = t.workload.checkpoint_tensors(), t.optimizer.state_dict()
            if writer is not None:
                return start_plain_save(
                    writer,
                    tensors=tensors,
                    optimizer_state=optimizer_state,
                    compression=compression,
                    **what,
                )
            return save_checkpoint(
                tensors=tensors, optimizer_state=optimizer_state, compression=compression, **what
            )

        path, error = run_on_main(rt, write)
        if error:  # the commit protocol left the previous checkpoint intact
            raise CheckpointError(
                f"saving the checkpoint of step {step} failed on rank 0 "
                f"({type(error).__name__}: {error}); the previous checkpoint is untouched"
            )
        if writer is None and rt.is_main:
            self.log.info("checkpoint committed: %s", path)
        return Path(path) if writer is None else None

    def failed(self) -> bool:
        """This rank's background save has failed (no waiting, no collective): the loop all-reduces it."""
        return self.writer is not None and self.writer.failed()

    def finish(self) -> None:
        """Every rank: wait for the save in flight to commit; CheckpointError on every rank if it failed."""
        if self.writer is None:
            return
        path = self.writer.wait(self.trainee.rt)
        if path is not None:
            self.committed = path
            if self.trainee.rt.is_main:
                self.log.info("checkpoint committed: %s", path)

    def stop_on_failure(self, step: int) -> None:
        """Every rank, once the step's all-reduce said a background save failed somewhere: raise its error."""
        try:
            self.finish()
        except CheckpointError as e:
            raise CheckpointError(
                f"{e} (written in the background; noticed after step {step}, where the run stops)"
            ) from None
        raise AssertionError("a background save was reported failed, yet every rank's committed")


def _save_group(cfg: Config, trainee: Trainee) -> Any:
    """checkpoint.async_save of a sharded layout: a gloo group of its own (lockstep.runtime.group's
    side_group) for the collectives of the saves written in the background (DCP's planning, the shard
    reports, the commit's outcome). None where none is needed."""
    if not trainee.layout.sharded_checkpoints:
        return None
    return side_group(trainee.rt, cfg.distributed.timeout_seconds)
