"""lockstep/tools/final.py: what a finished run leaves besides its checkpoints, from the TrainResult of a tiny GPT run
on one process: the sample, from the live model or (sharded runs) from the last checkpoint, the same text either
way; nothing for a run that did not finish. A speech-to-text run's WER on (the first utterances of) its eval split,
logged and written to RUN/eval/final_wer.json, and a warning instead when it cannot be computed."""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import replace

import pytest
from conftest import TINY, run_main

from lockstep.tools.final import printable, write_final_outputs
from lockstep.tools.sample import generate_text, load_model_from_checkpoint

from ..train.tiny import drop_log_handlers, tiny_config, train

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
    assert f"sample from the trained model:\n{printable(result.sample)}" in caplog.text
    # the text the checkpoint's weights generate with the run's seed: the sample is of the trained model
    model, tokenizer, _ = load_model_from_checkpoint(result.checkpoint)
    assert result.sample == generate_text(model, tokenizer, "def ", 12, seed=cfg.train.seed)
    assert listing(run) == before  # the GPT has no from_pretrained directory: nothing written


def test_printable_escapes_what_a_log_reader_cannot_see_and_keeps_lines_tabs_and_text():
    sample = (
        "def f():\n\treturn 'é 日本 🙂 \ufffd'\x00\x1b[31m\x7f\r\x0b\x85\u2028\udcff\ud800 \\x00"
    )
    assert printable(sample) == (
        "def f():\n\treturn 'é 日本 🙂 \ufffd'"
        "\\x00\\x1b[31m\\x7f\\x0d\\x0b\\x85\\u2028\\udcff\\ud800 \\x00"
    )
    # lone surrogates escaped: the log handler can write it
    assert printable(sample).encode("utf-8")
    # "\n" is the only line break left
    assert printable(sample).splitlines() == printable(sample).split("\n")
    # a tag character (a format character, invisible) beyond the BMP
    assert printable("\U000e0001x") == "\\U000e0001x"


def test_a_sample_with_nul_bytes_leaves_a_rank_log_grep_reads_as_text(
    tmp_path, corpus, token_cache, capsys
):
    """A real `lockstep train` run whose final sample holds NUL and other control bytes: the
    model is near-random (1 step at a warm-up learning rate) and samples any byte; train.seed 3
    gives NULs."""
    run = tmp_path / "run"
    code, _, err = run_main(
        capsys,
        "train",
        *TINY,
        "--data",
        corpus,
        "--set",
        f"data.cache_dir={token_cache}",
        "--global-batch-size",
        "8",
        "--max-steps",
        "1",
        "--eval-interval",
        "0",
        "--set",
        "train.sample_tokens=400",
        "--set",
        "train.seed=3",
        "--set",
        "distributed.device=cpu",
        "--mixed-precision",
        "no",
        "--output-dir",
        run,
    )
    drop_log_handlers()
    assert code == 0, err
    model, tokenizer, _ = load_model_from_checkpoint(run)
    sample = generate_text(model, tokenizer, "def ", 400, seed=3)  # what the run logged, unescaped
    assert "\x00" in sample and "\x00" not in printable(sample)
    # in a UTF-8 locale grep also calls invalid UTF-8 binary
    env = {**os.environ, "LC_ALL": "C.UTF-8"}

    def grep(*args) -> str:
        done = subprocess.run(["grep", *map(str, args)], capture_output=True, text=True, env=env)
        return done.stdout + done.stderr

    raw = tmp_path / "raw.log"
    raw.write_text(f"sample from the trained model:\n{sample}\n", encoding="utf-8")
    # the log as it was, with the sample written as it is: grep shows no line of it
    assert grep("sample", raw) == f"grep: {raw}: binary file matches\n"
    log = run / "logs" / "rank0.log"
    assert grep("sample from the trained", log).endswith(" INFO sample from the trained model:\n")
    assert int(grep("-c", "sample", log)) >= 1
    assert int(grep("-cF", "\\x00", log)) >= 1  # the escapes are greppable too
    text = log.read_text(encoding="utf-8")
    escaped = printable(sample).split("\n")
    assert all(f"[rank 0] {line}" in text for line in escaped[1:]) and escaped[0] in text


def test_a_sharded_run_samples_from_its_last_checkpoint(tmp_path, corpus, token_cache):
    cfg = tiny_config(tmp_path / "run", corpus, token_cache, **{"train.sample_tokens": 12})
    result = train(cfg)
    write_final_outputs(cfg, result, LOG)
    # a sharded run hands on no model (its parameters belonged to the group that is gone)
    sharded = replace(result, workload=replace(result.workload, model=None), sample=None)
    write_final_outputs(cfg, sharded, LOG)
    assert sharded.sample == result.sample


def test_nothing_for_a_run_that_did_not_finish_or_a_sample_of_0_tokens(
    tmp_path, corpus, token_cache
):
    run = tmp_path / "run"
    cfg = tiny_config(run, corpus, token_cache, **{"train.sample_tokens": 12})
    result = train(cfg)
    before = listing(run)
    # what run_training returns for a stopped run
    stopped = replace(result, workload=None, stop_signal=15)
    write_final_outputs(cfg, stopped, LOG)
    assert stopped.sample is None and listing(run) == before
    no_sample = replace(cfg, train=replace(cfg.train, sample_tokens=0))
    write_final_outputs(no_sample, result, LOG)
    assert result.sample is None and listing(run) == before


# ---------------------------------------------------------------- speech-to-text: the WER on the eval split


