"""lockstep/train/loop.py: when the loop logs, evaluates and saves; the log window's sums, all-reduced over a real
2-process gloo group; a stop request from a real signal, agreed on by every rank; a loop stopped by one; saves in
the background (checkpoint.async_save): the same checkpoints, an exact resume, on 1 process and 2 FSDP ranks, and
a failed background write that stops every rank at the next step."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import one_process, run_ranks

from lockstep.config import CheckpointConfig, TrainConfig
from lockstep.errors import CheckpointError
from lockstep.train.loop import Intervals, LogWindow, StopRequest, train_loop

from .tiny import build_run, tiny_config, train


def steps_where(predicate, last: int) -> list[int]:
    return [step for step in range(1, last + 1) if predicate(step)]


def test_intervals_fire_every_n_steps_and_at_the_last_step():
    every = Intervals(log=10, eval=5, save=4, last=22)
    assert steps_where(every.should_log, 22) == [10, 20, 22]
    assert steps_where(every.should_eval, 22) == [5, 10, 15, 20, 22]
    assert steps_where(every.should_save, 22) == [4, 8, 12, 16, 20, 22]
    # 0 = at the last step only; a last step on the interval fires once
    at_end = Intervals(log=1, eval=0, save=0, last=6)
    assert steps_where(at_end.should_log, 6) == [1, 2, 3, 4, 5, 6]
    assert steps_where(at_end.should_eval, 6) == [6] and steps_where(at_end.should_save, 6) == [6]
    assert steps_where(Intervals(log=3, eval=3, save=3, last=6).should_save, 6) == [3, 6]


def test_intervals_read_the_train_and_checkpoint_settings():
    every = Intervals.from_config(
        TrainConfig(log_interval=7, eval_interval=0), CheckpointConfig(save_interval=50), 120
    )
    assert every == Intervals(log=7, eval=0, save=50, last=120)
    assert steps_where(every.should_save, 120) == [50, 100, 120] and steps_where(
        every.should_eval, 120
    ) == [120]


def _window_on(rt) -> dict:
    """Rank r adds losses r+1 and r+2, grad norms 10(r+1) and 10(r+2), and 100(r+1) tokens; then resets."""
    window = LogWindow(rt.device)
    r = rt.rank
    loss = torch.tensor(float(r + 1), requires_grad=True)
    window.add(loss * 1, torch.tensor(10.0 * (r + 1)))
    window.add(torch.tensor(float(r + 2)), torch.tensor(10.0 * (r + 2)))
    window.tokens += 100 * (r + 1)
    kept = {
        "loss": window.loss.clone(),
        "grad_norm": window.grad_norm.clone(),
        "steps": window.steps,
        "requires_grad": window.loss.requires_grad,
        "device": str(window.loss.device),
    }
    loss_mean, norm_mean, tokens, seconds = window.summary(rt)
    window.reset()
    return {
        **kept,
        "summary": (loss_mean, norm_mean, tokens, seconds),
        "after_reset": (float(window.loss), float(window.grad_norm), window.steps, window.tokens),
    }


def test_log_window_sums_on_the_device_and_summarises_over_every_rank(two_ranks):
    results = [rank["window"] for rank in two_ranks]
    for rank, got in enumerate(results):
        # this rank's sums stay tensors (no sync each step), detached from the graph
        assert torch.equal(got["loss"], torch.tensor(2.0 * rank + 3)) and got["steps"] == 2
        assert torch.equal(got["grad_norm"], torch.tensor(10.0 * (2 * rank + 3)))
        assert not got["requires_grad"] and got["device"] == "cpu"
        loss_mean, norm_mean, tokens, seconds = got["summary"]
        # over both ranks' 2 steps each: losses 1, 2, 2, 3; norms 10, 20, 20, 30; tokens 100 + 200
        assert (loss_mean, norm_mean, tokens) == (2.0, 20.0, 300.0) and seconds >= 0
        assert got["after_reset"] == (0.0, 0.0, 0, 0)


def test_log_window_on_one_process():
    window = LogWindow(torch.device("cpu"))
    for loss in (4.0, 5.0, 6.0):
        window.add(torch.tensor(loss), torch.tensor(1.5))
    window.tokens = 768
    loss, norm, tokens, seconds = window.summary(one_process())
    assert (loss, norm, tokens) == (5.0, 1.5, 768.0) and seconds >= 0


def test_a_real_sigterm_sets_the_request_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        assert stop.signum is None and stop.agreed(one_process()) == (None, False)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.agreed(one_process()) == (
            signal.SIGTERM,
            False,
        )
        assert stop.agreed(one_process(), save_failed=True) == (signal.SIGTERM, True)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_second_ctrl_c_aborts_at_once():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT  # the first one asks the loop to stop after its step
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def _stop_on(rt, scenarios: list[tuple[dict, set]]) -> list[tuple]:
    """For each scenario (signals by rank, ranks whose background save failed), each rank sends itself the signal
    it names for that rank (if any); what the rank saw, and what the ranks agreed (signal, a save failed)."""
    seen = []
    for signals, failed in scenarios:
        with StopRequest() as stop:
            if rt.rank in signals:
                os.kill(os.getpid(), signals[rt.rank])
            seen.append((stop.signum, *stop.agreed(rt, save_failed=rt.rank in failed)))
    return seen


STOPS = [
    ({1: signal.SIGTERM}, set()),
    ({}, set()),
    ({0: signal.SIGINT, 1: signal.SIGTERM}, set()),
    ({}, {0}),
    ({1: signal.SIGINT}, {1}),
]


def _window_and_stops(rt) -> dict:
    """_window_on, then _stop_on(STOPS), on the same ranks."""
    return {"window": _window_on(rt), "stops": _stop_on(rt, STOPS)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_window_and_stops)


def test_a_signal_to_one_rank_stops_every_rank(two_ranks):
    rank0, rank1 = (rank["stops"] for rank in two_ranks)
    # SIGTERM to rank 1 alone: rank 0 got nothing itself, and learns which signal stops the run
    assert rank0[0] == (None, signal.SIGTERM, False) and rank1[0] == (
        signal.SIGTERM,
        signal.SIGTERM,
        False,
    )
    assert rank0[1] == rank1[1] == (None, None, False)
    # two signals: the same answer everywhere (the highest number)
    assert rank0[2] == (signal.SIGINT, signal.SIGTERM, False) and rank1[2] == (
        signal.SIGTERM,
        signal.SIGTERM,
        False,
    )
    # a background save failed on one rank: every rank learns it in the same all-reduce, with or without a signal
    assert rank0[3] == rank1[3] == (None, None, True)
    assert rank0[4] == (None, signal.SIGINT, True) and rank1[4] == (
        signal.SIGINT,
        signal.SIGINT,
        True,
    )


def test_a_stop_request_logs_and_commits_the_step_it_stopped_at(tmp_path, corpus, token_cache):
    """SIGTERM before the first step: the loop runs that step, logs it and commits it although neither interval
    (log 10, save 0 of 100 steps) is due, then leaves with the signal."""
    run = tmp_path / "run"
    cfg = tiny_config(
        run,
        corpus,
        token_cache,
        **{"train.max_steps": 100, "train.log_interval": 10, "checkpoint.save_interval": 0},
    )
    log = logging.getLogger("lockstep.test")
    trainee, batches = build_run(cfg, one_process())
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        result = train_loop(cfg, trainee, batches, stop, log)
    assert result.stop_signal == signal.SIGTERM and result.step == 1
    assert result.checkpoint == run / "checkpoints" / "step_00000001"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # no eval: step 1 is not the last step
    assert [(r["split"], r["step"]) for r in rows] == [("train", 1)]
    assert result.train_loss == rows[0]["loss"] and result.eval_loss is None
    state = json.loads((result.checkpoint / "state.json").read_text())
    assert state["step"] == 1 and state["cursor"] == {"epoch": 0, "offset": 8}


# ---- checkpoint.async_save: the same checkpoints, an exact resume, a failed write stopping every rank ----------


def _manifest_files(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step_{step:08d}" / "manifest.json").read_text())[
        "files"
    ]


def _assert_same_checkpoint(background: Path, sync: Path, step: int) -> None:
    """Every file of the two runs' checkpoints of `step` byte for byte (sha256), but DCP's index, which holds the
    temporary dir's path, and state.json, whose config differs in checkpoint.async_save alone."""
    files = [_manifest_files(run, step) for run in (background, sync)]
    assert sorted(files[0]) == sorted(files[1])
    assert {n: e for n, e in files[0].items() if n not in (".metadata", "state.json")} == {
        n: e for n, e in files[1].items() if n not in (".metadata", "state.json")
    }, step
    states = [
        json.loads((run / "checkpoints" / f"step_{step:08d}" / "state.json").read_text())
        for run in (background, sync)
    ]
    assert [s["config"]["checkpoint"].pop("async_save") for s in states] == [True, False]
    assert states[0] == states[1]


