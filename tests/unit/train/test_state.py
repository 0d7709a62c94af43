"""lockstep/train/state.py: a checkpoint's state.json as TrainingState, and a real checkpoint committed by the
Checkpointer on one process (the `saved` fixture, tests/unit/train/conftest.py): picked for the resume, restored
(weights, optimizer, schedule, RNG, cursor) into a freshly built run, plainly and through the sharded loader;
weights-only and other-world-size checkpoints."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import one_process

from lockstep.checkpoint.plain import save_checkpoint
from lockstep.data.sampler import Cursor
from lockstep.errors import CheckpointError
from lockstep.rng import capture_rng_state
from lockstep.train.state import TrainingState, pick_resume_point, restore_plain, restore_sharded

from .conftest import fresh

LOG = logging.getLogger("test.train.state")  # propagates to the root logger: caplog sees it
STATE_KEYS = [
    "step",
    "cursor",
    "scheduler",
    "config",
    "world_size",
    "global_batch",
    "tokens_seen",
    "grad_scaler",
    "layout",
]


def test_state_round_trips_through_its_json_keys():
    state = TrainingState(
        step=12,
        cursor=Cursor(epoch=1, offset=40),
        scheduler={"last_epoch": 12},
        config={"model": {"kind": "gpt"}},
        world_size=2,
        global_batch=16,
        tokens_seen=12 * 16 * 32,
        grad_scaler={"scale": 1024.0},
        layout="dp 2 (ddp) x tp 1 x pp 1 = world 2",
    )
    as_json = json.loads(json.dumps(state.to_dict()))  # what state.json holds
    assert list(as_json) == STATE_KEYS
    assert as_json["cursor"] == {"epoch": 1, "offset": 40} and as_json["tokens_seen"] == 6144
    assert TrainingState.from_dict(as_json) == state
    # keys an older checkpoint lacks read as None
    assert TrainingState.from_dict(
        {"step": 3, "cursor": {"epoch": 0, "offset": 24}}
    ) == TrainingState(step=3, cursor=Cursor(0, 24))


def test_the_checkpointer_commits_what_the_state_says(saved, tmp_path):
    cfg, s, path, state, _ = saved
    assert path == tmp_path / "run" / "checkpoints" / "step_00000001"
    assert json.loads((path / "state.json").read_text()) == json.loads(json.dumps(state.to_dict()))
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "optimizer.pt",
        "rng.pt",
        "state.json",
    ]


def test_pick_resume_point_takes_the_newest_that_verifies(saved, tmp_path, caplog):
    cfg, s, path, state, _ = saved
    run = tmp_path / "run"
    assert pick_resume_point(cfg.checkpoint, one_process(), run, LOG) == path
    newer = save_checkpoint(
        tmp_path / "run",
        2,
        s.workload.checkpoint_tensors(),
        s.optimizer.state_dict(),
        [capture_rng_state()],
        TrainingState(step=2, cursor=Cursor(0, 16)).to_dict(),
    )
    weights = newer / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # damaged: the resume falls back to step 1
    with caplog.at_level(logging.WARNING, LOG.name):
        assert pick_resume_point(cfg.checkpoint, one_process(), run, LOG) == path
    assert (
        "checkpoint step_00000002 is damaged" in caplog.text
        and "falling back to step_00000001" in caplog.text
    )

    assert (
        pick_resume_point(replace(cfg.checkpoint, resume="none"), one_process(), run, LOG) is None
    )
    with pytest.raises(CheckpointError, match=r"--resume .*nowhere: no such directory"):
        pick_resume_point(
            replace(cfg.checkpoint, resume=str(tmp_path / "nowhere")), one_process(), run, LOG
        )


def assert_restored(s, into, state, after_save, restored):
    assert restored == state
    saved_weights, weights = s.model.state_dict(), into.model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in saved_weights.items())
    want, got = s.optimizer.state_dict(), into.optimizer.state_dict()
    groups = lambda sd: [{**g, "betas": tuple(g["betas"])} for g in sd["param_groups"]]  # noqa: E731
    # the sharded path: a list
    assert groups(got) == groups(want) and got["state"].keys() == want["state"].keys()
    for i, slots in want["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in slots.items()), i
    assert (
        into.scheduler.state_dict() == s.scheduler.state_dict() and into.scheduler.last_epoch == 1
    )
    assert torch.equal(torch.rand(3), after_save)  # this rank's RNG as it was at the save


def test_restore_plain_puts_back_everything_the_run_saved(saved):
    cfg, s, path, state, after_save = saved
    into = fresh(cfg, seed=7)
    assert not torch.equal(into.model.head.weight, s.model.head.weight)
    restored = restore_plain(
        path,
        into.workload,
        into.optimizer,
        into.scheduler,
        into.scaler,
        rt=into.rt,
        seed=cfg.train.seed,
        seed_rank=0,
        plan=into.plan,
        log=LOG,
    )
    assert_restored(s, into, state, after_save, restored)


def test_restore_sharded_loads_a_plain_checkpoint_too(saved):
    # a run that switches to FSDP / TP / PP resumes a plain checkpoint through the sharded loader
    cfg, s, path, state, after_save = saved
    into = fresh(cfg, seed=7)
    restored = restore_sharded(
        path,
        into.model,
        into.optimizer,
        into.scheduler,
        partial=False,
        rt=into.rt,
        seed=cfg.train.seed,
        seed_rank=0,
        plan=into.plan,
        log=LOG,
    )
    assert_restored(s, into, state, after_save, restored)


def test_weights_only_checkpoint_starts_a_new_run_from_them(saved, tmp_path, caplog):
    cfg, s, _, _, _ = saved
    merged = save_checkpoint(
        tmp_path / "merged",
        9,
        s.model.state_dict(),
        None,
        None,
        {"step": 9, "merged_from": "step_00000009 of 2 runs"},
    )
    into = fresh(cfg, seed=7)
    with caplog.at_level(logging.WARNING, LOG.name):
        restored = restore_plain(
            merged,
            into.workload,
            into.optimizer,
            into.scheduler,
            into.scaler,
            rt=into.rt,
            seed=5,
            seed_rank=0,
            plan=into.plan,
            log=LOG,
        )
    assert restored == TrainingState(step=0, cursor=Cursor())
    assert all(torch.equal(into.model.state_dict()[k], v) for k, v in s.model.state_dict().items())
    assert into.optimizer.state_dict()["state"] == {} and into.scheduler.last_epoch == 0
    assert (
        "holds weights only (merged from step_00000009 of 2 runs): training starts from them at step 0"
        in caplog.text
    )
    seeded = torch.rand(3)
    torch.manual_seed(5 + 0)  # seed + this replica's rank, as a new run seeds it
    assert torch.equal(seeded, torch.rand(3))


def test_another_world_size_seeds_its_ranks_from_the_step(saved, tmp_path, caplog):
    cfg, s, _, _, _ = saved
    # saved by 2 ranks with a global batch of 16; resumed here on 1 process with 8
    state = TrainingState(
        step=4,
        cursor=Cursor(0, 64),
        scheduler=s.scheduler.state_dict(),
        world_size=2,
        global_batch=16,
    )
    path = save_checkpoint(
        tmp_path / "run",
        4,
        s.workload.checkpoint_tensors(),
        s.optimizer.state_dict(),
        [capture_rng_state(), capture_rng_state()],
        state.to_dict(),
    )  # one RNG state per rank
    into = fresh(cfg)
    with caplog.at_level(logging.WARNING, LOG.name):
        restored = restore_plain(
            path,
            into.workload,
            into.optimizer,
            into.scheduler,
            into.scaler,
            rt=into.rt,
            seed=100,
            seed_rank=1,
            plan=into.plan,
            log=LOG,
        )
    assert restored == state
    assert (
        "checkpoint was trained with global batch 16, now 8: the sample order from here differs"
        in caplog.text
    )
    seeded = torch.rand(3)
    torch.manual_seed(100 + 1_000_003 * 4 + 1)  # seed + 1_000_003 x step + this replica's rank
    assert torch.equal(seeded, torch.rand(3))


def test_an_hf_trainer_checkpoint_is_picked_as_it_is_and_a_damaged_lockstep_one_is_still_damaged(
    tmp_path,
):
    from safetensors.torch import save_file

    from lockstep.config import CheckpointConfig

    hf = tmp_path / "hf_out" / "checkpoint-500"
    hf.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, hf / "model.safetensors")
    (hf / "trainer_state.json").write_text('{"global_step": 500}')
    (hf / "optimizer.pt").write_bytes(b"not read")
    for given in (hf, hf.parent):  # the checkpoint, or the Trainer's output_dir
        assert (
            pick_resume_point(
                CheckpointConfig(resume=str(given)), one_process(), tmp_path / "run", LOG
            )
            == hf
        )
    # lockstep's own layout without its manifest: damaged, as before
    (hf / "state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="checkpoint is damaged"):
        pick_resume_point(CheckpointConfig(resume=str(hf)), one_process(), tmp_path / "run", LOG)


def _touch(path):
    Path(path).write_text("executed")


class _Payload:
    """A pickle that would create a file if anything unpickled it with code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


