"""A run's checkpoints: pick the one to resume, restore from it, commit new ones (plain or sharded).

Plain checkpoints (DDP, one process) are written by global rank 0 alone: every rank holds all weights.
Sharded ones (FSDP, tensor or pipeline parallel: no rank holds everything) are written by every rank
with torch.distributed.checkpoint (lockstep.checkpoint.sharded). Either kind restores into either
layout at any world size: a sharded load reshards, and a plain checkpoint loads into sharded models.
The loop saves through a Checkpointer: synchronously, or with checkpoint.async_save in the background
(lockstep.checkpoint.background).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lockstep.errors import CheckpointError
from lockstep.checkpoint.background import BackgroundWriter, start_plain_save, start_sharded_save
from lockstep.checkpoint.hf_trainer import find_hf_trainer_checkpoint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.resume import resolve_resume
from lockstep.train.old_formats import load_checkpoint
from lockstep.collectives import gather_objects, run_on_main
from lockstep.parallel.mesh import BatchPlan
from lockstep.config import CheckpointConfig
from lockstep.data.sampler import Cursor
from lockstep.rng import capture_rng_state, restore_rng_state, seed_everything
from lockstep.runtime import Runtime
from lockstep.train.hf_resume import load_hf_trainer_weights
from lockstep.train.setup import Setup, save_compression_state
from lockstep.train.workload import Workload


@dataclass
class TrainingState:
    """A checkpoint's state.json: where the run stands and what it ran with (the tensors lie beside it).

    The loop builds one at every save; a resume reads the saved one back. Keys that older checkpoints
    lack read as None.
    """

    step: int  # optimizer steps done
    cursor: Cursor  # samples consumed by `step`: where the data continues, at any world size
    scheduler: dict | None = None  # the LR schedule's state_dict
    config: dict | None = None  # the whole config (config_to_dict): sample, export and merge rebuild the model
    world_size: int | None = None  # ranks that saved it: rng.pt holds one RNG state per rank
    global_batch: int | None = None  # samples per step: the order after the cursor depends on it
    tokens_seen: int | None = None  # the built-in GPT's tokens trained on (step x global batch x sequence)
    grad_scaler: dict | None = None  # fp16's loss scale
    layout: str | None = None  # Layout.describe() of the run that saved it
    compression: dict | None = None  # read back only: grad_compression.pt, beside state.json (not in it)

    def to_dict(self) -> dict:
        return {"step": self.step, "cursor": self.cursor.to_dict(), "scheduler": self.scheduler,
                "config": self.config, "world_size": self.world_size, "global_batch": self.global_batch,
                "tokens_seen": self.tokens_seen, "grad_scaler": self.grad_scaler, "layout": self.layout}

    @classmethod
    def from_dict(cls, state: dict) -> TrainingState:
        return cls(step=state["step"], cursor=Cursor.from_dict(state["cursor"]), scheduler=state.get("scheduler"),
                   config=state.get("config"), world_size=state.get("world_size"),
                   global_batch=state.get("global_batch"), tokens_seen=state.get("tokens_seen"),
                   grad_scaler=state.get("grad_scaler"), layout=state.get("layout"))


def pick_resume_point(checkpoint: CheckpointConfig, rt: Runtime, run_dir: Path,
                      log: logging.Logger) -> Path | None:
    """Global rank 0 picks the checkpoint (falling back past damaged ones); every rank loads the same one.
    An HF Trainer checkpoint (or its output_dir) named by --resume is taken as it is: restore_* load its weights."""
    path, error = run_on_main(rt, lambda: _hf_trainer_path(checkpoint.resume)
                              or resolve_resume(run_dir, checkpoint.resume, log=log.warning))
    if error:
        raise error if isinstance(error, CheckpointError) else CheckpointError(str(error))
    return path


def _hf_trainer_path(resume: str) -> Path | None:
    if resume in ("auto", "none"):
        return None
    found = find_hf_trainer_checkpoint(Path(resume))
    return found.path if found else None


def _restore_hf_trainer(path: Path, model: nn.Module, sharded: bool, rt: Runtime, seed: int, seed_rank: int,
                        log: logging.Logger) -> TrainingState | None:
    """An HF Trainer checkpoint's weights as the starting point (lockstep.train.hf_resume); None for lockstep's own."""
    ckpt = find_hf_trainer_checkpoint(path)
    if ckpt is None:
        return None
    note = load_hf_trainer_weights(ckpt, model, sharded)
    if rt.is_main:
        log.warning("%s", note)
    seed_everything(seed + seed_rank)
    return TrainingState(step=0, cursor=Cursor())


def restore_plain(path: Path, wl: Workload, optimizer: torch.optim.Optimizer, scheduler, scaler, rt: Runtime,
                  seed: int, seed_rank: int, plan: BatchPlan, log: logging.Logger) -> TrainingState:
    """Load weights, optimizer, schedule, loss scale and this rank's RNG; return the state to go on from."""
    hf = _restore_hf_trainer(path, wl.model, False, rt, seed, seed_rank, log)
    if hf is not None:
        return hf
    ckpt = load_checkpoint(path)
    wl.load_checkpoint_tensors(ckpt.tensors, path)
    if ckpt.optimizer_state is None or "scheduler" not in ckpt.state:
        return _fresh_start(path, ckpt.state, seed, seed_rank, log)
    state = TrainingState.from_dict(ckpt.state)
    state.compression = ckpt.compression
    optimizer.load_state_dict(ckpt.optimizer_state)
    scheduler.load_state_dict(state.scheduler)
    if scaler is not None and state.grad_scaler:
        scaler.load_state_dict(state.grad_scaler)
    return _continue(path, state, ckpt.rng_states, rt, seed, seed_rank, plan, log)