def test_saves_in_the_background_write_the_checkpoints_a_synchronous_run_writes(
    tmp_path, corpus, token_cache
):
    """One process: the run with async_save commits byte-identical checkpoints, and a resume from its step 2 ends at
    the weights, optimizer state and RNG of the uninterrupted run."""
    run = tmp_path / "run"
    settings = {"train.max_steps": 4, "checkpoint.save_interval": 2}
    done = train(
        tiny_config(run, corpus, token_cache, **settings, **{"checkpoint.async_save": True})
    )
    assert done.step == 4 and done.checkpoint == run / "checkpoints" / "step_00000004"
    run.rename(tmp_path / "async")
    # the same path: state.json's config is the same too
    train(tiny_config(run, corpus, token_cache, **settings))
    for step in (2, 4):
        _assert_same_checkpoint(tmp_path / "async", run, step)
    resumed = train(
        tiny_config(
            tmp_path / "resumed",
            corpus,
            token_cache,
            **settings,
            **{
                "checkpoint.async_save": True,
                "checkpoint.resume": str(tmp_path / "async" / "checkpoints" / "step_00000002"),
            },
        )
    )
    assert resumed.step == 4
    for name in ("model.safetensors", "optimizer.pt", "rng.pt"):
        assert _manifest_files(tmp_path / "resumed", 4)[name] == _manifest_files(run, 4)[name], name


