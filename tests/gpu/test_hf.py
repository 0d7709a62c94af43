"""Hugging Face models on CUDA (issue 23, item 2h): a tiny Llama with LoRA in bf16 on ChatML, the
tiny Higgs Audio v2 text-to-speech fixture trained and speaking a wav, and the Whisper-shaped ASR
example trained and scored by WER.

Their CPU twins: tests/e2e/test_train_models.py (Llama, Whisper), tests/e2e/test_tts.py (Higgs),
each on 2 gloo processes; here one GPU, so world size 1.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import soundfile as sf
import torch
from tts import tiny_tts  # noqa: F401  (a session fixture)

from lockstep.checkpoint.open import load_checkpoint

from .runs import DEVICE, checkpoint_dir, losses, rank0_log, run_lockstep

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str, module: str):
    spec = importlib.util.spec_from_file_location(
        f"example_{name}_{module}", EXAMPLES / name / f"{module}.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# peft 0.21 on transformers 5
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_llama_trains_in_bf16_and_writes_its_adapter(tmp_path):
    from safetensors.torch import load_file

    _example("chatml_lora", "prepare").main(tmp_path)
    run = tmp_path / "run"
    config = EXAMPLES / "chatml_lora" / "config.yaml"  # LoRA, mixed precision bf16
    data = tmp_path / "data" / "train.jsonl"
    run_lockstep(
        *("train", "--config", config, "--model", tmp_path / "tiny-llama", "--data", data),
        *("--output-dir", run, "--device", DEVICE, "--set", "data.num_workers=0"),
        *"--micro-batch-size 8 --learning-rate 1e-2 --warmup-steps 10 --log-interval 10".split(),
        *"--max-steps 120 --set train.epochs=null".split(),
        timeout=400,
    )
    log = rank0_log(run)
    assert "device cuda:0" in log and "mixed precision bf16 (as set)" in log
    rows = losses(run)
    # 5.55 -> 4.90 on the CPU (ln 300 = 5.7 untrained)
    assert len(rows) == 12 and rows[-1] < rows[0] - 0.4, rows
    ckpt = load_checkpoint(checkpoint_dir(run))
    assert ckpt.tensors and all("lora_" in k for k in ckpt.tensors), sorted(ckpt.tensors)[:5]
    # autocast, not bf16 weights: the adapters train in fp32
    assert all(t.dtype == torch.float32 for t in ckpt.tensors.values())
    adapter_config = json.loads((run / "final" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 8 and adapter_config["peft_type"] == "LORA"
    adapter = load_file(run / "final" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)


def test_higgs_audio_fixture_trains_and_sample_writes_a_wav(tiny_tts, tmp_path):  # noqa: F811
    run, wav = tmp_path / "run", tmp_path / "hello.wav"
    run_lockstep(
        *("train", "--model-kind", "hf", "--model", tiny_tts.model, "--use-lora"),
        *("--set", f"model.audio_tokenizer_path={tiny_tts.codec}"),
        *("--data-kind", "chatml", "--data", tiny_tts.data),
        *("--set", f"data.cache_dir={tmp_path / 'codes'}", "--output-dir", run, "--device", DEVICE),
        *"--set data.eval_fraction=0 --set data.num_workers=0 --mixed-precision bf16".split(),
        *"--global-batch-size 2 --max-steps 40 --log-interval 4 --learning-rate 1e-2".split(),
        *"--warmup-steps 5 --peak-flops 1e12".split(),
        timeout=400,
    )
    rows = losses(run)
    # 8 clips seen 10 times: it memorises them (54.5 -> 8.8 on the CPU)
    assert len(rows) == 10 and rows[-1] < 0.5 * rows[0], rows
    assert all("lora_" in k for k in load_checkpoint(checkpoint_dir(run)).tensors)
    text = "the quick brown fox jumps over the lazy dog"
    run_lockstep("sample", run, "--text", text, "--out", wav, "--device", DEVICE, timeout=300)
    info = sf.info(wav)
    # the codec's rate; at most the cap lockstep.tools.speak sets (1.5 x the text at 15 characters a
    # second + 0.5 s), plus the codec's frames of delay
    assert info.samplerate == 24000 and 0 < info.duration <= 1.5 * len(text) / 15 + 0.5 + 0.4, info
    audio, _ = sf.read(wav)
    assert torch.isfinite(torch.as_tensor(audio)).all() and abs(audio).max() > 0


def test_whisper_on_parquet_trains_and_evaluate_reports_wer(tmp_path):
    _example("asr_parquet", "prepare").main(tmp_path)  # 96 utterances in 4 manifests of 24
    run, manifests = tmp_path / "run", tmp_path / "manifests"
    config = EXAMPLES / "asr_parquet" / "config.yaml"  # 3 of the 4 manifests, 30 epochs, fp32
    run_lockstep(
        *("train", "--config", config, "--model", tmp_path / "tiny-whisper", "--data", manifests),
        *("--output-dir", run, "--device", DEVICE),
        timeout=400,
    )
    rows = losses(run)
    assert rows[-1] < rows[0] - 0.5, rows
    assert "device cuda:0" in rank0_log(run)
    # the end of training scored its eval split
    final = json.loads((run / "eval" / "final_wer.json").read_text())
    assert 0 <= final["wer"] <= 1
    held_out = manifests / "part-3.parquet"
    proc = run_lockstep("evaluate", run, "--data", held_out, "--device", DEVICE, timeout=300)
    saved = json.loads((run / "eval" / "wer.json").read_text())
    total = proc.stdout.strip().splitlines()[-2]
    pattern = rf"WER {100 * saved['wer']:.2f}% \(.*\), CER .* on 24 utterances of .*part-3\.parquet"
    assert re.fullmatch(pattern, total), total
    assert len(saved["utterances"]) == 24
    # the tones of the 4th manifest were never heard, but their words are the same five: a trained
    # model gets most of them (6.67% on 2 CPU processes, README), an untrained one none
    assert saved["wer"] < 0.5, saved["wer"]
