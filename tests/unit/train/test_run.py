"""lockstep/train/run.py: run_training in this process, on one CPU process, with a tiny GPT: the steps it ran, the
checkpoint it committed, the metrics it wrote, the resume of a second run, and what a finished run hands on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint.open import load_checkpoint
from lockstep.config import config_to_dict
from lockstep.errors import ConfigError
from lockstep.train.workload import Workload

from .tiny import tiny_config, train


def records(run: Path, split: str) -> list[dict]:
    return [
        r
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r["split"] == split
    ]


def test_a_finished_run_commits_its_last_step_and_logs_every_step(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    cfg = tiny_config(run, corpus, token_cache, **{"train.plots": True})
    result = train(cfg)

    assert result.run_dir == run and result.step == 3 and result.stop_signal is None
    assert result.checkpoint == run / "checkpoints" / "step_00000003"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    # save_interval 200
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000003"]

    train_rows, eval_rows = records(run, "train"), records(run, "eval")
    # eval at the end
    assert [r["step"] for r in train_rows] == [1, 2, 3] and [r["step"] for r in eval_rows] == [3]
    assert result.train_loss == train_rows[-1]["loss"] and result.eval_loss == eval_rows[0]["loss"]
    assert all(4.0 < r["loss"] < 7.0 for r in train_rows)  # ~ln(256) for an untrained byte model
    # epochs done as a float (3 steps x 8 of 5440 windows); no total in a run bound by its steps
    assert [r["epoch"] for r in train_rows] == [8 / 5440, 16 / 5440, 24 / 5440]
    assert all(r["tokens_per_s"] > 0 and "epochs" not in r and r["eta_s"] >= 0 for r in train_rows)
    assert train_rows[-1]["eta_s"] == 0.0  # the last step: nothing left
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "steps 0 -> 3" in (run / "logs" / "rank0.log").read_text()

    ckpt = load_checkpoint(result.checkpoint)
    assert ckpt.state["step"] == 3 and ckpt.state["cursor"] == {
        "epoch": 0,
        "offset": 24,
    }  # 3 steps x 8 windows
    assert ckpt.state["world_size"] == 1 and ckpt.state["global_batch"] == 8
    assert ckpt.state["tokens_seen"] == 3 * 8 * 32
    assert ckpt.state["layout"] == "dp 1 (ddp) x tp 1 x pp 1 = world 1"
    assert ckpt.state["config"] == config_to_dict(cfg)
    # a finished run hands lockstep.tools.final the trained model: the weights of the last checkpoint
    assert isinstance(result.workload, Workload)
    trained = result.workload.model.state_dict()
    assert trained.keys() == ckpt.tensors.keys()
    assert all(torch.equal(trained[k], v) for k, v in ckpt.tensors.items())


def test_an_epoch_bound_run_shows_epochs_done_of_the_total(tmp_path, corpus, token_cache):
    small = tmp_path / "small.txt"
    small.write_text(corpus.read_text()[:3000])  # a few dozen windows: a few steps an epoch
    run = tmp_path / "run"
    bound = {"train.epochs": 2, "train.max_steps": 10_000}
    result = train(tiny_config(run, small, token_cache, **bound))
    rows = records(run, "train")
    per_epoch, last = result.step // 2, result.step
    assert last == 2 * per_epoch and per_epoch >= 3
    assert [r["step"] for r in rows] == list(range(1, last + 1))
    # epoch 1's last step, the step after it
    assert rows[per_epoch - 1]["epoch"] == 1.0 and rows[per_epoch]["epoch"] == 1 + 1 / per_epoch
    assert rows[-1]["epoch"] == 2.0 and all(r["epochs"] == 2.0 for r in rows)
    log = (run / "logs" / "rank0.log").read_text()
    assert f"step {per_epoch}/{last} | " in log and "| epoch 1.00/2 |" in log
    end = next(line for line in log.splitlines() if f"step {last}/{last} | loss" in line)
    assert "| epoch 2.00/2 |" in end and end.endswith("| eta 0s")


def test_a_second_run_resumes_where_the_first_committed(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    train(tiny_config(run, corpus, token_cache))
    result = train(tiny_config(run, corpus, token_cache, **{"train.max_steps": 5}))

    assert result.step == 5 and result.checkpoint == run / "checkpoints" / "step_00000005"
    # appended: steps 4 and 5 only
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3, 4, 5]
    log = (run / "logs" / "rank0.log").read_text()
    assert (
        f"resumed from {run / 'checkpoints' / 'step_00000003'} at step 3 (epoch 0, sample 24 of the epoch"
        in log
    )
    assert "steps 3 -> 5" in log
    assert not (run / "loss.png").exists() and "loss curve" not in log  # train.plots: false
    assert load_checkpoint(result.checkpoint).state["cursor"] == {"epoch": 0, "offset": 40}


def test_a_run_at_its_last_step_trains_nothing_and_keeps_its_checkpoint(
    tmp_path, corpus, token_cache
):
    run = tmp_path / "run"
    cfg = tiny_config(run, corpus, token_cache)
    train(cfg)
    result = train(cfg)
    assert result.step == 3 and result.checkpoint == run / "checkpoints" / "step_00000003"
    # it finished: the final outputs follow
    assert result.train_loss is None and result.workload is not None
    assert len(records(run, "train")) == 3
    assert (
        "checkpoint is at step 3, the run's last step is 3: nothing left to train"
        in (run / "logs" / "rank0.log").read_text()
    )


def test_a_user_error_is_logged_once_and_raised(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    with pytest.raises(
        ConfigError, match=r"world_size\(1\) is not divisible by tensor_parallel\(2\)"
    ) as e:
        train(tiny_config(run, corpus, token_cache, **{"parallel.tensor_parallel": 2}))
    assert e.value.logged  # the CLI does not print it a second time
    assert (
        "rank 0 (" in (run / "logs" / "rank0.log").read_text()
        and "tensor_parallel(2)" in (run / "logs" / "rank0.log").read_text()
    )
    assert not (run / "checkpoints").exists()
