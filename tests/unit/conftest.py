"""What the unit tests share: the tiny Hugging Face models of lockstep.tools.tiny, each built once
per session (a test that writes into a model directory takes a copy: shutil.copytree), a 2-step LoRA
run of the tiny Higgs text-to-speech model, and torch's thread count put back after a test that
changes it."""

from __future__ import annotations

from pathlib import Path

import pytest

# defined here, not imported by each module: a session fixture imported into a module is built once
# per module that imports it
from tts import TinyTTS, tiny_tts  # noqa: F401


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def _shared(path: Path):
    """Hand `path` to the session's tests; at the end, fail if one of them changed what is in it."""
    before = _files(path)
    yield path
    assert _files(path) == before, (
        f"a test wrote into the shared {path}: give it a copy (shutil.copytree)"
    )


@pytest.fixture
def restore_torch_threads():
    """torch's intra-op thread count as before the test: init_runtime(..., environ={}) sets it to
    the core count (lockstep.runtime.device.init_cpu_host), else for the rest of the process."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """save_tiny_llama's default model (a ChatML chat template): read it, do not write into it."""
    from lockstep.tools.tiny import save_tiny_llama

    yield from _shared(save_tiny_llama(tmp_path_factory.mktemp("tiny_llama") / "llama"))


@pytest.fixture(scope="session")
def tiny_whisper(tmp_path_factory) -> Path:
    """save_tiny_whisper's default model: read it, do not write into it."""
    from lockstep.tools.tiny import save_tiny_whisper

    yield from _shared(save_tiny_whisper(tmp_path_factory.mktemp("tiny_whisper") / "whisper"))


@pytest.fixture(scope="session")
def tts_run(tiny_tts: TinyTTS, tmp_path_factory) -> Path:  # noqa: F811
    """`lockstep train` in this process, 2 steps of LoRA on the tiny Higgs: the run directory, with
    RUN/checkpoints/step_00000002 and RUN/final."""
    from lockstep.cli import main
    from unit.train.tiny import drop_log_handlers

    run = tmp_path_factory.mktemp("tts_run") / "run"
    # fmt: off
    argv = ["train", "--model-kind", "hf", "--model", str(tiny_tts.model), "--use-lora",
            "--set", f"model.audio_tokenizer_path={tiny_tts.codec}", "--data-kind", "chatml",
            "--data", str(tiny_tts.data), "--global-batch-size", "4", "--max-steps", "2",
            "--save-interval", "2", "--eval-fraction", "0", "--eval-interval", "0",
            "--output-dir", str(run), "--set", f"data.cache_dir={run.parent / 'cache'}",
            "--world-size", "1"]
    # fmt: on
    try:
        code = main(argv)
    finally:
        drop_log_handlers()  # the run's log handlers: later tests' logging must not reach them
    assert code == 0
    assert (run / "checkpoints" / "step_00000002").is_dir() and (run / "final").is_dir()
    return run