def restore_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, rt: Runtime,
                    seed: int, seed_rank: int, plan: BatchPlan, partial: bool, log: logging.Logger) -> TrainingState:
    """Restore into a sharded layout (FSDP / TP / PP) from a sharded or a plain checkpoint, resharding as needed."""
    from lockstep.checkpoint.manifest import is_sharded
    from lockstep.checkpoint.sharded import load_rng_states
    from lockstep.train.old_formats import load_sharded_checkpoint

    hf = _restore_hf_trainer(path, model, True, rt, seed, seed_rank, log)  # refused: not supported yet
    if hf is not None:
        return hf
    weights_only = not is_sharded(path) and not (path / "optimizer.pt").exists()
    saved = load_sharded_checkpoint(path, model, None if weights_only else optimizer, partial=partial)
    if weights_only or "scheduler" not in saved:
        return _fresh_start(path, saved, seed, seed_rank, log)
    state = TrainingState.from_dict(saved)
    scheduler.load_state_dict(state.scheduler)
    return _continue(path, state, load_rng_states(path), rt, seed, seed_rank, plan, log)


def _fresh_start(path: Path, state: dict, seed: int, seed_rank: int, log: logging.Logger) -> TrainingState:
    """Weights only (a `lockstep merge` output): a new starting point, not a run to continue."""
    seed_everything(seed + seed_rank)
    log.warning("%s holds weights only (merged from %s): training starts from them at step 0 with a fresh "
                "optimizer and schedule", path, state.get("merged_from", "?"))
    return TrainingState(step=0, cursor=Cursor())


def _continue(path: Path, state: TrainingState, rng_states: list | None, rt: Runtime, seed: int, seed_rank: int,
              plan: BatchPlan, log: logging.Logger) -> TrainingState:
    """The saved state, to go on from; this rank's RNG as saved, or seeded anew at another world size."""
    if rng_states and state.world_size == rt.world_size:
        restore_rng_state(rng_states[rt.rank])
    else:  # a new world size has new ranks: seed them reproducibly from the step
        seed_everything(seed + 1_000_003 * state.step + seed_rank)
    if state.global_batch not in (None, plan.global_batch):
        log.warning("checkpoint was trained with global batch %s, now %d: the sample order from here differs",
                    state.global_batch, plan.global_batch)
    log.info("resumed from %s at step %d (epoch %d, sample %d of the epoch; saved on %s rank(s), now %d)",
             path, state.step, state.cursor.epoch, state.cursor.offset, state.world_size, rt.world_size)
    return state


def save_training(s: Setup, state: TrainingState, keep_last: int, log: logging.Logger) -> Path:
    """Commit a checkpoint of the run at `state.step`; every rank calls this together."""
    wl = s.wl
    if s.layout.sharded_checkpoints:
        return save_sharded(s.rt, s.run_dir, state.step, s.model, s.optimizer, state.to_dict(), wl.extra_files,
                            keep_last, log)
    return save_plain(s.rt, s.run_dir, state.step, wl.checkpoint_tensors(), s.optimizer, state.to_dict(),
                      wl.extra_files, keep_last, log, save_compression_state(s))


def save_plain(rt: Runtime, run_dir: Path, step: int, tensors: dict[str, torch.Tensor],
               optimizer: torch.optim.Optimizer, state: dict, extra: dict[str, bytes], keep_last: int,
               log: logging.Logger, compression: dict | None = None) -> Path:
    """All ranks enter together (their RNG states are gathered); rank 0 alone writes; all learn the outcome.
    `compression`: the gradient compression's state, gathered on rank 0 (lockstep.train.setup.save_compression_state)."""
    rng_states = gather_objects(rt, capture_rng_state())
    path, error = run_on_main(rt, lambda: save_checkpoint(run_dir, step, tensors, optimizer.state_dict(), rng_states,
                                                           state, extra, keep_last=keep_last, compression=compression))
    if error:  # the commit protocol left the previous checkpoint intact
        raise CheckpointError(f"saving the checkpoint of step {step} failed on rank 0 ({type(error).__name__}: "
                              f"{error}); the previous checkpoint is untouched")
    if rt.is_main:
        log.info("checkpoint committed: %s", path)
    return Path(path)


