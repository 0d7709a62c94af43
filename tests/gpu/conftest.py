"""The GPU tier (`pytest -m gpu`): every test collected under tests/gpu/ is marked `gpu` and, on a
machine without CUDA, skipped with the reason; fixtures its modules share.

The marker is added here, before pytest's own `-m` selection runs (tryfirst), so the test files need
no marks of their own and `pytest -m gpu --collect-only` lists them on any machine. What the tests
share besides fixtures (running `lockstep train` on cuda, reading a run) is in tests/gpu/runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_lockstep

HERE = Path(__file__).resolve().parent
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False)"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # a conftest's collection hook sees the whole session's items: only this folder's are ours
    cuda = torch.cuda.is_available()
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                # a skipif, evaluated before plain skips: a module's own skipif (a missing
                # library) must not hide that this machine has no GPU at all
                item.add_marker(pytest.mark.skipif(True, reason=NO_CUDA))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory, corpus, token_cache):
    """`lockstep train` as a user on a GPU machine types it: no device, precision, world size,
    backend or loader setting (the default GPT, batch 32, one loader worker), 50 steps on the test
    corpus, no peak-FLOP/s probe. Returns (the run directory, the completed process)."""
    run = tmp_path_factory.mktemp("default") / "run"
    proc = run_lockstep(
        *("train", "--data", corpus, "--output-dir", run, "--max-steps", "50"),
        *("--peak-flops", "1e12", "--set", f"data.cache_dir={token_cache}"),
        timeout=400,
    )
    return run, proc
