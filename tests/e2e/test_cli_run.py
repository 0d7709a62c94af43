"""The train / sample / verify commands on real runs: BPE, sampling, profiling, epochs, Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import torch
from conftest import TINY, run_lockstep
from lockstep_process import start_lockstep
from procs import kill_tree, wait_for

from lockstep.checkpoint.open import load_checkpoint
from lockstep.config import DataConfig
from lockstep.data.text import TokenWindows, prepare_tokens

pytestmark = pytest.mark.slow


def test_bpe_run_then_sample(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    run_lockstep(
        "train",
        "--data",
        corpus,
        "--output-dir",
        run,
        *TINY,
        "--tokenizer",
        "bpe",
        "--set",
        "data.bpe_vocab_size=320",
        "--global-batch-size",
        "8",
        "--max-steps",
        "3",
        "--set",
        f"data.cache_dir={token_cache}",
    )
    ckpt = load_checkpoint(run / "checkpoints" / "step_00000003")
    # raised from the byte default to the BPE size
    assert ckpt.state["config"]["model"]["vocab_size"] == 320
    assert json.loads(ckpt.extra["tokenizer.json"])["model"]["type"] == "BPE"
    outs = [
        run_lockstep(
            "sample", run, "--prompt", "def parse", "--max-new-tokens", "12", "--seed", "3"
        ).stdout
        for _ in range(2)
    ]
    assert (
        outs[0] == outs[1] and outs[0].startswith("def parse") and len(outs[0]) > len("def parse\n")
    )
    other = run_lockstep(
        "sample",
        run / "checkpoints" / "step_00000003",
        "--prompt",
        "def parse",
        "--max-new-tokens",
        "12",
        "--seed",
        "4",
    ).stdout
    assert other.startswith("def parse")
    # export: one consolidated safetensors file (the tied head stored once), the config and the tokenizer
    from safetensors.torch import load_file, load_model

    from lockstep.config import config_from_dict
    from lockstep.models.gpt import build_gpt

    run_lockstep("export", run, "-o", tmp_path / "export")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert len(exported) == len(ckpt.tensors) - 1  # the tied embedding / head pair is stored once
    model = build_gpt(config_from_dict(ckpt.state["config"]).model)
    load_model(model, tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(v, ckpt.tensors[k]) for k, v in model.state_dict().items())
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == ckpt.extra["tokenizer.json"]
    assert "vocab_size: 320" in (tmp_path / "export" / "config.yaml").read_text()


def test_profile_steps_write_a_trace(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    proc = run_lockstep(
        "train",
        "--data",
        corpus,
        "--output-dir",
        run,
        *TINY,
        "--global-batch-size",
        "8",
        "--max-steps",
        "5",
        "--profile-steps",
        "2:4",
        "--set",
        f"data.cache_dir={token_cache}",
    )
    trace = json.loads((run / "profile" / "rank0.steps2-4.pt.trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)
    # kineto's own "USDT: ... profiler_start/stop" lines go beside the trace, not to the console
    assert "USDT" not in proc.stdout + proc.stderr
    assert "profiler_start" in (run / "profile" / "rank0.kineto.txt").read_text()


def test_epochs_set_the_length(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    # --max-restarts (the launch group's, lockstep/cli/launch_options.py): one worker, under torch's agent
    proc = run_lockstep(
        "train",
        "--data",
        corpus,
        "--output-dir",
        run,
        *TINY,
        "--global-batch-size",
        "64",
        "--epochs",
        "1",
        "--set",
        f"data.cache_dir={token_cache}",
        "--set",
        "data.eval_fraction=0.1",
        "--max-restarts",
        "1",
    )
    assert (
        "starting 1 worker with torchrun's elastic agent, restarts on a failure: 1" in proc.stdout
    )
    state = load_checkpoint(
        run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    ).state
    windows = TokenWindows(
        prepare_tokens(DataConfig(path=str(corpus), cache_dir=str(token_cache))), 32, "train", 0.1
    )
    # one epoch of full global batches, the remainder dropped
    assert state["step"] == len(windows) // 64 > 10
    assert state["cursor"] == {"epoch": 1, "offset": 0}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_to_the_launcher_stops_every_rank_after_a_commit(tmp_path, corpus, token_cache, sig):
    """Ctrl-C in the terminal, or the SIGTERM a preempted job gets: both ranks commit, then stop."""
    run = tmp_path / "run"
    proc = start_lockstep(
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
        "5000",
        "--save-interval",
        "0",
        # a DataLoader worker per rank: it must survive the signal too
        "--set",
        "data.num_workers=1",
        "--set",
        f"data.cache_dir={token_cache}",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_for(
        lambda: (
            (run / "metrics.jsonl").exists()
            and len((run / "metrics.jsonl").read_text().splitlines()) >= 5
        ),
        180,
        "step 5",
        proc,
    )
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise
    assert proc.returncode == 128 + sig, err[-3000:]
    step = int((run / "checkpoints" / "latest").read_text().strip()[5:])
    assert 5 <= step < 5000
    said = [line for line in err.splitlines() if line.startswith("lockstep train:")]
    assert len(said) == 1 and said[0].startswith(
        f"lockstep train: stopped by signal {sig} ({signal.Signals(sig).name}); this run committed checkpoint "
        f"step_{step:08d} (step {step}, "
    ), said
    assert said[0].endswith(
        f"; to resume, run the same command again: --resume auto takes step_{step:08d} "
        f"(step {step}) and verifies its checksums before loading it"
    ), said
    for rank in (0, 1):
        assert (
            f"checkpoint committed at step {step}" in (run / "logs" / f"rank{rank}.log").read_text()
        )
    assert run_lockstep("verify", run).returncode == 0
