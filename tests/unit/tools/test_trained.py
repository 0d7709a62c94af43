"""lockstep/tools/trained.py: what a path given to sample / evaluate holds (a run, a checkpoint, a model directory,
an adapter directory, a TTS model told apart by its config.json alone), and the models it loads: LoRA adapters,
from an adapter-only checkpoint or an adapter directory, applied (the logits are the adapted model's, not the
base's)."""

from __future__ import annotations

import json

import pytest
import torch

from lockstep.checkpoint.open import load_checkpoint
from lockstep.config import Config, ModelConfig
from lockstep.errors import CheckpointError, ConfigError
from lockstep.tools.trained import TTS_TASK, load_trained_hf, resolve_trained

from .hf_saved import lora_llama, save_hf_checkpoint, whisper_cfg
from .saved import save_gpt

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return tiny_llama  # the session's (tests/unit/conftest.py)


@pytest.fixture(scope="module")
def whisper(tiny_whisper):
    return tiny_whisper


IDS = torch.tensor([[5, 17, 40, 99, 123, 7]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_runs_checkpoints_and_model_directories(tmp_path, llama, whisper):
    save_gpt(tmp_path / "gpt", 2)
    newest = save_gpt(tmp_path / "gpt", 4)
    for path in (tmp_path / "gpt", tmp_path / "gpt" / "checkpoints", newest):
        t = resolve_trained(path)
        assert (t.path, t.cfg.model.kind, t.task, t.model_type, t.run_dir) == (
            newest,
            "gpt",
            None,
            None,
            tmp_path / "gpt",
        )
        assert t.from_checkpoint
    t = resolve_trained(llama)
    assert (t.path, t.task, t.model_type, t.hf_format, t.run_dir, t.from_checkpoint) == (
        llama,
        "causal-lm",
        "llama",
        "full",
        None,
        False,
    )
    assert t.cfg.model.kind == "hf" and t.cfg.model.path == str(llama) and not t.cfg.model.use_lora
    t = resolve_trained(whisper)
    assert (t.task, t.model_type) == ("speech-seq2seq", "whisper")
    # a whisper run: the checkpoint's config names the task; the model type comes from model.path's config.json
    ckpt = save_hf_checkpoint(tmp_path / "asr", torch.nn.Linear(1, 1), whisper_cfg(whisper))
    t = resolve_trained(tmp_path / "asr")
    assert (t.path, t.task, t.model_type, t.run_dir) == (
        ckpt,
        "speech-seq2seq",
        "whisper",
        tmp_path / "asr",
    )


def test_a_run_with_only_its_final_directory(tmp_path, llama):
    from lockstep.models.hf import load_hf_processor, save_hf_model

    model, cfg = lora_llama(llama)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # emptied by hand
    save_hf_model(model, run / "final", load_hf_processor(cfg.model))
    t = resolve_trained(run)
    assert (t.path, t.hf_format, t.run_dir, t.task) == (run / "final", "adapter", run, "causal-lm")
    # the base comes from lockstep.json
    assert t.cfg.model.path == str(llama) and t.cfg.model.use_lora
    assert resolve_trained(run / "final").run_dir == run


def test_lora_adapters_are_applied_from_a_checkpoint_and_from_an_adapter_directory(tmp_path, llama):
    from lockstep.models.hf import load_hf_processor, save_hf_model

    model, cfg = lora_llama(llama)
    want = logits(model)
    ckpt = save_hf_checkpoint(tmp_path / "run", model, cfg)
    # the adapters alone, as LoRA runs save
    assert all("lora_" in k for k in load_checkpoint(ckpt).tensors)
    base, _ = load_trained_hf(resolve_trained(llama))
    assert (want - logits(base)).abs().max() > 1e-2  # the adapters change the outputs
    for path in (
        tmp_path / "run",
        save_hf_model(model, tmp_path / "adapter", load_hf_processor(cfg.model)),
    ):
        loaded, processor = load_trained_hf(resolve_trained(path))
        # merged into one plain model
        assert not hasattr(loaded, "peft_config") and not loaded.training
        assert torch.allclose(logits(loaded), want, atol=1e-4), path
        assert processor.tokenizer.chat_template and processor.feature_extractor is None


def test_a_full_weights_checkpoint_loads_its_own_weights(tmp_path, llama):
    from lockstep.models.hf import build_hf_model

    cfg = Config(model=ModelConfig(kind="hf", path=str(llama)))
    model = build_hf_model(cfg.model)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
    save_hf_checkpoint(tmp_path / "run", model, cfg)
    loaded, _ = load_trained_hf(resolve_trained(tmp_path / "run"))
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_a_tts_model_is_known_by_its_config_alone(tmp_path):
    tts = tmp_path / "tts"
    tts.mkdir()
    # no weights: never loaded
    (tts / "config.json").write_text(json.dumps({"model_type": "higgs_audio_v2"}))
    (tts / "lockstep.json").write_text(json.dumps({"format": "full"}))
    t = resolve_trained(tts)
    assert (t.task, t.model_type, t.cfg.model.path) == (TTS_TASK, "higgs_audio_v2", str(tts))


def test_paths_that_hold_no_model(tmp_path):
    with pytest.raises(
        FileNotFoundError,
        match=r"nope does not exist; pass a run directory \(RUN\), one of its "
        r"checkpoints .* or a model directory lockstep wrote",
    ):
        resolve_trained(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(
        CheckpointError, match=r"notes.txt is a file, not a directory; pass a run directory"
    ):
        resolve_trained(tmp_path / "notes.txt")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.csv").write_text("x")
    with pytest.raises(CheckpointError, match=r"holds no checkpoint \(no manifest.json"):
        resolve_trained(tmp_path / "data")
    odd = tmp_path / "clip"
    odd.mkdir()
    (odd / "config.json").write_text(
        json.dumps({"model_type": "clip", "architectures": ["CLIPModel"]})
    )
    with pytest.raises(
        ConfigError, match=r"describes a 'clip' model \(CLIPModel\), which no lockstep task"
    ):
        resolve_trained(odd)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "lockstep.json").write_text(json.dumps({"format": "adapter", "base_model": None}))
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(
        CheckpointError, match=r"holds a LoRA adapter whose base model is not recorded"
    ):
        resolve_trained(adapter)
