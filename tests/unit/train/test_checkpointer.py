"""lockstep/train/checkpointer.py on one process: the Checkpointer's saves of a Trainee and its Batches,
synchronous and in the background (checkpoint.async_save), against the fixture's synchronous save (the `saved`
fixture, tests/unit/train/conftest.py)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

from lockstep.data.sampler import Cursor
from lockstep.train.checkpointer import Checkpointer
from lockstep.train.setup import build_batches

LOG = logging.getLogger("test.train.checkpointer")  # propagates to the root logger: caplog sees it


def into(cfg, run_dir, **checkpoint):
    """The same run's config writing into another run directory."""
    return replace(cfg, checkpoint=replace(cfg.checkpoint, output_dir=str(run_dir), **checkpoint))


def test_checkpointer_in_the_background_commits_what_a_synchronous_save_commits(
    saved, tmp_path, caplog
):
    """checkpoint.async_save on one process: the same files as the synchronous save wrote, and `committed` names
    the checkpoint only once finish() has seen it committed; the stall is logged."""
    cfg, s, path, state, _ = saved
    # the same run and state, into another run dir
    other = into(cfg, tmp_path / "async", async_save=True)
    resumed_from = tmp_path / "resumed_from"
    with (
        caplog.at_level(logging.INFO, LOG.name),
        Checkpointer(
            s, build_batches(other, s, Cursor(), 0), other, resumed_from, LOG
        ) as checkpointer,
    ):
        assert checkpointer.run_dir == tmp_path / "async" and checkpointer.writer is not None
        checkpointer.save(state.step)
        assert checkpointer.committed == resumed_from and not checkpointer.failed()
        checkpointer.finish()
    assert checkpointer.committed == tmp_path / "async" / "checkpoints" / "step_00000001"
    assert same_files(checkpointer.committed, path)
    assert re.search(
        r"checkpoint of step 1: copied to host memory in \d+\.\d{3} s, writing in the background$",
        caplog.records[-2].getMessage(),
    ), caplog.text
    assert caplog.records[-1].getMessage() == f"checkpoint committed: {checkpointer.committed}"


def test_checkpointer_saves_synchronously_by_default(saved, tmp_path):
    cfg, s, path, state, _ = saved
    other = into(cfg, tmp_path / "sync")
    with Checkpointer(s, build_batches(other, s, Cursor(), 0), other, None, LOG) as checkpointer:
        checkpointer.save(state.step)
        # committed at once
        assert checkpointer.committed == tmp_path / "sync" / "checkpoints" / "step_00000001"
        assert checkpointer.writer is None and not checkpointer.failed()
    assert same_files(checkpointer.committed, path)


def same_files(path, saved) -> bool:
    """Every file as the fixture's save wrote it, byte for byte (sha256), but rng.pt (the fixture drew from the
    RNG after its save) and state.json, which is the same but for the run directory its config names."""
    files = [json.loads((p / "manifest.json").read_text())["files"] for p in (path, saved)]
    assert (
        sorted(files[0])
        == sorted(files[1])
        == ["model.safetensors", "optimizer.pt", "rng.pt", "state.json"]
    )
    states = [json.loads((p / "state.json").read_text()) for p in (path, saved)]
    for state in states:
        state["config"]["checkpoint"].pop("output_dir")
        state["config"]["checkpoint"].pop("async_save")
    return states[0] == states[1] and all(
        files[0][name] == files[1][name] for name in ("model.safetensors", "optimizer.pt")
    )
