"""A checkpoint dir of either kind, plain or sharded: verify it, load it.

The common modules (plain, verify) know nothing of DCP; this one dispatches to
lockstep.checkpoint.sharded where a checkpoint is sharded, and imports it (and with it
torch.distributed.checkpoint, about a second per process) only then.

Reads one checkpoint dir; no process group.
"""

from __future__ import annotations

from pathlib import Path

from lockstep.checkpoint.manifest import is_sharded
from lockstep.checkpoint.plain import (
    Checkpoint,
    Upgrade,
    load_plain_checkpoint,
    read_checkpoint,
    tensor_device,
)
from lockstep.checkpoint.verify import RESUME_FIX, checkpoint_problems
from lockstep.errors import CheckpointError


def verify_checkpoint(path) -> list[str]:
    """Problems with a checkpoint dir, one string each; an empty list means it is good."""
    return checkpoint_problems(path, _dcp_problems)


def _dcp_problems(path: Path, listed: dict) -> list[str]:
    # DCP is imported only for sharded checkpoints
    from lockstep.checkpoint.dcp_files import sharded_problems

    return sharded_problems(path, listed)


def load_checkpoint(path, map_location="cpu", upgrade: Upgrade | None = None) -> Checkpoint:
    """Verify, then load a checkpoint dir. Raises CheckpointError if it is damaged.

    A sharded checkpoint (lockstep.checkpoint.sharded) gives its full model tensors and optimizer_state
    None: its optimizer state is sharded, and only load_sharded_checkpoint puts it into an optimizer.
    upgrade: the model's conversion of a format-1 checkpoint's tensors (see lockstep.checkpoint.plain).
    """
    path = Path(path)
    if not is_sharded(path):
        return load_plain_checkpoint(path, map_location, upgrade)
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged ({'; '.join(problems)}); {RESUME_FIX}")
    from lockstep.checkpoint.sharded_load import read_full_model_tensors

    device = tensor_device(map_location)
    tensors = {k: v.to(device) for k, v in read_full_model_tensors(path).items()}
    return read_checkpoint(path, tensors, map_location, upgrade)
