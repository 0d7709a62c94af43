"""Sharded checkpoints: every rank writes its own shards (torch.distributed.checkpoint), one commit.

For layouts where no rank holds all the weights (FSDP, tensor or pipeline parallel). The commit
protocol is lockstep.checkpoint.commit's: a temporary dir, fsynced files, a manifest with the size and
sha256 of every file (every shard too), rename, `latest` moved atomically, keep-last pruning. The
manifest says "layout": "sharded". A step dir then holds

    .metadata  __0_0.distcp  __1_0.distcp ...   DCP's index and each rank's shards (model + optimizer)
    state.json  rng.pt  <extra files>  manifest.json   written by global rank 0 alone

Keys are the unwrapped model's FQNs (`blocks.0.attn.qkv.weight`), as in a plain checkpoint, so a
checkpoint loads into any layout (lockstep.checkpoint.sharded_load). The optimizer state sits under
`optimizer.` (FQN-keyed, get_state_dict's format).

Every rank calls save (collectives inside); global rank 0 alone commits. Built on the common modules
(manifest, verify, commit, plain) and never imported by them.
"""

from __future__ import annotations

import functools
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
)

from lockstep.checkpoint.commit import (
    check_save_args,
    explain_write_errors,
    move_latest,
    seal,
    start_save,
    write_meta_files,
)
from lockstep.checkpoint.manifest import (
    SHARDED,
    file_entry,
)
from lockstep.collectives import gather_objects, run_on_main
from lockstep.errors import CheckpointError
from lockstep.runtime import Runtime

OPTIM = "optimizer"  # top-level key of the optimizer state; model FQNs sit beside it


# ---- saving -----------------------------------------------------------------------------------------


def save_sharded_checkpoint(
    rt: Runtime,
    run_dir,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rng_states: list | None,
    state: dict,
    extra: dict[str, bytes] | None,
    keep_last: int,
) -> Path:
    """Commit a sharded checkpoint of `step`; every rank calls it with its part of model and optimizer.

    Rank 0 makes the temporary dir and tells the others; every rank writes its shards there (shared filesystem) and
    hashes them; rank 0 writes state.json, rng.pt (rng_states: one entry per rank, gathered by the caller), the extra
    files and the manifest, and commits. Each phase ends with a collective that every rank reaches whatever happened
    in it: a failure anywhere raises CheckpointError on every rank, and the previous checkpoint is untouched.
    """
    save, to_save = begin_sharded_save(
        rt, run_dir, step, model, optimizer, rng_states, state, extra, keep_last
    )
    with warnings.catch_warnings():  # one process without a process group: meant, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return save.write_and_commit(
            rt,
            lambda: dcp.save(
                to_save, storage_writer=shard_writer(save.tmp), process_group=rt.control_group
            ),
        )


# DCP's writer of one rank's shards into a dir: one file per rank, each fsynced
shard_writer = functools.partial(FileSystemWriter, single_file_per_rank=True, sync_files=True)


@dataclass
class ShardedSave:
    """A sharded save between its phases; lockstep.checkpoint.background runs write_and_commit in a thread."""

    run_dir: Path
    step: int
    keep_last: int
    tmp: Path  # the temporary dir every rank writes into
    rng_states: list | None
    prepared: dict[str, Any]  # rank 0's: state.json bytes, the extra files, the step dir it becomes

    def fail(self, rt: Runtime, phase: str, errors: list) -> CheckpointError:
        if rt.is_main:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return CheckpointError(
            f"saving the sharded checkpoint of step {self.step} failed while {phase} ("
            + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            + "); the previous checkpoint is untouched"
        )

    def write_and_commit(self, rt: Runtime, write: Callable[[], Any]) -> Path:
        """Every rank writes its shards with write() and hashes them (in parallel); then rank 0 writes the rest and
        commits. The collectives run on rt.control_group: the caller's thread must be the only one using it."""
        shards, problem = {}, None
        try:
            write()
            shards = {p.name: file_entry(p) for p in self.tmp.glob(f"__{rt.rank}_*")}
        # DCP raises its own on every rank; it is a BaseException
        except (Exception, CheckpointException) as e:
            problem = f"{type(e).__name__}: {str(e).strip()[:2000]}"
        reports = gather_objects(rt, (problem, shards))
        if any(err for err, _ in reports):
            raise self.fail(rt, "writing the shards", [err for err, _ in reports])
        path, error = run_on_main(
            rt, lambda: self._commit({n: e for _, files in reports for n, e in files.items()})
        )
        if error:
            raise CheckpointError(
                f"saving the sharded checkpoint of step {self.step} failed on rank 0 "
                f"({type(error).__name__}: {error}); the previous checkpoint is untouched"
            )
        return Path(path)

    def _commit(self, known: dict[str, dict]) -> str:
        """Rank 0: state.json, rng.pt, the extra files and the manifest (rank 0 hashes what no rank reported), rename."""
        final, tmp = self.prepared["final"], self.tmp
        try:
            with explain_write_errors(self.run_dir, self.step):
                write_meta_files(
                    tmp, self.rng_states, self.prepared["state_json"], self.prepared["extra"]
                )
                seal(tmp, final, self.step, known, layout=SHARDED)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:  # committed: a failure to move `latest` or prune must not hide that
            move_latest(final, self.keep_last)
        except Exception as e:
            raise CheckpointError(
                f"{type(e).__name__} after the commit of {final.name}, moving `latest`: {e}"
            ) from e
        return str(final)


def begin_sharded_save(
    rt: Runtime,
    run_dir,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rng_states: list | None,
    state: dict,
    extra: dict[str, bytes] | None,
    keep_last: int,
) -> tuple[ShardedSave, dict[str, Any]]:
    """Every rank: (the save, this rank's state dict to write). Rank 0 checks the arguments and makes the temporary
    dir; every rank collects its state dict. A failure on any rank raises CheckpointError on every rank."""
    prepared: dict[str, Any] = {}

    def prepare() -> str:
        prepared["state_json"], prepared["extra"] = check_save_args(step, keep_last, state, extra)
        with explain_write_errors(run_dir, step):
            prepared["tmp"], prepared["final"] = start_save(run_dir, step)
        return str(prepared["tmp"])

    tmp_name, error = run_on_main(rt, prepare)
    if error:
        raise CheckpointError(
            f"saving the sharded checkpoint of step {step} failed on rank 0 "
            f"({type(error).__name__}: {error}); the previous checkpoint is untouched"
        )
    save = ShardedSave(Path(run_dir), step, keep_last, Path(tmp_name), rng_states, prepared)
    try:
        to_save, problem = saved_state(model, optimizer), None
    except Exception as e:
        to_save, problem = {}, f"{type(e).__name__}: {e}"
    errors = gather_objects(rt, problem)
    if any(errors):
        raise save.fail(rt, "collecting the state dicts", errors)
    return save, to_save


def saved_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        model_sd = get_model_state_dict(model)
    else:
        # Note: an optimizer that has not stepped yet gets its state created by a zero-lr step here
        model_sd, optim_sd = get_state_dict(model, optimizer)
    clash = [k for k in model_sd if k == OPTIM or k.startswith(OPTIM + ".")]
    if clash:
        raise CheckpointError(
            f"model tensor {clash[0]!r} collides with the checkpoint's {OPTIM!r} key; "
            f"rename the model's {OPTIM!r} submodule"
        )
    return model_sd if optimizer is None else {**model_sd, OPTIM: optim_sd}
