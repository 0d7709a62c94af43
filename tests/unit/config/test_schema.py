"""lockstep/config/schema.py: the sections of a Config, their defaults, and what is not a setting."""

from __future__ import annotations

import dataclasses

from lockstep.config import config_to_dict
from lockstep.config.schema import Config, DataConfig, ModelConfig, TrainConfig


def test_a_config_is_its_sections_and_only_they_are_settings():
    cfg = Config()
    sections = [f.name for f in dataclasses.fields(Config)]
    assert sections == ["model", "data", "optim", "train", "checkpoint", "distributed", "parallel"]
    assert list(config_to_dict(cfg)) == sections  # what state.json and --print-config hold
    assert cfg.set_keys == set() and cfg.sources == {}  # bookkeeping, never saved or compared
    cfg.set_keys.add("train.max_steps")
    assert Config() == cfg and "set_keys" not in config_to_dict(cfg)


def test_the_defaults_are_the_embedded_job():
    # the built-in GPT on the embedded corpus
    assert (ModelConfig().kind, DataConfig().kind) == ("gpt", "text")
    assert TrainConfig().mixed_precision == "auto" and TrainConfig().batch_size == 32
    sections = {f.name: f for f in dataclasses.fields(Config)}
    # no shared instances
    assert all(s.default_factory is not dataclasses.MISSING for s in sections.values())
    assert Config().model is not Config().model
