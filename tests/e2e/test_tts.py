"""The TTS team's job end to end: their command under torchrun on 2 processes (a tiny Higgs Audio v2 + codec from a
local Hugging Face cache), loss falling, adapters checkpointed, each wav decoded once, an exact resume mid-epoch from
a checkpoint it committed, and `lockstep sample` speaking a sentence into a wav. A killed run resuming from its last
committed checkpoint is tests/e2e/test_train_dist.py's; here the team's data path (codes cache, buckets, cursor)
resumes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
import torch
from conftest import run_lockstep

from lockstep.checkpoint.open import load_checkpoint
from lockstep.checkpoint.resume import resume_order

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tts_higgs"


def _team_command(run: Path, cache: Path) -> list[str]:
    """Their flags as written, but for the three values the tiny stand-in needs (examples/tts_higgs/run.sh)."""
    return [
        str(Path(sys.executable).with_name("torchrun")),
        "--nproc_per_node=2",
        "-m",
        "lockstep",
        "train",
        "--model_path",
        "bosonai/higgs-audio-v2-generation-3B-base",
        "--audio_tokenizer_path",
        "bosonai/higgs-audio-v2-tokenizer",
        "--train_data_file",
        "higgs-audio/training_data/chatml/train_chatml_samples.json",
        "--output_dir",
        str(run),
        "--save_steps",
        "5",
        "--disable_evaluation",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "1e-2",
        "--num_train_epochs",
        "3",
        "--logging_steps",
        "4",
        "--warmup_steps",
        "5",
        "--bf16",
        "--use_lora",
        "--set",
        f"data.cache_dir={cache}",
        "--set",
        "data.log_reads=true",
        "--set",
        "checkpoint.keep_last=10",
    ]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    work = tmp_path_factory.mktemp("tts_job")
    sys.path.insert(0, str(EXAMPLE))
    try:
        from prepare import main as prepare
    finally:
        sys.path.remove(str(EXAMPLE))
    prepare(work)
    env = {**os.environ, "HF_HUB_CACHE": str(work / "hf-cache"), "PYTHONUNBUFFERED": "1"}
    return work, env


def _run(cmd: list[str], work: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _reads(run: Path) -> list[str]:
    return [
        line for f in sorted((run / "reads").glob("rank*.txt")) for line in f.read_text().split()
    ]


def _final_adapters(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(resume_order(run)[0][0]).tensors


def test_the_team_command_trains_resumes_exactly_and_speaks(job):
    work, env = job
    cache = work / "codes"
    straight, broken = work / "straight", work / "broken"
    _run(_team_command(straight, cache), work, env)
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r and r.get("split", "train") == "train"]
    assert len(losses) == 9 and losses[-1] < 0.5 * losses[0], losses  # 36 steps, logged every 4
    tensors = _final_adapters(straight)
    assert tensors and all("lora_" in name for name in tensors)  # the adapters, not the 3B base
    reads = _reads(straight)
    # each of the 48 wavs decoded once, by one of the two ranks
    assert len(reads) == len(set(reads)) == 48
    # both ranks took a share
    assert all((straight / "reads" / f"rank{r}.txt").read_text() for r in (0, 1))

    # the same job resumed mid-epoch (12 steps an epoch, checkpoints every 5) from the first run's checkpoint
    # of step 30, alone in a run dir of its own: the same adapters at the end
    resumed_at = 30
    first = straight / "checkpoints" / f"step_{resumed_at:08d}"
    shutil.copytree(first, broken / "checkpoints" / first.name)
    (broken / "checkpoints" / "latest").write_text(first.name + "\n")
    # mid-epoch: the third epoch's 6th step done, its 4 samples each
    cursor = json.loads((first / "state.json").read_text())["cursor"]
    assert cursor == {"epoch": 2, "offset": 24}, cursor
    resumed = _run(_team_command(broken, cache), work, env)
    assert f"step_{resumed_at:08d}" in resumed.stderr + (broken / "logs" / "rank0.log").read_text()
    a, b = tensors, _final_adapters(broken)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resume was not exact"
    # every code came from the cache the first run wrote: no decode at all
    assert _reads(broken) == []

    out = work / "hello.wav"
    text = "the quick brown fox jumps over the lazy dog"
    run_lockstep(
        "sample",
        str(straight),
        "--text",
        text,
        "--out",
        str(out),
        env={"HF_HUB_CACHE": env["HF_HUB_CACHE"]},
    )
    info = sf.info(out)
    assert info.samplerate == 24000 and 0 < info.duration <= 1.5 * len(text) / 15 + 0.5 + 0.4
