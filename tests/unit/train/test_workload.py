"""lockstep/train/workload.py: what build_workload makes of the model and data kinds (gpt + text with the byte and
the BPE tokenizer, custom + custom, a kind it does not know), on one process; and the settings the chosen kinds
never read."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from conftest import one_process

from lockstep.config import config_to_dict, load_config
from lockstep.errors import CheckpointError, ConfigError
from lockstep.models.gpt import GPT
from lockstep.train.workload import build_workload, unused_settings

from .tiny import tiny_config

LOG = logging.getLogger("test.train.workload")


def test_gpt_on_text_with_the_byte_tokenizer(tmp_path, corpus, token_cache):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache)
    wl = build_workload(cfg, one_process(), tmp_path / "run", LOG)
    assert isinstance(wl.model, GPT) and wl.uses_all_parameters
    assert wl.model.head.weight.shape == (256, 32) and cfg.model.vocab_size == 256
    n_train, n_eval = len(wl.train_ds), len(wl.eval_ds)
    # windows of 32 tokens; data.eval_fraction 0.02 of them held out (rounded up)
    assert n_eval == math.ceil(0.02 * (n_train + n_eval) - 1e-9) and n_train > 1000
    assert wl.describe.startswith("GPT 0.03M params (vocab 256); ") and wl.describe.endswith(
        f" tokens: {n_train} train / {n_eval} eval windows of 32"
    )
    assert wl.extra_files == {} and wl.tokenizer.kind == "byte"  # bytes need no tokenizer.json

    batch = wl.collate([wl.train_ds[i] for i in range(4)])
    x, y = batch
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    # neighbouring windows share one token: each is predicted once
    assert torch.equal(x[1, 0:1], y[0, -1:])
    assert wl.count_tokens(batch) == 4 * 32
    loss = wl.loss(wl.model, batch)
    assert not wl.loss.token_weighted  # packed windows: every micro-batch holds as many targets
    # an untrained model: about uniform
    assert loss.ndim == 0 and abs(loss.item() - math.log(256)) < 0.5
    assert wl.flops_per_token == wl.model.flops_per_token()

    # a checkpoint holds the model's own tensors, and loads back only into the same shapes
    tensors = wl.checkpoint_tensors()
    assert tensors.keys() == wl.model.state_dict().keys()
    wl.load_checkpoint_tensors(
        {k: torch.zeros_like(v) for k, v in tensors.items()}, tmp_path / "ckpt"
    )
    assert all(torch.equal(v, torch.zeros_like(v)) for v in wl.model.state_dict().values())
    bad = {**tensors, "head.weight": torch.zeros(300, 32)}
    with pytest.raises(CheckpointError, match="head.weight"):
        wl.load_checkpoint_tensors(bad, tmp_path / "ckpt")


def test_a_bpe_tokenizer_sets_the_vocabulary_and_travels_with_the_checkpoints(
    tmp_path, corpus, token_cache
):
    cfg = tiny_config(
        tmp_path / "run",
        corpus,
        token_cache,
        **{"data.tokenizer": "bpe", "data.bpe_vocab_size": 300},
    )
    wl = build_workload(cfg, one_process(), tmp_path / "run", LOG)
    assert (
        cfg.model.vocab_size == wl.tokenizer.vocab_size == 300
        and wl.model.head.weight.shape == (300, 32)
    )
    assert (
        list(wl.extra_files) == ["tokenizer.json"] and b'"BPE"' in wl.extra_files["tokenizer.json"]
    )
    assert "(vocab 300)" in wl.describe


CUSTOM = """
    import torch
    from torch import nn

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x, y):  # a dict batch comes in as keyword arguments; the output is not the loss
            return self.lin(x).squeeze(-1)

    def build_model():
        torch.manual_seed(0)
        return Regression()

    def loss(output, batch):
        return ((output - batch["y"]) ** 2).mean()

    def build_data(eval_fraction):  # the factory gets the settings it names
        g = torch.Generator().manual_seed(1)
        rows = [{"x": torch.randn(3, generator=g), "y": torch.randn((), generator=g)} for _ in range(20)]
        held_out = round(eval_fraction * len(rows))
        return rows[held_out:], rows[:held_out]