def whisper_result(tmp_path, whisper, n_eval: int):
    """A finished Whisper run's config and TrainResult (its last checkpoint the live model's weights), built by
    hand: training it would only slow the test, the WER is computed from whatever weights it ends with."""
    from lockstep.data.audio import AudioDataset, AudioRow
    from lockstep.models.hf import build_hf_model, load_hf_processor
    from lockstep.train.loop import TrainResult
    from lockstep.train.workload import Workload

    from .hf_saved import save_hf_checkpoint, whisper_cfg, write_manifest, write_wav

    wavs = [write_wav(tmp_path / "audio" / f"u{i}.wav", 200.0 + 50 * i) for i in range(n_eval)]
    manifest = write_manifest(
        tmp_path / "m.jsonl", [(f"audio/{w.name}", f"Word {i}.") for i, w in enumerate(wavs)]
    )
    cfg = whisper_cfg(whisper, manifest)
    cfg.distributed.device = "cpu"
    model, processor = build_hf_model(cfg.model), load_hf_processor(cfg.model)
    run = tmp_path / "run"
    ckpt = save_hf_checkpoint(run, model, cfg)
    rows = [
        AudioRow(str(w), f"Word {i}.", None, 0.5, f"{manifest}:{i + 1}") for i, w in enumerate(wavs)
    ]
    eval_ds = AudioDataset(rows, processor.feature_extractor, processor.tokenizer)
    wl = Workload(model=model, train_ds=eval_ds, eval_ds=eval_ds, loss=None)
    return cfg, TrainResult(run, 3, ckpt, workload=wl)


def test_a_finished_speech_run_reports_its_wer_on_the_eval_split(
    tmp_path, caplog, monkeypatch, tiny_whisper
):
    import json

    import lockstep.tools.final as final

    monkeypatch.setattr(final, "FINAL_WER_UTTERANCES", 2)  # the first 2 of 3: the cap holds
    cfg, result = whisper_result(tmp_path, tiny_whisper, 3)
    with caplog.at_level(logging.INFO, LOG.name):
        write_final_outputs(cfg, result, LOG)
    wer = json.loads((result.run_dir / "eval" / "final_wer.json").read_text())
    assert [u["reference"] for u in wer["utterances"]] == ["Word 0.", "Word 1."]
    assert wer["words"] == 4 and wer["normalized"] and wer["model"] == str(result.checkpoint)
    assert "eval split: first 2 of 3 utterances" in wer["data"]
    assert f"the trained model on the eval split: WER {100 * wer['wer']:.2f}% (" in caplog.text
    assert "on 2 utterances (eval split: first 2 of 3 utterances)" in caplog.text
    # a sharded run hands on no model: the same transcripts come from its last checkpoint
    sharded = replace(result, workload=replace(result.workload, model=None))
    (result.run_dir / "eval" / "final_wer.json").unlink()
    write_final_outputs(cfg, sharded, LOG)
    again = json.loads((result.run_dir / "eval" / "final_wer.json").read_text())
    assert [u["hypothesis"] for u in again["utterances"]] == [
        u["hypothesis"] for u in wer["utterances"]
    ]


def test_a_wer_that_cannot_be_computed_warns_and_the_run_still_ends(tmp_path, caplog, tiny_whisper):
    cfg, result = whisper_result(tmp_path, tiny_whisper, 1)
    result.workload.eval_ds.rows[0] = result.workload.eval_ds.rows[0]._replace(
        audio=str(tmp_path / "gone.wav")
    )
    with caplog.at_level(logging.INFO, LOG.name):
        write_final_outputs(cfg, result, LOG)
    assert "could not compute the WER on the eval split (DataError: audio file" in caplog.text
    assert f"run `lockstep evaluate {result.run_dir}` to retry" in caplog.text
    assert not (result.run_dir / "eval").exists()


# ---------------------------------------------------------------- a 4-bit base (QLoRA)


# peft reads transformers' deprecated is_gradient_checkpointing
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_a_qlora_run_leaves_its_adapter_and_says_what_it_was_trained_on(tmp_path, tiny_llama):
    """What a finished QLoRA run writes: the adapter (its base stays where it trained: on the GPU;
    here bitsandbytes' CPU backend stands in), with lockstep.json naming the base and its
    quantization. tests/gpu/test_qlora.py checks the same on a GPU."""
    import json

    pytest.importorskip("bitsandbytes")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lockstep.config import Config, ModelConfig
    from lockstep.models.hf import apply_training_options, auto_class, load_hf_config, save_hf_model
    from lockstep.models.quantize import load_4bit_model
    from lockstep.train.loop import TrainResult
    from lockstep.train.workload import Workload

    path = str(tiny_llama)
    cfg = Config(model=ModelConfig(kind="hf", path=path, use_lora=True, load_in_4bit=True))
    base = load_4bit_model(
        auto_class("causal-lm"),
        path,
        load_hf_config(path, path),
        torch.float32,
        torch.device("cpu"),
    )
    model = apply_training_options(base, cfg.model)
    handed = []

    def finalize(trained, out):
        handed.append(trained)
        return save_hf_model(trained, out)

    wl = Workload(model=model, train_ds=[], eval_ds=None, loss=None, finalize=finalize)
    write_final_outputs(cfg, TrainResult(tmp_path / "run", 3, None, workload=wl), LOG)
    final = tmp_path / "run" / "final"
    assert handed == [model] and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()  # the 4-bit base is not written
    info = json.loads((final / "lockstep.json").read_text())
    assert info["format"] == "adapter" and info["base_model"] == path
    assert info["base_quantization"] == "bitsandbytes nf4, double quantization (QLoRA)"
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), final)
    assert sorted(k for k in reloaded.state_dict() if "lora_" in k) == sorted(
        n for n, p in model.named_parameters() if p.requires_grad
    )
