"""Which checkpoint a run resumes from: `--resume none | auto | CHECKPOINT_DIR | RUN_DIR`.

`latest` (lockstep.checkpoint.commit moves it) names the current timeline: `--resume auto` starts at its
dir and falls back to older ones that verify; newer step_* dirs (an abandoned run's) are ignored.

Reads RUN_DIR/checkpoints; writes nothing. The trainer calls it on global rank 0 and shares the answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from lockstep.checkpoint.commit import list_checkpoints
from lockstep.checkpoint.manifest import step_of
from lockstep.checkpoint.open import verify_checkpoint
from lockstep.checkpoint.verify import RESUME_FIX
from lockstep.errors import CheckpointError


def resume_order(run_dir: Path) -> tuple[list[Path], str | None, str | None]:
    """(checkpoints `--resume auto` tries in order, what `latest` says, a note if it was unusable)."""
    ckpts = list_checkpoints(run_dir)
    try:
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):  # crash before the first `latest`, or removed by hand
        return ckpts, None, ("`latest` is missing" if ckpts else None)
    named = [c for c in ckpts if c.name == latest]
    if not named:
        return ckpts, latest, f"`latest` names {latest!r}, which does not exist"
    return [c for c in ckpts if step_of(c) <= step_of(named[0])], latest, None


def auto_resume(
    run_dir: Path,
    log: Callable[[str], None],
    verify: Callable[[Path], list[str]] = verify_checkpoint,
) -> Path | None:
    """The first checkpoint in resume_order that `verify` finds no problem with; None if the run has none.
    Raises CheckpointError if it has some and none verifies: starting over silently would lose the run."""
    order, _, note = resume_order(run_dir)
    if not order:
        return None
    if note:
        log(f"{note}; falling back to the newest checkpoint, {order[0].name}")
    failures = []
    for i, ckpt in enumerate(order):
        problems = verify(ckpt)
        if not problems:
            return ckpt
        failures.append(f"  {ckpt}: {'; '.join(problems)}")
        nxt = (
            f"falling back to {order[i + 1].name}"
            if i + 1 < len(order)
            else "no older checkpoint left"
        )
        log(f"checkpoint {ckpt.name} is damaged ({'; '.join(problems)}); {nxt}")
    raise CheckpointError(
        f"no checkpoint of {run_dir} verifies, refusing to start over silently:\n"
        + "\n".join(failures)
        + f"\n{RESUME_FIX}"
    )


def resolve_resume(run_dir, resume: str, log: Callable[[str], None] = print) -> Path | None:
    """Turn --resume ("none" | "auto" | a checkpoint dir | a run dir) into a verified checkpoint or None."""
    if resume == "none":
        return None
    if resume == "auto":
        return auto_resume(Path(run_dir), log)
    path = Path(resume)
    if path.name == "checkpoints" and path.is_dir():  # RUN/checkpoints given: treat as RUN
        path = path.parent
    if (path / "checkpoints").is_dir():
        found = auto_resume(path, log)
        if found is None:  # the user named this run on purpose: starting fresh would surprise
            raise CheckpointError(f"--resume {resume}: run dir has no checkpoints; {RESUME_FIX}")
        return found
    if not path.is_dir():
        raise CheckpointError(
            f"--resume {resume}: no such directory; pass a checkpoint dir "
            "(RUN/checkpoints/step_NNNNNNNN), a run dir, 'auto' or 'none'"
        )
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointError(
            f"--resume {resume}: checkpoint is damaged ({'; '.join(problems)}); {RESUME_FIX}"
        )
    return path