"""


def test_custom_model_on_custom_data(tmp_path, write_module):
    module = write_module(CUSTOM)
    cfg = load_config(
        None,
        {
            "model.kind": "custom",
            "model.factory": f"{module}:build_model",
            "model.loss": f"{module}:loss",
            "data.kind": "custom",
            "data.factory": f"{module}:build_data",
            "data.eval_fraction": 0.1,
        },
    )
    wl = build_workload(cfg, one_process(), tmp_path, LOG)
    assert type(wl.model).__name__ == "Regression" and not wl.uses_all_parameters
    assert (len(wl.train_ds), len(wl.eval_ds)) == (18, 2)
    assert (
        wl.describe
        == f"Regression from {module}:build_model: 0.000M params; 18 train / 2 eval samples"
    )
    # no tokens, no MFU
    assert wl.count_tokens is None and wl.flops_per_token is None and wl.extra_files == {}
    # torch's default collate: a list of dicts -> a dict
    batch = wl.collate([wl.train_ds[i] for i in range(5)])
    assert batch["x"].shape == (5, 3) and batch["y"].shape == (5,)
    # model(**batch), then the user's loss of (output, batch)
    want = (
        ((batch["x"] @ wl.model.lin.weight.T + wl.model.lin.bias).squeeze(-1) - batch["y"])
        .pow(2)
        .mean()
    )
    torch.testing.assert_close(wl.loss(wl.model, batch), want)
    assert not wl.loss.token_weighted
    assert wl.checkpoint_tensors().keys() == {"lin.weight", "lin.bias"}


def test_an_unknown_model_kind_lists_the_known_ones(tmp_path):
    cfg = load_config(None, {})
    # past the config's own check, as a caller building a Config by hand could
    cfg.model.kind = "rnn"
    with pytest.raises(
        ConfigError, match=r"model.kind = 'rnn' is not one of 'gpt', 'hf', 'custom'"
    ):
        build_workload(cfg, one_process(), tmp_path, LOG)


def test_settings_the_chosen_kinds_never_read_are_listed():
    cfg = load_config(
        None,
        {
            "model.kind": "custom",
            "model.factory": "m:f",
            "data.kind": "custom",
            "data.factory": "m:d",
            "model.hidden_size": "64",
            "data.pack": "false",
            "data.tokenizer": "bpe",
            "parallel.pipeline_schedule": "gpipe",
        },
    )
    lines = unused_settings(cfg)
    assert len(lines) == 4, lines
    assert lines[0] == (
        "model.hidden_size = 64 has no effect: model.kind 'custom' does not read it (it shapes or "
        "samples the built-in GPT); drop it, or pick the kind that uses it"
    )
    assert any(
        line.startswith("data.tokenizer = 'bpe' has no effect: data.kind 'custom'")
        for line in lines
    )
    assert any(
        line.startswith(
            "parallel.pipeline_schedule = 'gpipe' has no effect: parallel.pipeline_parallel 1"
        )
        for line in lines
    )
    # keys the kinds read are not reported, nor a value equal to the default (a full --print-config dump)
    assert (
        unused_settings(load_config(None, {"model.hidden_size": "64", "data.max_files": "2"})) == []
    )
    full = {
        f"{section}.{key}": value
        for section, values in config_to_dict(cfg).items()
        for key, value in values.items()
    }
    full["data.pack"] = True  # back to its default
    assert [line.split(" =")[0] for line in unused_settings(load_config(None, full))] == [
        "model.hidden_size",
        "data.tokenizer",
        "parallel.pipeline_schedule",
    ]


def test_a_vocabulary_past_the_tokenizer_keeps_its_size_and_warns_with_the_numbers(
    tmp_path, corpus, token_cache, caplog
):
    # SloughGPT's documented --vocab-size 50000 with the byte tokenizer (256 ids)
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **{"model.vocab_size": 50000})
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        wl = build_workload(cfg, one_process(), tmp_path / "run", LOG)
    # the user's size is kept
    assert cfg.model.vocab_size == 50000 and wl.model.head.weight.shape == (50000, 32)
    total = sum(p.numel() for p in wl.model.parameters())
    # embedding rows 256..49999 x hidden 32 (the head is the same tensor); the rest is the 0.03M
    # of the 256-token model, its 256 x 32 embedding included
    assert total == 1_591_808 + 34_688
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "model.vocab_size = 50000 but the byte tokenizer has 256 token ids: rows 256..49999 of the "
        "token embedding (tied to the output head) are never reached and hold 1,591,808 of the "
        "model's 1,626,496 parameters (97.9%); drop --vocab-size / set model.vocab_size to 256, or "
        "tokenize with data.tokenizer: bpe and data.bpe_vocab_size: 50000 to use them"
    ]


@pytest.mark.parametrize("vocab", [256, 320, 384])
def test_the_tokenizer_size_or_padding_to_a_multiple_of_64_does_not_warn(
    tmp_path, corpus, token_cache, caplog, vocab
):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **{"model.vocab_size": vocab})
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        wl = build_workload(cfg, one_process(), tmp_path / "run", LOG)
    assert wl.model.head.weight.shape == (vocab, 32)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_which_vocabulary_sizes_warn():
    from lockstep.data.tokenizer import tokenizer_from_json
    from lockstep.train.workload import unused_vocab_rows

    byte = tokenizer_from_json(None)
    # 448 is a multiple of 64 past the next multiple of 128; 300 pads to no multiple of 64
    sizes = (256, 300, 320, 384, 448, 512)
    assert [v for v in sizes if unused_vocab_rows(v, byte, 8, 10_000)] == [300, 448, 512]
