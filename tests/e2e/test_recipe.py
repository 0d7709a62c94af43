"""The "independent copies, then average" recipe end to end: split, train each part, merge, sample, train on."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, run_lockstep

from lockstep.checkpoint.commit import list_checkpoints
from lockstep.checkpoint.open import load_checkpoint

pytestmark = pytest.mark.slow


def test_split_train_two_copies_merge_then_continue(tmp_path, corpus, token_cache):
    run_lockstep("split", corpus, "--parts", "2", "-o", tmp_path / "parts", "--seed", "0")
    parts = sorted((tmp_path / "parts").glob("part-*"))
    assert len(parts) == 2
    runs = []
    for i, part in enumerate(parts):
        run = tmp_path / f"copy{i}"
        run_lockstep(
            "train",
            "--data",
            part,
            "--output-dir",
            run,
            *TINY,
            "--global-batch-size",
            "4",
            "--max-steps",
            "3",
            "--set",
            f"data.cache_dir={token_cache}",
            "--set",
            "data.eval_fraction=0.1",
        )
        runs.append(run)
    run_lockstep("merge", *runs, "-o", tmp_path / "merged")
    merged = load_checkpoint(list_checkpoints(tmp_path / "merged")[0])
    a, b = (load_checkpoint(list_checkpoints(r)[0]).tensors for r in runs)
    for name, tensor in merged.tensors.items():
        torch.testing.assert_close(tensor, (a[name] + b[name]) / 2, rtol=0, atol=1e-7)
    assert run_lockstep(
        "sample", tmp_path / "merged", "--prompt", "def ", "--max-new-tokens", "8"
    ).stdout
    # the merge is a new starting point: training continues from its weights at step 0
    ckpt = list_checkpoints(tmp_path / "merged")[0]
    run_lockstep(
        "train",
        "--data",
        corpus,
        "--output-dir",
        tmp_path / "continued",
        *TINY,
        "--global-batch-size",
        "4",
        "--max-steps",
        "2",
        "--resume",
        ckpt,
        "--set",
        f"data.cache_dir={token_cache}",
    )
    log = (tmp_path / "continued" / "logs" / "rank0.log").read_text()
    assert "holds weights only" in log
    assert load_checkpoint(list_checkpoints(tmp_path / "continued")[0]).state["step"] == 2
