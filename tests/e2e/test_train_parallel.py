"""FSDP, tensor and pipeline parallel training of the built-in GPT through `lockstep train`, end to end:
parity with one process, sharded checkpoints resumed at other world sizes, merge and verify of sharded runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TINY, run_lockstep

from lockstep.checkpoint.commit import list_checkpoints
from lockstep.checkpoint.manifest import is_sharded
from lockstep.checkpoint.open import load_checkpoint
from lockstep.checkpoint.sharded_load import load_full_model_tensors

pytestmark = pytest.mark.slow


LAYOUTS = [
    (2, ["--set", "parallel.data_parallel=fsdp", "--grad-accum", "2"]),
    (2, ["--set", "parallel.tensor_parallel=2"]),
    (
        2,
        [
            "--set",
            "parallel.pipeline_parallel=2",
            "--grad-accum",
            "2",
            "--set",
            "parallel.pipeline_schedule=1f1b",
        ],
    ),
    (
        2,
        [
            "--set",
            "parallel.pipeline_parallel=2",
            "--grad-accum",
            "2",
            "--set",
            "parallel.pipeline_schedule=gpipe",
        ],
    ),
    # 2-D: dp 2 x tp 2
    (4, ["--set", "parallel.data_parallel=fsdp", "--set", "parallel.tensor_parallel=2"]),
    # pipeline stages with data-parallel replicas (with tensor-parallel peers inside them too:
    # tests/unit/parallel/test_pp.py, pp 2 x dp 2 x tp 2 through apply_tp and build_pipeline)
    (4, ["--set", "parallel.pipeline_parallel=2", "--grad-accum", "2"]),
]


def _parity(run, corpus, token_cache, world: int, layout: list[str], *extra):
    return run_lockstep(
        "parity",
        "--world-size",
        str(world),
        "--steps",
        "5",
        "--data",
        corpus,
        "--output-dir",
        run,
        *TINY,
        "--global-batch-size",
        "8",
        "--mixed-precision",
        "no",
        "--set",
        f"data.cache_dir={token_cache}",
        *layout,
        *extra,
        timeout=400,
    )


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory, corpus, token_cache):
    """A real `lockstep parity` of the first layout (fsdp), both runs trained. Its 1-process
    reference (parity/reference) is the one parity builds for every layout (ddp, tp 1, pp 1, the
    same seed, steps and global batch: tests/unit/tools/test_parity.py), so the other layouts
    compare with it through `lockstep parity --reference`, which refuses another config's run."""
    run = tmp_path_factory.mktemp("parity") / "run"
    world, layout = LAYOUTS[0]
    _parity(run, corpus, token_cache, world, layout)
    return run


@pytest.mark.parametrize(
    "world, layout",
    LAYOUTS,
    ids=["fsdp", "tp2", "pp2-1f1b", "pp2-gpipe", "fsdp2xtp2", "pp2xdp2"],
)
def test_layout_matches_one_process_step_by_step(
    tmp_path, corpus, token_cache, parity_run, world, layout
):
    # fp32: the runs differ only by the order of floating-point sums; 1e-4 relative is far above that
    # (measured: under 1e-7) and far below what a wrong gradient gives (dropout alone gives ~1e-2)
    reference = parity_run / "parity" / "reference"
    if (world, layout) == LAYOUTS[0]:
        run = parity_run  # both runs and the report
    else:  # the parallel run only, compared with the shared reference
        run = tmp_path / "run"
        _parity(run, corpus, token_cache, world, layout, "--reference", reference)
    report = json.loads((run / "parity" / "parity.json").read_text())
    assert report["ok"] and len(report["steps"]) == 5 and report["max_rel_diff"] < 1e-4, report
    assert report["steps"][-1]["parallel"] < report["steps"][0]["parallel"]  # it trained
    reused = run != parity_run
    assert report["reference"] == str(reference) and report["reference_reused"] == reused
    assert (run / "parity" / "reference.log").exists() != reused  # the reference trained once
    ckpt = list_checkpoints(run / "parity" / "parallel")[0]
    assert is_sharded(ckpt)
    # every rank's step time by cause: a pipeline's stages wait for each other in its bubble
    records = [json.loads(line) for line in (run / "parity" / "parallel" / "metrics.jsonl").open()]
    bubbles = [row["bubble_ms"] for r in records if r.get("ranks") for row in r["ranks"]]
    pipelined = "parallel.pipeline_parallel=2" in layout
    assert len(bubbles) == 5 * world and all((b > 0) == pipelined for b in bubbles), bubbles


