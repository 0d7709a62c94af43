"""`lockstep verify`: what is in a checkpoint or a run directory, what is wrong with it, what resume would take."""

from __future__ import annotations

from pathlib import Path

from lockstep.checkpoint import (_RESUME_FIX, _STEP_DIR, _TMP, MANIFEST, CheckpointError, _auto_resume,
                                 _resume_order, list_checkpoints, read_manifest, verify_checkpoint)


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
    if not (path.is_dir() and ((path / MANIFEST).exists() or _STEP_DIR.match(path.name))):
        what = "does not exist" if not path.exists() else "is neither a run dir nor a checkpoint dir"
        return False, (f"{path} {what}; pass a run dir (it holds checkpoints/) or a checkpoint dir "
                       "(RUN/checkpoints/step_NNNNNNNN, it holds manifest.json)")
    problems = verify_checkpoint(path)
    manifest, _ = read_manifest(path)
    listed = manifest["files"] if manifest else {}
    lines = [f"checkpoint {path}" + (f" (step {manifest['step']})" if manifest else "")]
    for file in sorted(path.iterdir()):
        note = "" if file.name in listed or file.name == MANIFEST else "  (not in manifest)"
        size = f"{file.stat().st_size:,} bytes" if file.is_file() else "directory"
        lines.append(f"  {file.name:<24} {size:>18}{note}")
    lines += [f"  problem: {p}" for p in problems]
    lines.append("verdict: OK" if not problems else "verdict: DAMAGED")
    return not problems, "\n".join(lines)


def _run_report(run_dir: Path) -> tuple[bool, str]:
    ckpts = list_checkpoints(run_dir)
    problems = {c: verify_checkpoint(c) for c in ckpts}  # hash each once; reused for the auto pick
    order, latest, _ = _resume_order(run_dir)
    lines = [f"run {run_dir}: {len(ckpts)} checkpoints"]
    for c in ckpts:
        ignored = "" if c in order else "  (newer than `latest`, ignored by --resume auto)"
        lines.append(f"  {c.name}  " + ("OK" if not problems[c] else "DAMAGED: " + "; ".join(problems[c])) + ignored)
    latest_ok = any(c.name == latest for c in ckpts)
    lines.append("latest: missing" if latest is None else f"latest -> {latest}" + ("" if latest_ok else " (missing)"))
    stale = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if _TMP.match(p.name))
    if stale:
        lines.append(f"unfinished: {', '.join(stale)} (the next save removes those whose process is gone)")
    try:
        pick = _auto_resume(run_dir, lambda _msg: None, verify=problems.__getitem__)
        lines.append(f"--resume auto would take: {pick.name if pick else 'nothing (start fresh)'}")
    except CheckpointError:
        lines.append(f"--resume auto would fail: no checkpoint verifies; {_RESUME_FIX}")
    ok = all(not p for p in problems.values()) and (latest_ok or not ckpts)
    return ok, "\n".join(lines)
