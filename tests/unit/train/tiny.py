"""A tiny GPT run's config, its Trainee and Batches as the run builds them, and run_training in this process
without leaving its log handlers behind (helpers, no tests)."""

from __future__ import annotations

import logging
from pathlib import Path

from lockstep.config import Config, load_config
from lockstep.rank_logs import LOGGER_NAME


def tiny_config(run: Path, corpus: Path, token_cache: Path, **overrides) -> Config:
    """conftest.TINY as a Config: one CPU process, fp32, 8 windows of 32 bytes a step, 3 steps, no
    pictures at the end."""
    return load_config(
        None,
        {
            "model.hidden_size": 32,
            "model.attention_heads": 2,
            "model.layers": 2,
            "model.max_seq_length": 32,
            "data.path": str(corpus),
            "data.cache_dir": str(token_cache),
            "data.num_workers": 0,
            "train.batch_size": 8,
            "train.max_steps": 3,
            "train.log_interval": 1,
            "train.eval_batches": 2,
            "train.sample_tokens": 0,
            "train.peak_flops": 1e12,
            "train.plots": False,
            "train.mixed_precision": "no",
            "distributed.device": "cpu",
            "checkpoint.output_dir": str(run),
            **overrides,
        },
    )


def drop_log_handlers() -> None:
    """init_rank_logging's handlers (the run's log file, the console): a later test's logging must not reach them."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if getattr(h, "_lockstep", False)]:
        logger.removeHandler(handler)
        handler.close()


def train(cfg: Config):
    """run_training(cfg) on this one process, as `lockstep train` without --world-size runs it."""
    from lockstep.train.run import run_training

    try:
        return run_training(cfg)
    finally:
        drop_log_handlers()


def build_run(cfg: Config, rt=None):
    """(Trainee, Batches from the start) of `cfg`, built as lockstep.train.run builds them (no resume, no DDP)."""
    from conftest import one_process

    from lockstep.data.sampler import Cursor
    from lockstep.train.setup import build_batches, build_layout_and_workload, build_trainee

    rt = rt or one_process()
    log = logging.getLogger("test.train")
    layout, plan, wl = build_layout_and_workload(cfg, rt, log)
    trainee = build_trainee(cfg, rt, wl, layout, plan)
    return trainee, build_batches(cfg, trainee, Cursor(), 0)
