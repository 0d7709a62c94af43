"""lockstep/tools/final.py: what a finished run leaves besides its checkpoints, from the TrainResult of a tiny GPT run
on one process: the sample, from the live model or (sharded runs) from the last checkpoint, the same text either
way; nothing for a run that did not finish."""

from __future__ import annotations

import logging
from dataclasses import replace

from lockstep.tools.final import write_final_outputs
from lockstep.tools.sample import generate_text, load_model_from_checkpoint

from ..train.tiny import tiny_config, train

LOG = logging.getLogger("test.tools.final")  # propagates to the root logger: caplog sees it


def listing(run) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*"))


def test_a_finished_gpt_run_leaves_a_sample_of_its_weights(tmp_path, corpus, token_cache, caplog):
    run = tmp_path / "run"
    cfg = tiny_config(run, corpus, token_cache, **{"train.sample_tokens": 12})
    result = train(cfg)
    before = listing(run)
    with caplog.at_level(logging.INFO, LOG.name):
        write_final_outputs(cfg, result, LOG)
    assert result.sample is not None and result.sample.startswith("def ") and len(result.sample) > 4
    assert f"sample from the trained model:\n{result.sample}" in caplog.text
    # the text the checkpoint's weights generate with the run's seed: the sample is of the trained model
    model, tokenizer, _ = load_model_from_checkpoint(result.checkpoint)
    assert result.sample == generate_text(model, tokenizer, "def ", 12, seed=cfg.train.seed)
    assert listing(run) == before  # the GPT has no from_pretrained directory: nothing written


def test_a_sharded_run_samples_from_its_last_checkpoint(tmp_path, corpus, token_cache):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **{"train.sample_tokens": 12})
    result = train(cfg)
    write_final_outputs(cfg, result, LOG)
    # a sharded run hands on no model (its parameters belonged to the group that is gone)
    sharded = replace(result, workload=replace(result.workload, model=None), sample=None)
    write_final_outputs(cfg, sharded, LOG)
    assert sharded.sample == result.sample


def test_nothing_for_a_run_that_did_not_finish_or_a_sample_of_0_tokens(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    cfg = tiny_config(run, corpus, token_cache, **{"train.sample_tokens": 12})
    result = train(cfg)
    before = listing(run)
    stopped = replace(result, workload=None, stop_signal=15)  # what run_training returns for a stopped run
    write_final_outputs(cfg, stopped, LOG)
    assert stopped.sample is None and listing(run) == before
    no_sample = replace(cfg, train=replace(cfg.train, sample_tokens=0))
    write_final_outputs(no_sample, result, LOG)
    assert result.sample is None and listing(run) == before
