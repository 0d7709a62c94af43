"""A run's state in its checkpoints: state.json (TrainingState), the checkpoint to resume, and the restore.

Either kind of checkpoint restores into either layout at any world size: a sharded load reshards, and
a plain checkpoint loads into sharded models. The loop commits new ones through lockstep.train.checkpointer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lockstep.checkpoint.hf_trainer import find_hf_trainer_checkpoint
from lockstep.checkpoint.plain import Checkpoint
from lockstep.checkpoint.resume import resolve_resume
from lockstep.collectives import run_on_main
from lockstep.config import CheckpointConfig
from lockstep.data.sampler import Cursor
from lockstep.errors import CheckpointError
from lockstep.parallel.mesh import BatchPlan
from lockstep.rng import restore_rng_state, seed_everything
from lockstep.runtime import Runtime
from lockstep.train.hf_resume import load_hf_trainer_weights
from lockstep.train.old_formats import load_checkpoint
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
    # the whole config (config_to_dict): sample, export and merge rebuild the model
    config: dict | None = None
    world_size: int | None = None  # ranks that saved it: rng.pt holds one RNG state per rank
    global_batch: int | None = None  # samples per step: the order after the cursor depends on it
    # the built-in GPT's tokens trained on (step x global batch x sequence)
    tokens_seen: int | None = None
    grad_scaler: dict | None = None  # fp16's loss scale
    layout: str | None = None  # Layout.describe() of the run that saved it
    # read back only: grad_compression.pt, beside state.json (not in it)
    compression: dict | None = None

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "cursor": self.cursor.to_dict(),
            "scheduler": self.scheduler,
            "config": self.config,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "tokens_seen": self.tokens_seen,
            "grad_scaler": self.grad_scaler,
            "layout": self.layout,
        }

    @classmethod
    def from_dict(cls, state: dict) -> TrainingState:
        return cls(
            step=state["step"],
            cursor=Cursor.from_dict(state["cursor"]),
            scheduler=state.get("scheduler"),
            config=state.get("config"),
            world_size=state.get("world_size"),
            global_batch=state.get("global_batch"),
            tokens_seen=state.get("tokens_seen"),
            grad_scaler=state.get("grad_scaler"),
            layout=state.get("layout"),
        )


def pick_resume_point(
    checkpoint: CheckpointConfig, rt: Runtime, run_dir: Path, log: logging.Logger
) -> Path | None:
    """Global rank 0 picks the checkpoint (falling back past damaged ones); every rank loads the same one.
    An HF Trainer checkpoint (or its output_dir) named by --resume is taken as it is: restore_* load its weights."""
    path, error = run_on_main(
        rt,
        lambda: (
            _hf_trainer_path(checkpoint.resume)
            or resolve_resume(run_dir, checkpoint.resume, log=log.warning)
        ),
    )
    if error:
        raise error if isinstance(error, CheckpointError) else CheckpointError(str(error))
    return path


def _hf_trainer_path(resume: str) -> Path | None:
    if resume in ("auto", "none"):
        return None
    found = find_hf_trainer_checkpoint(Path(resume))
    return found.path if found else None


def _restore_hf_trainer(
    path: Path, model: nn.Module, sharded: bool, rank_seed: int, log: logging.Logger | None
) -> TrainingState | None:
    """An HF Trainer checkpoint's weights as the starting point (lockstep.train.hf_resume); None for lockstep's own."""
    ckpt = find_hf_trainer_checkpoint(path)
    if ckpt is None:
        return None
    note = load_hf_trainer_weights(ckpt, model, sharded)
    if log is not None:  # rank 0's
        log.warning("%s", note)
    seed_everything(rank_seed)
    return TrainingState(step=0, cursor=Cursor())


def restore_plain(
    path: Path | Checkpoint,
    wl: Workload,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler,
    *,
    rt: Runtime,
    seed: int,
    seed_rank: int,
    plan: BatchPlan,
    log: logging.Logger,
) -> TrainingState:
    """Load weights, optimizer, schedule, loss scale and this rank's RNG; return the state to go on from.
    `path`: a checkpoint dir, or one read already (a memory snapshot, lockstep.train.recovery)."""
    if isinstance(path, Checkpoint):
        ckpt, path = path, path.path
    else:
        main_log = log if rt.is_main else None
        hf = _restore_hf_trainer(path, wl.model, False, seed + seed_rank, main_log)
        if hf is not None:
            return hf
        ckpt = load_checkpoint(path)
    wl.load_checkpoint_tensors(ckpt.tensors, path)
    if ckpt.optimizer_state is None or "scheduler" not in ckpt.state:
        return _fresh_start(path, ckpt.state, seed + seed_rank, log)
    state = TrainingState.from_dict(ckpt.state)
    state.compression = ckpt.compression
    optimizer.load_state_dict(ckpt.optimizer_state)
    scheduler.load_state_dict(state.scheduler)
    if scaler is not None and state.grad_scaler:
        scaler.load_state_dict(state.grad_scaler)
    return _continue(
        path, state, ckpt.rng_states, rt, seed=seed, seed_rank=seed_rank, plan=plan, log=log
    )


def restore_sharded(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    *,
    partial: bool,
    rt: Runtime,
    seed: int,
    seed_rank: int,
    plan: BatchPlan,
    log: logging.Logger,
) -> TrainingState:
    """Restore into a sharded layout (FSDP / TP / PP) from a sharded or a plain checkpoint, resharding as needed."""
    from lockstep.checkpoint.manifest import is_sharded
    from lockstep.checkpoint.sharded_load import load_rng_states
    from lockstep.train.old_formats import load_sharded_checkpoint

    # refused
    hf = _restore_hf_trainer(path, model, True, seed + seed_rank, log if rt.is_main else None)
    if hf is not None:
        return hf
    weights_only = not is_sharded(path) and not (path / "optimizer.pt").exists()
    saved = load_sharded_checkpoint(
        path, model, None if weights_only else optimizer, partial=partial
    )
    if weights_only or "scheduler" not in saved:
        return _fresh_start(path, saved, seed + seed_rank, log)
    state = TrainingState.from_dict(saved)
    scheduler.load_state_dict(state.scheduler)
    return _continue(
        path, state, load_rng_states(path), rt, seed=seed, seed_rank=seed_rank, plan=plan, log=log
    )


def _fresh_start(path: Path, state: dict, rank_seed: int, log: logging.Logger) -> TrainingState:
    """Weights only (a `lockstep merge` output): a new starting point, not a run to continue."""
    seed_everything(rank_seed)
    log.warning(
        "%s holds weights only (merged from %s): training starts from them at step 0 with a fresh "
        "optimizer and schedule",
        path,
        state.get("merged_from", "?"),
    )
    return TrainingState(step=0, cursor=Cursor())


def _continue(
    path: Path,
    state: TrainingState,
    rng_states: list | None,
    rt: Runtime,
    *,
    seed: int,
    seed_rank: int,
    plan: BatchPlan,
    log: logging.Logger,
) -> TrainingState:
    """The saved state, to go on from; this rank's RNG as saved, or seeded anew at another world size."""
    if rng_states and state.world_size == rt.world_size:
        restore_rng_state(rng_states[rt.rank])
    else:  # a new world size has new ranks: seed them reproducibly from the step
        seed_everything(seed + 1_000_003 * state.step + seed_rank)
    if state.global_batch not in (None, plan.global_batch):
        log.warning(
            "checkpoint was trained with global batch %s, now %d: the sample order from here differs",
            state.global_batch,
            plan.global_batch,
        )
    log.info(
        "resumed from %s at step %d (epoch %d, sample %d of the epoch; saved on %s rank(s), now %d)",
        path,
        state.step,
        state.cursor.epoch,
        state.cursor.offset,
        state.world_size,
        rt.world_size,
    )
    return state
