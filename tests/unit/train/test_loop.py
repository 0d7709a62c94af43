"""lockstep/train/loop.py: when the loop logs, evaluates and saves; the log window's sums, all-reduced over a real
2-process gloo group; a stop request from a real signal, agreed on by every rank; a loop stopped by one."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch

from conftest import one_process, run_ranks
from lockstep.config import CheckpointConfig, TrainConfig
from lockstep.data.sampler import Cursor
from lockstep.train.loop import Intervals, LogWindow, StopRequest, train_loop
from lockstep.train.setup import build_batches, build_setup, measure_peak_flops_total
from lockstep.train.state import TrainingState

from .tiny import tiny_config


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
    every = Intervals.from_config(TrainConfig(log_interval=7, eval_interval=0), CheckpointConfig(save_interval=50), 120)
    assert every == Intervals(log=7, eval=0, save=50, last=120)
    assert steps_where(every.should_save, 120) == [50, 100, 120] and steps_where(every.should_eval, 120) == [120]


def _window_on(rt) -> dict:
    """Rank r adds losses r+1 and r+2, grad norms 10(r+1) and 10(r+2), and 100(r+1) tokens; then resets."""
    window = LogWindow(rt.device)
    r = rt.rank
    loss = torch.tensor(float(r + 1), requires_grad=True)
    window.add(loss * 1, torch.tensor(10.0 * (r + 1)))
    window.add(torch.tensor(float(r + 2)), torch.tensor(10.0 * (r + 2)))
    window.tokens += 100 * (r + 1)
    kept = {"loss": window.loss.clone(), "grad_norm": window.grad_norm.clone(), "steps": window.steps,
            "requires_grad": window.loss.requires_grad, "device": str(window.loss.device)}
    loss_mean, norm_mean, tokens, seconds = window.summary(rt)
    window.reset()
    return {**kept, "summary": (loss_mean, norm_mean, tokens, seconds),
            "after_reset": (float(window.loss), float(window.grad_norm), window.steps, window.tokens)}


def test_log_window_sums_on_the_device_and_summarises_over_every_rank():
    results = run_ranks(_window_on)
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
        assert stop.signum is None and stop.agreed(one_process()) is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and stop.agreed(one_process()) == signal.SIGTERM
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_second_ctrl_c_aborts_at_once():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT  # the first one asks the loop to stop after its step
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def _stop_on(rt, scenarios: list[dict]) -> list[tuple]:
    """For each scenario, each rank sends itself the signal it names for that rank (if any); what the rank saw,
    and what the ranks agreed."""
    seen = []
    for signals in scenarios:
        with StopRequest() as stop:
            if rt.rank in signals:
                os.kill(os.getpid(), signals[rt.rank])
            seen.append((stop.signum, stop.agreed(rt)))
    return seen


def test_a_signal_to_one_rank_stops_every_rank():
    rank0, rank1 = run_ranks(_stop_on, [{1: signal.SIGTERM}, {}, {0: signal.SIGINT, 1: signal.SIGTERM}])
    # SIGTERM to rank 1 alone: rank 0 got nothing itself, and learns which signal stops the run
    assert rank0[0] == (None, signal.SIGTERM) and rank1[0] == (signal.SIGTERM, signal.SIGTERM)
    assert rank0[1] == rank1[1] == (None, None)
    # two signals: the same answer everywhere (the highest number)
    assert rank0[2] == (signal.SIGINT, signal.SIGTERM) and rank1[2] == (signal.SIGTERM, signal.SIGTERM)


def test_a_stop_request_logs_and_commits_the_step_it_stopped_at(tmp_path, corpus, token_cache):
    """SIGTERM before the first step: the loop runs that step, logs it and commits it although neither interval
    (log 10, save 0 of 100 steps) is due, then leaves with the signal."""
    run = tmp_path / "run"
    cfg = tiny_config(run, corpus, token_cache, **{"train.max_steps": 100, "train.log_interval": 10,
                                                   "checkpoint.save_interval": 0})
    log = logging.getLogger("lockstep.test")
    rt = one_process()
    s = build_setup(cfg, rt, log)
    s.peak_flops = measure_peak_flops_total(rt, cfg.train, s.flops_per_token)
    start = TrainingState(step=0, cursor=Cursor())
    s.batches, s.eval_batches = build_batches(s, start.cursor, 0, cfg.data, cfg.train)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        result = train_loop(cfg, s, start, None, stop, log)
    assert result.stop_signal == signal.SIGTERM and result.step == 1
    assert result.checkpoint == run / "checkpoints" / "step_00000001"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in rows] == [("train", 1)]  # no eval: step 1 is not the last step
    assert result.train_loss == rows[0]["loss"] and result.eval_loss is None
    state = json.loads((result.checkpoint / "state.json").read_text())
    assert state["step"] == 1 and state["cursor"] == {"epoch": 0, "offset": 8}
