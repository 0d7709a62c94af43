"""The config fields' comments, read from lockstep/config/__init__.py as each key's one-line meaning."""

from __future__ import annotations

from lockstep.config import Config, all_keys
from lockstep.config.field_help import field_comments, field_default, field_help


def test_the_comment_beside_a_field_is_its_help():
    assert field_help("optim.learning_rate") == "peak learning rate at the reference batch size"
    assert field_help("train.batch_size") == (
        "global batch in samples per optimizer step; None = world x micro x accum"
    )
    assert field_help("no.such") == ""


def test_a_comment_block_above_a_field_counts_and_the_previous_fields_comment_does_not():
    assert field_help("model.task") == "hf: which Auto class loads model.path"
    assert field_help("parallel.find_unused_parameters").startswith(
        "a step may leave parameters without a gradient (DDP find_unused_parameters"
    )
    # model.kind's comment belongs to model.kind
    assert "built-in GPT" not in field_help("model.task")


def test_every_config_key_has_a_comment():
    keys = all_keys(Config())
    assert set(field_comments()) == set(keys)
    assert [k for k in keys if len(field_help(k)) < 8] == []


def test_defaults_come_from_a_fresh_config():
    assert field_default("train.batch_size") == 32 and field_default("train.grad_accum") is None