def _fsdp_runs(rt, base: str, corpus: str, token_cache: str) -> dict:
    """On 2 FSDP ranks: a run saving in the background, the same run saving synchronously (at the same path), and
    a run resumed from the first one's step 2; what each returned."""
    from lockstep.train.run import _train

    base_dir, out = Path(base), {}

    def run(name: str, **overrides):
        cfg = tiny_config(
            base_dir / "run",
            Path(corpus),
            Path(token_cache),
            **{
                "parallel.data_parallel": "fsdp",
                "train.max_steps": 4,
                "checkpoint.save_interval": 2,
                **overrides,
            },
        )
        (base_dir / "run").mkdir(exist_ok=True)  # as run_training's logging makes it
        with StopRequest() as stop:
            result, _ = _train(cfg, rt, logging.getLogger("test.loop.fsdp"), stop)
        out[name] = (result.step, str(result.checkpoint))
        torch.distributed.barrier()
        if rt.is_main:
            (base_dir / "run").rename(base_dir / name)
        torch.distributed.barrier()

    run("async", **{"checkpoint.async_save": True})
    run("sync")
    run(
        "resumed",
        **{
            "checkpoint.async_save": True,
            "checkpoint.resume": str(base_dir / "async" / "checkpoints" / "step_00000002"),
        },
    )
    return out


@pytest.mark.slow
def test_fsdp_saves_in_the_background_like_synchronous_ones_and_resume_exactly(
    tmp_path, corpus, token_cache
):
    from lockstep.checkpoint.open import verify_checkpoint
    from lockstep.checkpoint.sharded_load import load_full_model_tensors

    rank0, rank1 = run_ranks(_fsdp_runs, str(tmp_path), str(corpus), str(token_cache))
    assert rank0 == rank1
    assert {name: step for name, (step, _) in rank0.items()} == {
        "async": 4,
        "sync": 4,
        "resumed": 4,
    }
    # named once committed
    assert rank0["async"][1] == str(tmp_path / "run" / "checkpoints" / "step_00000004")
    for step in (2, 4):
        assert verify_checkpoint(tmp_path / "async" / "checkpoints" / f"step_{step:08d}") == []
        # every rank's shards included
        _assert_same_checkpoint(tmp_path / "async", tmp_path / "sync", step)
        assert sorted(_manifest_files(tmp_path / "async", step)) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "rng.pt",
            "state.json",
        ]
    final = [
        load_full_model_tensors(tmp_path / name / "checkpoints" / "step_00000004")
        for name in ("sync", "resumed")
    ]
    assert final[0].keys() == final[1].keys() and all(
        torch.equal(final[1][k], v) for k, v in final[0].items()
    )
    resumed, uninterrupted = (
        _manifest_files(tmp_path / "resumed", 4),
        _manifest_files(tmp_path / "async", 4),
    )
    # the optimizer state too: it sits in the shards
    for name in ("__0_0.distcp", "__1_0.distcp", "rng.pt"):
        assert resumed[name] == uninterrupted[name], name


