"""What `lockstep verify` and a stopped run report (lockstep/checkpoint/report.py), from real files: a checkpoint's
files and verdict, a run's checkpoints, `latest`, unfinished saves and what --resume auto would take; what a
run that stopped early committed and what running it again would do."""

from __future__ import annotations

import json
import re
import shutil

from lockstep.checkpoint.report import LatestMark, mark_latest, verify_report

from .on_disk import save, truncate


def test_verify_report(tmp_path):
    save(tmp_path, 10)
    newest = save(tmp_path, 20)
    ok, report = verify_report(tmp_path)
    assert ok and "step_00000010  OK" in report and "latest -> step_00000020" in report
    assert "--resume auto would take: step_00000020" in report

    ok, report = verify_report(newest)
    assert ok and "model.safetensors" in report and "bytes" in report and "verdict: OK" in report

    truncate(newest / "model.safetensors")
    ok, report = verify_report(tmp_path)
    assert not ok and "step_00000020  DAMAGED: model.safetensors" in report
    assert "--resume auto would take: step_00000010" in report
    ok, report = verify_report(newest)
    assert not ok and "truncated?" in report and "verdict: DAMAGED" in report

    ok, report = verify_report(tmp_path / "bogus")
    assert not ok and "does not exist" in report and "run dir" in report
    (tmp_path / "plain").mkdir()
    ok, report = verify_report(tmp_path / "plain")
    assert not ok and "neither a run dir nor a checkpoint dir" in report


def _note(run, before, resume="auto") -> str:
    from lockstep.checkpoint.report import stop_note

    return re.sub(r", \d+ s ago\)", ", N s ago)", stop_note(run, before, resume))


def test_stop_note_reads_what_is_on_disk(tmp_path):
    from lockstep.checkpoint.report import mark_latest

    run = tmp_path / "run"
    nothing = mark_latest(run)
    assert _note(run, nothing) == (
        "this run committed no checkpoint; running the same command again starts over at "
        f"step 0 ({run / 'checkpoints'} holds no checkpoint)"
    )
    save(run, 10)
    takes_10 = (
        "to resume, run the same command again: --resume auto takes step_00000010 (step 10) and verifies its "
        "checksums before loading it"
    )
    assert (
        _note(run, nothing)
        == f"this run committed checkpoint step_00000010 (step 10, N s ago); {takes_10}"
    )
    at_10 = mark_latest(run)
    assert _note(run, at_10) == (
        "this run committed no checkpoint (`latest` still names step_00000010, as when it "
        f"started); {takes_10}"
    )
    # the same step saved again (a run resumed at 10 with --resume none): a new commit
    save(run, 10, seed=7)
    assert _note(run, at_10).startswith(
        "this run committed checkpoint step_00000010 (step 10, N s ago); "
    )

    assert _note(run, at_10, "none").endswith(
        "; checkpoint.resume is 'none', so the same command starts over at "
        "step 0; to continue from step_00000010 (step 10) run it with --resume "
        "auto instead"
    )
    other = save(tmp_path / "other", 5)
    assert _note(run, at_10, str(other)).endswith(
        f"; checkpoint.resume is {other}, so the same command starts from "
        "there again; to continue from step_00000010 (step 10) run it with "
        "--resume auto instead"
    )
    # --resume RUN_DIR of this run is auto
    assert _note(run, at_10, str(run)).endswith(f"; {takes_10}")

    newest = save(run, 20)
    truncate(newest / "model.safetensors")
    size = json.loads((newest / "manifest.json").read_text())["files"]["model.safetensors"]["bytes"]
    assert _note(run, at_10).endswith(
        f"; {takes_10} (it skips step_00000020: model.safetensors: 40 bytes, manifest "
        f"says {size} (truncated?))"
    )
    truncate(run / "checkpoints" / "step_00000010" / "model.safetensors")
    assert (
        f"; no checkpoint in {run / 'checkpoints'} passes a quick check (step_00000020: "
        in _note(run, at_10)
    )


def test_checkpoint_report_lists_every_file(tmp_path):
    path = save(tmp_path, 3)
    (path / "notes.txt").write_text("mine")  # not lockstep's: listed, not a problem
    ok, report = verify_report(path)
    lines = report.splitlines()
    assert ok and lines[0] == f"checkpoint {path} (step 3)" and lines[-1] == "verdict: OK"
    sizes = {line.split()[0]: line.split(maxsplit=1)[1] for line in lines[1:-1]}
    assert sorted(sizes) == ["manifest.json", "model.safetensors", "notes.txt", "state.json"]
    assert sizes["notes.txt"] == "4 bytes  (not in manifest)"
    assert sizes["state.json"] == f"{(path / 'state.json').stat().st_size:,} bytes"


def test_run_report_without_latest_and_with_an_unfinished_save(tmp_path):
    save(tmp_path, 10)
    (tmp_path / "checkpoints" / "latest").unlink()
    (tmp_path / "checkpoints" / ".tmp-step_00000020-999999").mkdir()
    ok, report = verify_report(tmp_path / "checkpoints")  # RUN/checkpoints stands for RUN
    assert not ok  # `latest` names none of its checkpoints
    assert report.splitlines() == [
        f"run {tmp_path}: 1 checkpoints",
        "  step_00000010  OK",
        "latest: missing",
        "unfinished: .tmp-step_00000020-999999 (the next save removes those whose process is gone)",
        "--resume auto would take: step_00000010",
    ]


def test_mark_latest_tells_a_step_saved_again(tmp_path):
    assert mark_latest(tmp_path) == LatestMark(None, None)
    first = save(tmp_path, 10)
    mark = mark_latest(tmp_path)
    assert mark == LatestMark("step_00000010", first.stat().st_ino)
    save(tmp_path, 10, seed=3)  # the same step committed again: a new dir under the same name
    again = mark_latest(tmp_path)
    assert again.name == mark.name and again != mark
    shutil.rmtree(first)
    assert mark_latest(tmp_path) == LatestMark("step_00000010", None)


def test_stop_note_says_what_this_nodes_memory_still_holds(tmp_path):
    """A run stopped with a snapshot in this node's memory: the note says which step, how much memory
    it takes and where, and what the same command does with it; nothing without one."""
    import socket

    from lockstep.checkpoint.report import stop_note

    run, shm = tmp_path / "run", tmp_path / "shm"
    before = mark_latest(run)
    save(run, 10)
    assert stop_note(run, before, "auto", shm).endswith("verifies its checksums before loading it")
    (run / "run_id").write_text("abc123\n")
    where = shm / "abc123" / socket.gethostname()
    save(where, 12)
    newest = save(where, 13)
    mib = sum(f.stat().st_size for f in newest.iterdir()) / 2**20
    said = stop_note(run, before, "auto", shm)
    assert said.endswith(
        f"; this node's memory still holds the run's snapshot of step 13 ({mib:.1f} MiB in {where}): "
        "the same command on this node starts from it if it is newer than the disk's and whole; "
        f"removing {where} frees that memory now"
    )
    assert "the same command removes it (memory is read only with --resume auto)" in stop_note(
        run, before, "none", shm
    )
    # another run's id: not this run's memory
    (run / "run_id").write_text("other\n")
    assert "node's memory" not in stop_note(run, before, "auto", shm)
