"""The train tests' shared fixture: a real checkpoint of a tiny GPT run, committed by the Checkpointer."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from conftest import one_process

from lockstep.config import config_to_dict
from lockstep.data.sampler import Cursor
from lockstep.train.checkpointer import Checkpointer
from lockstep.train.state import TrainingState

from .tiny import build_run, tiny_config

LOG = logging.getLogger("test.train.state")  # propagates to the root logger: caplog sees it


@pytest.fixture
def saved(tmp_path, corpus, token_cache):
    """(config, its Trainee, the checkpoint of step 1 that a synchronous Checkpointer committed, its state,
    torch.rand(3) drawn right after the save): one real training step first, so the optimizer and the schedule
    have state to restore."""
    cfg = tiny_config(tmp_path / "run", corpus, token_cache)
    trainee, batches = build_run(cfg)
    trainee.step(batches.next_step(), 1)
    state = TrainingState(
        step=1,
        cursor=Cursor(0, 8),
        scheduler=trainee.scheduler.state_dict(),
        config=config_to_dict(cfg),
        world_size=1,
        global_batch=8,
        tokens_seen=256,
        layout=trainee.layout.describe(),
    )
    with Checkpointer(trainee, batches, cfg, None, LOG) as checkpointer:
        assert checkpointer.state_at(1) == state  # what the loop's save of step 1 records
        checkpointer.save(1)
    return cfg, trainee, checkpointer.committed, state, torch.rand(3)


def fresh(cfg, **overrides):
    """The same run's Trainee built anew, with other initial weights (another seed)."""
    return build_run(replace(cfg, train=replace(cfg.train, **overrides)), one_process())[0]
