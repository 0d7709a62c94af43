"""A run's checkpoints: pick the one to resume, restore from it, commit new ones (plain or sharded).

Plain checkpoints (DDP, one process) are written by global rank 0 alone: every rank holds all weights.
Sharded ones (FSDP, tensor or pipeline parallel: no rank holds everything) are written by every rank
with torch.distributed.checkpoint (lockstep.checkpoint.sharded). Either kind restores into either
layout at any world size: a sharded load reshards, and a plain checkpoint loads into sharded models.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from lockstep.errors import CheckpointError
from lockstep.checkpoint.plain import load_checkpoint, resolve_resume, save_checkpoint
from lockstep.collectives import gather_objects, run_on_main
from lockstep.parallel.mesh import BatchPlan
from lockstep.config import Config
from lockstep.data.sampler import Cursor
from lockstep.rng import capture_rng_state, restore_rng_state, seed_everything
from lockstep.runtime import Runtime
from lockstep.train.workload import Workload


def pick_resume_point(cfg: Config, rt: Runtime, run_dir: Path, log: logging.Logger) -> Path | None:
    """Global rank 0 picks the checkpoint (falling back past damaged ones); every rank loads the same one."""
    path, error = run_on_main(rt, lambda: resolve_resume(run_dir, cfg.checkpoint.resume, log=log.warning))
    if error:
        raise error if isinstance(error, CheckpointError) else CheckpointError(str(error))
    return path


def restore_plain(path: Path, wl: Workload, optimizer: torch.optim.Optimizer, scheduler, scaler, rt: Runtime,
                  seed: int, seed_rank: int, plan: BatchPlan, log: logging.Logger) -> tuple[int, Cursor]:
    """Load weights, optimizer, schedule, loss scale and this rank's RNG; return the step and cursor to go on from."""
    ckpt = load_checkpoint(path)
    wl.load_checkpoint_tensors(ckpt.tensors, path)
    if ckpt.optimizer_state is None or "scheduler" not in ckpt.state:
        return _fresh_start(path, ckpt.state, seed, seed_rank, log)
    optimizer.load_state_dict(ckpt.optimizer_state)
    scheduler.load_state_dict(ckpt.state["scheduler"])
    if scaler is not None and ckpt.state.get("grad_scaler"):
        scaler.load_state_dict(ckpt.state["grad_scaler"])
    return _continue(path, ckpt.state, ckpt.rng_states, rt, seed, seed_rank, plan, log)


def restore_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, rt: Runtime,
                    seed: int, seed_rank: int, plan: BatchPlan, partial: bool, log: logging.Logger) -> tuple[int, Cursor]:
    """Restore into a sharded layout (FSDP / TP / PP) from a sharded or a plain checkpoint, resharding as needed."""
    from lockstep.checkpoint.sharded import is_sharded, load_rng_states, load_sharded_checkpoint

    weights_only = not is_sharded(path) and not (path / "optimizer.pt").exists()
    state = load_sharded_checkpoint(path, model, None if weights_only else optimizer, partial=partial)
    if weights_only or "scheduler" not in state:
        return _fresh_start(path, state, seed, seed_rank, log)
    scheduler.load_state_dict(state["scheduler"])
    return _continue(path, state, load_rng_states(path), rt, seed, seed_rank, plan, log)


def _fresh_start(path: Path, state: dict, seed: int, seed_rank: int, log: logging.Logger) -> tuple[int, Cursor]:
    """Weights only (a `lockstep merge` output): a new starting point, not a run to continue."""
    seed_everything(seed + seed_rank)
    log.warning("%s holds weights only (merged from %s): training starts from them at step 0 with a fresh "
                "optimizer and schedule", path, state.get("merged_from", "?"))
    return 0, Cursor()


def _continue(path: Path, state: dict, rng_states: list | None, rt: Runtime, seed: int, seed_rank: int,
              plan: BatchPlan, log: logging.Logger) -> tuple[int, Cursor]:
    """The step and cursor to go on from; this rank's RNG as saved, or seeded anew at another world size."""
    step, cursor = state["step"], Cursor.from_dict(state["cursor"])
    saved_world = state.get("world_size")
    if rng_states and saved_world == rt.world_size:
        restore_rng_state(rng_states[rt.rank])
    else:  # a new world size has new ranks: seed them reproducibly from the step
        seed_everything(seed + 1_000_003 * step + seed_rank)
    if state.get("global_batch") not in (None, plan.global_batch):
        log.warning("checkpoint was trained with global batch %s, now %d: the sample order from here differs",
                    state.get("global_batch"), plan.global_batch)
    log.info("resumed from %s at step %d (epoch %d, sample %d of the epoch; saved on %s rank(s), now %d)",
             path, step, cursor.epoch, cursor.offset, saved_world, rt.world_size)
    return step, cursor


def save_plain(rt: Runtime, run_dir: Path, step: int, tensors: dict[str, torch.Tensor],
               optimizer: torch.optim.Optimizer, state: dict, extra: dict[str, bytes], keep_last: int,
               log: logging.Logger) -> Path:
    """All ranks enter together (their RNG states are gathered); rank 0 alone writes; all learn the outcome."""
    rng_states = gather_objects(rt, capture_rng_state())
    path, error = run_on_main(rt, lambda: save_checkpoint(run_dir, step, tensors, optimizer.state_dict(), rng_states,
                                                           state, extra, keep_last=keep_last))
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
