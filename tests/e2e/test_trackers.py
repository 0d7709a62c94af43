"""`lockstep train` with train.report_to: two workers log to one MLflow run and one W&B run (rank
0 alone). An MLflow server that does not answer stops the command before any worker starts:
tests/unit/train/test_mlflow_tracker.py (in-process)."""

from __future__ import annotations

import json

import pytest
from conftest import TINY, run_lockstep

from lockstep.metrics import read_metrics

pytestmark = pytest.mark.slow
mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")


def test_two_workers_log_once_to_mlflow_and_wandb(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    run_lockstep(
        "train",
        "--world-size",
        "2",
        "--data",
        corpus,
        "--output-dir",
        run,
        *TINY,
        "--global-batch-size",
        "8",
        "--max-steps",
        "4",
        "--set",
        "train.plots=true",
        "--set",
        f"data.cache_dir={token_cache}",
        "--set",
        "train.report_to=mlflow,wandb",
        "--set",
        "train.project=e2e",
    )
    saved = json.loads((run / "trackers.json").read_text())
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    (only,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert only.info.run_id == saved["mlflow"]["run_id"] and only.info.status == "FINISHED"
    assert (
        only.data.params["distributed.world_size"] == "2"
        and only.data.params["train.batch_size"] == "8"
    )
    train_rows = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "train"]
    history = client.get_metric_history(only.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [
        (r["step"], r["loss"]) for r in train_rows
    ] and len(history) == 4
    assert {a.path for a in client.list_artifacts(only.info.run_id)} == {
        "loss.png",
        "step_times.png",
        "final_model.json",
    }
    # every rank's step time by cause, per log line (lockstep.train.step_clock)
    per_rank = client.get_metric_history(only.info.run_id, "ranks/rank1/data_ms")
    assert [m.step for m in per_rank] == [r["step"] for r in train_rows]
    assert [m.value for m in per_rank] == [r["ranks"][1]["data_ms"] for r in train_rows]
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1  # rank 1 opened none
    assert not (run / "tensorboard").exists()  # not named in train.report_to
