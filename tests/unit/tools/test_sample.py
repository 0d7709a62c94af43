"""lockstep/tools/sample.py: a GPT loaded from a checkpoint or a run (its newest that verifies), text generated
from it reproducibly, and the models it refuses to generate with."""

from __future__ import annotations


import pytest
import torch

from conftest import run_lockstep
from .saved import save_gpt, truncate
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import Config, ModelConfig, config_to_dict
from lockstep.errors import ConfigError
from lockstep.models.gpt import build_gpt
from lockstep.tools.sample import generate_text, load_model_from_checkpoint


def test_newest_damaged_falls_back_and_stdout_stays_the_text(tmp_path):
    run = tmp_path / "run"
    save_gpt(run, 2)
    truncate(save_gpt(run, 4))
    proc = run_lockstep("sample", str(run / "checkpoints"), "--max-new-tokens", "3", "--prompt", "ab")
    assert proc.stdout.startswith("ab") and "damaged" not in proc.stdout  # RUN/checkpoints stands for RUN
    assert "checkpoint step_00000004 is damaged" in proc.stderr and "falling back to step_00000002" in proc.stderr


def test_sample_refuses_models_it_cannot_generate_with(tmp_path):
    cfg = Config(model=ModelConfig(kind="custom", factory="mymodels:build"))
    save_checkpoint(tmp_path / "run", 1, {"w": torch.zeros(2)}, None, None, {"config": config_to_dict(cfg), "step": 1})
    with pytest.raises(ConfigError, match=r"generates with the built-in GPT, but .* holds model.kind = 'custom'; "
                                          r"write it out with `lockstep export"):
        load_model_from_checkpoint(tmp_path / "run")


def test_loads_the_model_and_generates_reproducibly(tmp_path):
    newest = save_gpt(tmp_path / "run", 4)
    save_gpt(tmp_path / "older", 2)
    model, tokenizer, ckpt = load_model_from_checkpoint(tmp_path / "run")
    assert ckpt.path == newest and not model.training
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ckpt.tensors.items())
    assert tokenizer.kind == "byte" and tokenizer.encode("ab") == [97, 98]  # no tokenizer.json: bytes

    text = generate_text(model, tokenizer, "ab", max_new_tokens=6, seed=1)
    assert text.startswith("ab") and text == generate_text(model, tokenizer, "ab", max_new_tokens=6, seed=1)
    greedy = [generate_text(model, tokenizer, "ab", max_new_tokens=6, temperature=0, seed=s) for s in (1, 2)]
    assert greedy[0] == greedy[1] and greedy[0].startswith("ab")  # argmax: the seed plays no part
    assert generate_text(model, tokenizer, "", max_new_tokens=2, temperature=0).startswith("\x00")  # id 0 starts it


def test_a_checkpoint_with_its_bpe_tokenizer(tmp_path):
    from lockstep.data.tokenizer import build_bpe_from_texts

    bpe = build_bpe_from_texts(["the quick brown fox jumps over the lazy dog. " * 50], 300)
    cfg = Config(model=ModelConfig(hidden_size=32, attention_heads=2, layers=1, max_seq_length=16,
                                   vocab_size=bpe.vocab_size))
    save_checkpoint(tmp_path / "run", 1, build_gpt(cfg.model).state_dict(), None, None,
                    {"config": config_to_dict(cfg), "step": 1}, extra={"tokenizer.json": bpe.to_json().encode()})
    model, tokenizer, _ = load_model_from_checkpoint(tmp_path / "run")
    assert tokenizer.kind == "bpe" and tokenizer.encode("the quick fox") == bpe.encode("the quick fox")
    assert len(tokenizer.encode("the quick fox")) < len("the quick fox")  # merges learned, not bytes
    assert generate_text(model, tokenizer, "the quick", max_new_tokens=4, seed=0).startswith("the quick")
