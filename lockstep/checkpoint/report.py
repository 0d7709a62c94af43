"""What is in a checkpoint or a run directory, what is wrong with it, what a resume would take.

`verify_report`: `lockstep verify`, every file hashed. `stop_note`: what a run that stopped early leaves
(the checkpoint it committed, or that it committed none, and what running again would do), from what
is on disk, cheaply enough for Ctrl-C time: manifests and file sizes, no checksums.

Reads a run dir or a checkpoint dir; writes nothing.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

from lockstep.checkpoint.commit import TMP_DIR, list_checkpoints
from lockstep.checkpoint.manifest import MANIFEST, STEP_DIR, read_manifest
from lockstep.checkpoint.memory import held_here
from lockstep.checkpoint.open import verify_checkpoint
from lockstep.checkpoint.resume import auto_resume, resume_order
from lockstep.checkpoint.verify import RESUME_FIX, SNAPSHOT_PROBLEM, quick_check
from lockstep.errors import CheckpointError


def verify_report(path) -> tuple[bool, str]:
    """Report for `lockstep verify RUN_OR_CHECKPOINT_DIR`, and whether everything in it is good.

    Checkpoint dir: files, sizes, problems; ok when it verifies. Run dir: a line per checkpoint,
    `latest`, what `--resume auto` takes; ok when all verify and `latest` names one (or none exist).
    """
    path = Path(path)
    if path.name == "checkpoints" and path.is_dir():
        path = path.parent
    if (path / "checkpoints").is_dir():
        return _run_report(path)
    if not (path.is_dir() and ((path / MANIFEST).exists() or STEP_DIR.match(path.name))):
        what = (
            "does not exist" if not path.exists() else "is neither a run dir nor a checkpoint dir"
        )
        return False, (
            f"{path} {what}; pass a run dir (it holds checkpoints/) or a checkpoint dir "
            "(RUN/checkpoints/step_NNNNNNNN, it holds manifest.json)"
        )
    problems = verify_checkpoint(path)
    manifest, _ = read_manifest(path)
    listed = manifest["files"] if manifest else {}
    lines = [f"checkpoint {path}" + (f" (step {manifest['step']})" if manifest else "")]
    for file in sorted(path.iterdir()):
        note = "" if file.name in listed or file.name == MANIFEST else "  (not in manifest)"
        size = f"{file.stat().st_size:,} bytes" if file.is_file() else "directory"
        lines.append(f"  {file.name:<24} {size:>18}{note}")
    lines += [f"  problem: {p}" for p in problems]
    snapshot = any(p.startswith(SNAPSHOT_PROBLEM) for p in problems)
    verdict = "NOT A CHECKPOINT (an in-memory snapshot)" if snapshot else "DAMAGED"
    lines.append("verdict: OK" if not problems else f"verdict: {verdict}")
    return not problems, "\n".join(lines)


def _run_report(run_dir: Path) -> tuple[bool, str]:
    ckpts = list_checkpoints(run_dir)
    problems = {c: verify_checkpoint(c) for c in ckpts}  # hash each once; reused for the auto pick
    order, latest, _ = resume_order(run_dir)
    lines = [f"run {run_dir}: {len(ckpts)} checkpoints"]
    for c in ckpts:
        ignored = "" if c in order else "  (newer than `latest`, ignored by --resume auto)"
        lines.append(
            f"  {c.name}  "
            + ("OK" if not problems[c] else "DAMAGED: " + "; ".join(problems[c]))
            + ignored
        )
    latest_ok = any(c.name == latest for c in ckpts)
    lines.append(
        "latest: missing"
        if latest is None
        else f"latest -> {latest}" + ("" if latest_ok else " (missing)")
    )
    stale = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if TMP_DIR.match(p.name))
    if stale:
        lines.append(
            f"unfinished: {', '.join(stale)} (the next save removes those whose process is gone)"
        )
    try:
        pick = auto_resume(run_dir, lambda _msg: None, verify=problems.__getitem__)
        lines.append(f"--resume auto would take: {pick.name if pick else 'nothing (start fresh)'}")
    except CheckpointError:
        lines.append(f"--resume auto would fail: no checkpoint verifies; {RESUME_FIX}")
    ok = all(not p for p in problems.values()) and (latest_ok or not ckpts)
    return ok, "\n".join(lines)


# ---- what a stopped run leaves ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatestMark:
    """What RUN/checkpoints/latest named, and the inode of that dir: re-saving the same step makes a new dir."""

    name: str | None
    inode: int | None


def mark_latest(run_dir) -> LatestMark:
    root = Path(run_dir) / "checkpoints"
    try:
        name = (root / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return LatestMark(None, None)
    try:
        return LatestMark(name, (root / name).stat().st_ino)
    except OSError:
        return LatestMark(name, None)


def stop_note(run_dir, before: LatestMark, resume: str, memory_dir=None) -> str:
    """One sentence for a run that stopped early (signal, crash, hang): the checkpoint it committed since `before`
    (mark_latest when it started) or that it committed none, and what the same command would resume from
    with this `resume` setting (checkpoint.resume); with `memory_dir` (checkpoint.memory_dir), the
    snapshot this node's memory still holds of the run, which a restart reads first."""
    run_dir = Path(run_dir)
    now = mark_latest(run_dir)
    if now.name is not None and now.inode is not None and now != before:
        try:
            age = f", {time.time() - (run_dir / 'checkpoints' / now.name / MANIFEST).stat().st_mtime:.0f} s ago"
        except OSError:
            age = ""
        done = f"this run committed checkpoint {now.name} ({_step_text(now.name)}{age})"
    elif before.name is not None:
        done = f"this run committed no checkpoint (`latest` still names {before.name}, as when it started)"
    else:
        done = "this run committed no checkpoint"
    held = held_here(run_dir, Path(memory_dir), socket.gethostname()) if memory_dir else None
    return f"{done}; {_resume_advice(run_dir, resume)}" + (
        _memory_advice(held, resume) if held else ""
    )