def _train(run, corpus, token_cache, world: int, steps: int, *extra: str):
    return run_lockstep(
        "train",
        "--world-size",
        str(world),
        "--data",
        corpus,
        "--output-dir",
        run,
        *TINY,
        "--global-batch-size",
        "8",
        "--mixed-precision",
        "no",
        "--max-steps",
        str(steps),
        "--save-interval",
        "4",
        "--set",
        "train.record_samples=true",
        "--set",
        f"data.cache_dir={token_cache}",
        *extra,
        timeout=400,
    )


def _samples(run, steps) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for f in (run / "samples").glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            if row["step"] in steps:
                out.setdefault(row["step"], []).extend(i for mb in row["micro_batches"] for i in mb)
    return {k: sorted(v) for k, v in out.items()}


def _losses(run) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split", "train") == "train"}


def test_fsdp_checkpoint_resumes_on_one_and_four_ranks_with_the_same_cursor(
    tmp_path, corpus, token_cache
):
    fsdp = ["--set", "parallel.data_parallel=fsdp"]
    _train(tmp_path / "whole", corpus, token_cache, 2, 8, *fsdp)  # the uninterrupted reference
    _train(tmp_path / "half", corpus, token_cache, 2, 4, *fsdp)
    saved = list_checkpoints(tmp_path / "half")[0]
    assert (
        is_sharded(saved)
        and len(list(saved.glob("*.distcp"))) + len(list(saved.rglob("*.distcp"))) >= 2
    )
    for world in (1, 4):
        run = tmp_path / f"on{world}"
        shutil.copytree(tmp_path / "half", run)
        shutil.rmtree(run / "samples")
        _train(run, corpus, token_cache, world, 8, *fsdp)
        assert (
            f"resumed from {run}/checkpoints/step_00000004 at step 4"
            in (run / "logs" / "rank0.log").read_text()
        )
        # the same samples at every step after the resume, however many ranks read them
        assert _samples(run, range(5, 9)) == _samples(tmp_path / "whole", range(5, 9))
        ref, got = _losses(tmp_path / "whole"), _losses(run)
        for step in range(5, 9):
            assert got[step] == pytest.approx(ref[step], rel=1e-4), (world, step)
        state = load_checkpoint(list_checkpoints(run)[0]).state
        assert (
            state["step"] == 8
            and state["cursor"]
            == load_checkpoint(list_checkpoints(tmp_path / "whole")[0]).state["cursor"]
        )

    # merge a sharded (4-rank fsdp) and a plain (1-process) checkpoint: the mean, tensor by tensor
    a, b = list_checkpoints(tmp_path / "on4")[0], list_checkpoints(tmp_path / "on1")[0]
    assert is_sharded(a) and not is_sharded(b)
    run_lockstep("merge", a, b, "-o", tmp_path / "merged")
    merged = load_checkpoint(list_checkpoints(tmp_path / "merged")[0]).tensors
    ta, tb = load_full_model_tensors(a), load_full_model_tensors(b)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, (ta[name] + tb[name]) / 2, rtol=0, atol=1e-7)

    # export: a sharded checkpoint becomes one consolidated safetensors file that a plain GPT loads
    from safetensors.torch import load_model

    from lockstep.config import config_from_dict
    from lockstep.models.gpt import build_gpt

    run_lockstep("export", a, "-o", tmp_path / "export")
    model = build_gpt(config_from_dict(load_checkpoint(a).state["config"]).model)
    load_model(model, tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(v, ta[k]) for k, v in model.state_dict().items())

    # a missing shard: verify names it, and a resume falls back to the checkpoint before
    victim = next(a.rglob("*.distcp"))
    victim.unlink()
    proc = run_lockstep("verify", a, check=False)
    assert proc.returncode == 1 and victim.name in proc.stdout, proc.stdout