def save_sharded(rt: Runtime, run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 state: dict, extra: dict[str, bytes], keep_last: int, log: logging.Logger) -> Path:
    """Every rank writes its shards; rank 0 commits. Errors are raised on every rank by save_sharded_checkpoint."""
    from lockstep.checkpoint.sharded import save_sharded_checkpoint

    rng_states = gather_objects(rt, capture_rng_state())
    path = save_sharded_checkpoint(rt, run_dir, step, model, optimizer, rng_states, state, extra, keep_last)
    if rt.is_main:
        log.info("checkpoint committed (sharded, %d ranks): %s", rt.world_size, path)
    return Path(path)


class Checkpointer:
    """Commits the run's checkpoints: synchronously, or with checkpoint.async_save in the background.

    Every rank calls save() together. In the background the step path waits only for the copy of the state to host
    memory; at most one save is in flight, and the next save, a stop and the end of the run wait for it (finish()).
    `committed` names a checkpoint only once it is committed. Use it as a context manager: leaving the block, an
    exception included, waits for the save in flight, so nothing writes when the process group goes.
    """

    def __init__(self, s: Setup, checkpoint: CheckpointConfig, committed: Path | None, log: logging.Logger) -> None:
        self.s, self.keep_last, self.log = s, checkpoint.keep_last, log
        self.committed = committed  # the last committed checkpoint: the resumed one until a save commits
        self.writer = BackgroundWriter(s.rt, s.save_group) if checkpoint.async_save else None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.__exit__(*exc)

    def save(self, state: TrainingState) -> None:
        """Commit a checkpoint of `state.step`, or start it in the background (after the one in flight commits)."""
        if self.writer is None:
            self.committed = save_training(self.s, state, self.keep_last, self.log)
            return
        start = time.perf_counter()
        self.finish()  # at most one in flight: the previous save commits first, or its failure raises here
        waited, start = time.perf_counter() - start, time.perf_counter()
        start_background_save(self.writer, self.s, state, self.keep_last)
        if self.s.rt.is_main:
            self.log.info("checkpoint of step %d: copied to host memory in %.3f s, writing in the background%s",
                          state.step, time.perf_counter() - start,
                          f" (after waiting {waited:.2f} s for the save before it)" if waited >= 0.05 else "")

    def failed(self) -> bool:
        """This rank's background save has failed (no waiting, no collective): the loop all-reduces it each step."""
        return self.writer is not None and self.writer.failed()

    def finish(self) -> None:
        """Every rank: wait for the save in flight to commit; CheckpointError on every rank if it failed anywhere."""
        if self.writer is None:
            return
        path = self.writer.wait(self.s.rt)
        if path is not None:
            self.committed = path
            if self.s.rt.is_main:
                self.log.info("checkpoint committed: %s", path)

    def stop_on_failure(self, step: int) -> None:
        """Every rank, once the step's all-reduce said a background save failed somewhere: raise its error here."""
        try:
            self.finish()
        except CheckpointError as e:
            raise CheckpointError(f"{e} (written in the background; noticed after step {step}, where the run "
                                  "stops)") from None
        raise AssertionError("a background save was reported failed, yet every rank's committed")


def start_background_save(writer: BackgroundWriter, s: Setup, state: TrainingState, keep_last: int) -> None:
    """Start a checkpoint of the run at `state.step` in the background; every rank calls this together and returns
    once the state is copied to host memory. A failure up to there raises CheckpointError on every rank."""
    rt, extra = s.rt, s.wl.extra_files
    rng_states = gather_objects(rt, capture_rng_state())
    compression = save_compression_state(s)
    if s.layout.sharded_checkpoints:
        start_sharded_save(writer, rt, s.run_dir, state.step, s.model, s.optimizer, rng_states, state.to_dict(), extra,
                           keep_last)
        return
    _, error = run_on_main(rt, lambda: start_plain_save(writer, s.run_dir, state.step, s.wl.checkpoint_tensors(),
                                                        s.optimizer.state_dict(), rng_states, state.to_dict(), extra,
                                                        keep_last, compression))
    if error:  # nothing was written
        raise CheckpointError(f"saving the checkpoint of step {state.step} failed on rank 0 ({type(error).__name__}: "
                              f"{error}); the previous checkpoint is untouched")