def test_a_poisoned_grad_compression_file_falls_back_to_the_checkpoint_before(
    saved, tmp_path, caplog
):
    """grad_compression.pt of the newest checkpoint replaced by a pickle that runs code, the
    manifest re-sealed over it: the payload never runs, verify says which file and why, and the run
    resumes from the checkpoint before."""
    from lockstep.checkpoint.manifest import file_entry, manifest_digest
    from lockstep.checkpoint.report import verify_report

    from .tiny import train

    cfg, s, first, state, _ = saved
    run, marker = tmp_path / "run", tmp_path / "pwned"
    compression = {
        "format": 1,
        "kind": "powersgd",
        "world_size": 1,
        "iter": 2,
        "q": {"head.weight": torch.randn(64)},
        "errors": [{"head.weight": torch.randn(8192)}],
    }
    newest = save_checkpoint(
        run,
        2,
        s.workload.checkpoint_tensors(),
        s.optimizer.state_dict(),
        [capture_rng_state()],
        replace(state, step=2, cursor=Cursor(0, 16)).to_dict(),
        compression=compression,
    )
    # as saved, it reaches Trainee.wrap_ddp (start.compression) as it was written
    into = fresh(cfg)
    handed = restore_plain(
        newest,
        into.workload,
        into.optimizer,
        into.scheduler,
        into.scaler,
        rt=into.rt,
        seed=cfg.train.seed,
        seed_rank=0,
        plan=into.plan,
        log=LOG,
    ).compression
    assert handed.keys() == compression.keys() and handed["iter"] == 2
    assert torch.equal(handed["errors"][0]["head.weight"], compression["errors"][0]["head.weight"])

    torch.save({**compression, "hook": _Payload(marker)}, newest / "grad_compression.pt")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"] = {name: file_entry(newest / name) for name in manifest["files"]}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (newest / "manifest.json").write_text(json.dumps(manifest))

    reason = (
        "grad_compression.pt: torch.load(weights_only=True) refuses it (UnpicklingError: "
        f"global {_touch.__module__}._touch is outside its allowlist)"
    )
    fallback = f"checkpoint step_00000002 is damaged ({reason}); falling back to step_00000001"
    ok, report = verify_report(run)  # `lockstep verify RUN`
    assert not ok and f"step_00000002  DAMAGED: {reason}" in report, report
    assert "--resume auto would take: step_00000001" in report
    with caplog.at_level(logging.WARNING, LOG.name):
        assert pick_resume_point(cfg.checkpoint, one_process(), run, LOG) == first
    assert fallback in caplog.text

    result = train(cfg)  # `lockstep train --resume auto` on one process, in this one
    log = (run / "logs" / "rank0.log").read_text()
    assert fallback in log and f"resumed from {first} at step 1" in log, log
    assert "Traceback" not in log
    assert result.checkpoint == run / "checkpoints" / "step_00000003"
    assert not marker.exists()  # refused, never run