def _failing_run(rt, run: str, corpus: str, token_cache: str) -> str:
    """Resume at step 2 on 2 DDP ranks from a checkpoint dir that has become read-only, saving in the background at
    every step; the writer waits for each save's thread right after starting it, so the failure of step 3's save
    is known when step 4 ends (without that it is known at the first step end after it ends)."""
    from lockstep.checkpoint.background import BackgroundWriter
    from lockstep.train.run import _train

    start = BackgroundWriter.start

    def start_and_join(self, step, job):
        start(self, step, job)
        self.join()

    BackgroundWriter.start = start_and_join
    cfg = tiny_config(
        Path(run),
        Path(corpus),
        Path(token_cache),
        **{"train.max_steps": 8, "checkpoint.save_interval": 1, "checkpoint.async_save": True},
    )
    try:
        with StopRequest() as stop:
            _train(cfg, rt, logging.getLogger("test.loop.failing"), stop)
    except CheckpointError as e:
        return str(e)
    return "no CheckpointError"


def test_a_failed_background_save_stops_every_rank_at_the_next_step(tmp_path, corpus, token_cache):
    from tmpfs import read_only, tmpfs

    from lockstep.checkpoint.resume import resolve_resume

    run = tmp_path / "run"
    run.mkdir()
    with tmpfs(run / "checkpoints") as checkpoints:
        train(
            tiny_config(
                run, corpus, token_cache, **{"train.max_steps": 2, "checkpoint.save_interval": 2}
            )
        )
        before = {p.name: p.read_bytes() for p in (checkpoints / "step_00000002").iterdir()}
        read_only(checkpoints)
        errors = run_ranks(_failing_run, str(run), str(corpus), str(token_cache))
        assert errors[0] == errors[1]  # rank 0's failure, word for word on rank 1
        assert errors[0].startswith(
            f"saving the checkpoint of step 3 failed on rank 0 (CheckpointError: cannot write "
            f"the checkpoint of step 3 under {checkpoints} (Read-only file system: "
        )
        assert errors[0].endswith(
            "the previous checkpoint is untouched (written in the background; noticed after "
            "step 4, where the run stops)"
        )
        assert (checkpoints / "latest").read_text() == "step_00000002\n"
        assert {p.name: p.read_bytes() for p in (checkpoints / "step_00000002").iterdir()} == before
        assert resolve_resume(run, "auto", log=pytest.fail) == checkpoints / "step_00000002"
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        # step 4 trained, and stopped at its all-reduce, before its log line
        assert [r["step"] for r in metrics if r["split"] == "train"] == [1, 2, 3]


# ---- what each log line adds: the wait for batches, and the steps fp16's loss scaling skipped ----------------


def test_overflowing_steps_are_counted_logged_and_leave_the_weights_alone(
    tmp_path, corpus, token_cache, caplog
):
    """A real GradScaler (torch's CPU one: the loop's check is the same on every device) whose first scale is so
    large that the scaled loss overflows: the scaler skips those steps and halves its scale each time; the loop
    counts each and warns about each."""
    run = tmp_path / "run"
    cfg = tiny_config(run, corpus, token_cache, **{"train.max_steps": 3, "train.log_interval": 3})
    log = logging.getLogger("lockstep.test")
    built, batches = build_run(cfg, one_process())
    # the same Trainee with a loss scaler: loss x 2^127 > fp32's 3.4e38, inf
    trainee = dataclasses.replace(built, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**127))
    before = {k: v.clone() for k, v in trainee.model.state_dict().items()}
    with StopRequest() as stop, caplog.at_level(logging.WARNING, logger="lockstep.test"):
        train_loop(cfg, trainee, batches, stop, log)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    # the first steps, until the halved scale no longer overflows
    skipped = int(row["skipped_steps"])
    # halved once per skipped step
    assert skipped >= 1 and row["loss_scale"] == 2.0 ** (127 - skipped)
    assert [
        r.getMessage().split(":")[0] for r in caplog.records if "overflowed" in r.getMessage()
    ] == [f"step {i} skipped" for i in range(1, skipped + 1)]
    unchanged = all(torch.equal(v, before[k]) for k, v in trainee.model.state_dict().items())
    assert unchanged == (skipped == 3)  # a step that was not skipped moved the weights
    assert row["data_wait_ms"] >= 0


def test_a_run_without_loss_scaling_logs_its_data_wait_and_no_skips(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    train(tiny_config(run, corpus, token_cache, **{"train.max_steps": 2}))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert len(train_rows) == 2 and all(r["data_wait_ms"] >= 0 for r in train_rows)
    # no GradScaler: nothing to skip
    assert not any("skipped_steps" in r or "loss_scale" in r for r in rows)