def _memory_advice(held: Path, resume: str) -> str:
    """The RAM a stopped run's snapshot still takes (a tmpfs keeps it until it is removed), and when
    it is used: a start with --resume auto reads it first, and clears it if the disk is newer."""
    size = sum(f.stat().st_size for f in held.iterdir() if f.is_file())
    where = held.parent.parent  # MEMORY_DIR/RUN_ID/NODE
    use = (
        "the same command on this node starts from it if it is newer than the disk's and whole"
        if resume == "auto"
        else "the same command removes it (memory is read only with --resume auto)"
    )
    return (
        f"; this node's memory still holds the run's snapshot of {_step_text(held.name)} "
        f"({size / 2**20:.1f} MiB in {where}): {use}; removing {where} frees that memory now"
    )


def _resume_advice(run_dir: Path, resume: str) -> str:
    pick, failed = _quick_resume_pick(run_dir)
    target = Path(resume)
    if target.name == "checkpoints":
        target = target.parent
    if resume not in ("auto", "none") and target.resolve() == run_dir.resolve():
        resume = "auto"  # --resume RUN_DIR of this very run behaves as auto
    if pick is None and failed:
        return (
            f"no checkpoint in {run_dir / 'checkpoints'} passes a quick check ({'; '.join(failed)}): see "
            f"`lockstep verify {run_dir}`, then {RESUME_FIX}"
        )
    skips = f" (it skips {'; '.join(failed)})" if failed else ""
    if resume == "auto":
        if pick is None:
            return f"running the same command again starts over at step 0 ({run_dir / 'checkpoints'} holds no checkpoint)"
        return (
            f"to resume, run the same command again: --resume auto takes {pick.name} ({_step_text(pick.name)}) "
            f"and verifies its checksums before loading it{skips}"
        )
    setting = (
        "checkpoint.resume is 'none', so the same command starts over at step 0"
        if resume == "none"
        else f"checkpoint.resume is {resume}, so the same command starts from there again"
    )
    if pick is None:
        return setting
    return f"{setting}; to continue from {pick.name} ({_step_text(pick.name)}) run it with --resume auto instead{skips}"


def _quick_resume_pick(run_dir: Path) -> tuple[Path | None, list[str]]:
    """What --resume auto would take by quick_check (manifest, sizes), and the newer ones it would skip, and why."""
    failed: list[str] = []

    def check(ckpt: Path) -> list[str]:
        problems = quick_check(ckpt)
        if problems:
            failed.append(f"{ckpt.name}: {'; '.join(problems)}")
        return problems

    try:
        return auto_resume(run_dir, lambda _note: None, verify=check), failed
    except CheckpointError:
        return None, failed


def _step_text(name: str) -> str:
    m = STEP_DIR.match(name)
    return f"step {int(m[1])}" if m else "step unknown"
