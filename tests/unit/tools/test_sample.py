"""lockstep/tools/sample.py: a GPT loaded from a checkpoint or a run (its newest that verifies), text generated
from it reproducibly; Hugging Face causal LMs (a model directory, a LoRA adapter-only checkpoint: its adapters in
the text) continuing a prompt or replying through the chat template; speech-to-text models (Whisper, CTC)
transcribing a wav; text-to-speech models handed to lockstep.tools.speak; and the inputs each refuses."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import run_main

from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import Config, ModelConfig, config_to_dict
from lockstep.errors import ConfigError, DataError
from lockstep.models.gpt import build_gpt
from lockstep.tools.sample import generate_text, load_model_from_checkpoint, sample

from .saved import save_gpt, truncate


def test_newest_damaged_falls_back_and_stdout_stays_the_text(tmp_path, capsys):
    run = tmp_path / "run"
    save_gpt(run, 2)
    truncate(save_gpt(run, 4))
    # RUN/checkpoints stands for RUN
    code, out, err = run_main(
        capsys, "sample", str(run / "checkpoints"), "--max-new-tokens", "3", "--prompt", "ab"
    )
    assert code == 0 and out.startswith("ab") and "damaged" not in out, err
    assert "checkpoint step_00000004 is damaged" in err and "falling back to step_00000002" in err


def test_sample_refuses_models_it_cannot_generate_with(tmp_path):
    cfg = Config(model=ModelConfig(kind="custom", factory="mymodels:build"))
    save_checkpoint(
        tmp_path / "run",
        1,
        {"w": torch.zeros(2)},
        None,
        None,
        {"config": config_to_dict(cfg), "step": 1},
    )
    with pytest.raises(
        ConfigError,
        match=r"generates with the built-in GPT and Hugging Face models, but .* holds "
        r"model.kind = 'custom'; write it out with `lockstep export",
    ):
        sample(tmp_path / "run")
    with pytest.raises(
        ConfigError, match=r"builds the built-in GPT, but .* holds model.kind = 'custom'"
    ):
        load_model_from_checkpoint(tmp_path / "run")


def test_loads_the_model_and_generates_reproducibly(tmp_path):
    newest = save_gpt(tmp_path / "run", 4)
    save_gpt(tmp_path / "older", 2)
    model, tokenizer, ckpt = load_model_from_checkpoint(tmp_path / "run")
    assert ckpt.path == newest and not model.training
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ckpt.tensors.items())
    # no tokenizer.json: bytes
    assert tokenizer.kind == "byte" and tokenizer.encode("ab") == [97, 98]

    text = generate_text(model, tokenizer, "ab", max_new_tokens=6, seed=1)
    assert text.startswith("ab") and text == generate_text(
        model, tokenizer, "ab", max_new_tokens=6, seed=1
    )
    greedy = [
        generate_text(model, tokenizer, "ab", max_new_tokens=6, temperature=0, seed=s)
        for s in (1, 2)
    ]
    assert greedy[0] == greedy[1] and greedy[0].startswith("ab")  # argmax: the seed plays no part
    # id 0 starts it
    assert generate_text(model, tokenizer, "", max_new_tokens=2, temperature=0).startswith("\x00")


def test_a_checkpoint_with_its_bpe_tokenizer(tmp_path):
    from lockstep.data.tokenizer import build_bpe_from_texts

    bpe = build_bpe_from_texts(["the quick brown fox jumps over the lazy dog. " * 50], 300)
    cfg = Config(
        model=ModelConfig(
            hidden_size=32,
            attention_heads=2,
            layers=1,
            max_seq_length=16,
            vocab_size=bpe.vocab_size,
        )
    )
    save_checkpoint(
        tmp_path / "run",
        1,
        build_gpt(cfg.model).state_dict(),
        None,
        None,
        {"config": config_to_dict(cfg), "step": 1},
        extra={"tokenizer.json": bpe.to_json().encode()},
    )
    model, tokenizer, _ = load_model_from_checkpoint(tmp_path / "run")
    assert tokenizer.kind == "bpe" and tokenizer.encode("the quick fox") == bpe.encode(
        "the quick fox"
    )
    # merges learned, not bytes
    assert len(tokenizer.encode("the quick fox")) < len("the quick fox")
    assert generate_text(model, tokenizer, "the quick", max_new_tokens=4, seed=0).startswith(
        "the quick"
    )


def test_the_gpt_through_sample_is_generate_text(tmp_path):
    save_gpt(tmp_path / "run", 4)
    model, tokenizer, _ = load_model_from_checkpoint(tmp_path / "run")
    assert sample(tmp_path / "run", "ab", max_new_tokens=5, seed=2) == generate_text(
        model, tokenizer, "ab", 5, seed=2
    )
    assert sample(tmp_path / "run", max_new_tokens=3).startswith("def ")  # the GPT's default prompt
    with pytest.raises(
        ConfigError,
        match=r"--audio does not apply to .* \(gpt\); the built-in GPT continues --prompt",
    ):
        sample(tmp_path / "run", audio="x.wav")


# ---------------------------------------------------------------- Hugging Face causal LMs


@pytest.fixture(scope="module")
def llama(tiny_llama):
    pytest.importorskip("peft")
    return tiny_llama  # the session's (tests/unit/conftest.py)


def greedy(model, tokenizer, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, len(ids) :].tolist()


def test_a_model_directory_continues_the_prompt(llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama)
    want = greedy(
        AutoModelForCausalLM.from_pretrained(llama).eval(), tok, tok.encode("hello, how"), 8
    )
    text = sample(llama, "hello, how", max_new_tokens=8, temperature=0)
    assert text == tok.decode(tok.encode("hello, how") + want, skip_special_tokens=True)
    assert text.startswith("hello, how") and len(text) > len("hello, how")
    sampled = [sample(llama, "the quick", max_new_tokens=12, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]  # the seed picks the sample, reproducibly
    # no prompt: from the beginning-of-text token
    assert sample(llama, max_new_tokens=4, temperature=0)


def test_chat_replies_through_the_template(llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lockstep.tools.tiny import save_tiny_llama

    tok = AutoTokenizer.from_pretrained(llama)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    want = greedy(AutoModelForCausalLM.from_pretrained(llama).eval(), tok, list(prompt), 8)
    reply = sample(llama, "hello", chat=True, max_new_tokens=8, temperature=0)
    assert reply == tok.decode(want, skip_special_tokens=True)  # the reply alone, not the template
    with pytest.raises(ConfigError, match=r"--chat needs --prompt: the user message"):
        sample(llama, chat=True)
    plain = save_tiny_llama(tmp_path / "plain", chat_template=None)
    with pytest.raises(
        ConfigError, match=r"--chat needs a chat template, and this model's tokenizer has none"
    ):
        sample(plain, "hello", chat=True)


def test_a_lora_adapter_only_checkpoint_samples_with_its_adapters(tmp_path, llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .hf_saved import lora_llama, save_hf_checkpoint

    tok = AutoTokenizer.from_pretrained(llama)
    model, cfg = lora_llama(llama)
    save_hf_checkpoint(tmp_path / "run", model, cfg)
    ids = tok.encode("hello, how")
    adapted = tok.decode(ids + greedy(model, tok, ids, 10), skip_special_tokens=True)
    base = tok.decode(
        ids + greedy(AutoModelForCausalLM.from_pretrained(llama).eval(), tok, ids, 10),
        skip_special_tokens=True,
    )
    assert adapted != base  # the adapters change what is generated
    assert sample(tmp_path / "run", "hello, how", max_new_tokens=10, temperature=0) == adapted


# ---------------------------------------------------------------- speech to text


@pytest.fixture(scope="module")
def whisper(tiny_whisper):
    return tiny_whisper


def test_whisper_transcribes_a_wav(tmp_path, whisper):
    from transformers import AutoFeatureExtractor, AutoModelForSpeechSeq2Seq, AutoTokenizer

    from .hf_saved import write_wav

    wav = write_wav(tmp_path / "a.wav", 440.0)
    fe, tok = AutoFeatureExtractor.from_pretrained(whisper), AutoTokenizer.from_pretrained(whisper)
    model = AutoModelForSpeechSeq2Seq.from_pretrained(whisper).eval()
    import soundfile as sf

    feats = fe(
        sf.read(wav, dtype="float32")[0], sampling_rate=16000, return_tensors="pt"
    ).input_features
    with torch.no_grad():
        ids = model.generate(input_features=feats, max_new_tokens=10)
    want = tok.decode(ids[0], skip_special_tokens=True).strip()
    assert sample(whisper, audio=wav, max_new_tokens=10) == want
    # the model's own limit when none is given: Whisper refuses more than max_target_positions (64 here)
    assert len(sample(whisper, audio=wav)) >= len(want)
    # another rate is resampled to the extractor's 16 kHz: the same tone gives a transcript too
    assert isinstance(sample(whisper, audio=write_wav(tmp_path / "b.wav", 440.0, rate=8000)), str)


def test_a_ctc_model_transcribes_a_wav(tmp_path):
    from transformers import AutoFeatureExtractor, AutoModelForCTC, AutoTokenizer

    from .hf_saved import save_tiny_ctc, write_wav

    ctc = save_tiny_ctc(tmp_path / "ctc")
    wav = write_wav(tmp_path / "a.wav", 300.0)
    import soundfile as sf

    fe, tok = AutoFeatureExtractor.from_pretrained(ctc), AutoTokenizer.from_pretrained(ctc)
    with torch.no_grad():
        logits = (
            AutoModelForCTC.from_pretrained(ctc)
            .eval()(
                fe(
                    sf.read(wav, dtype="float32")[0], sampling_rate=16000, return_tensors="pt"
                ).input_values
            )
            .logits
        )
    want = tok.decode(
        logits.argmax(-1)[0], skip_special_tokens=True
    ).strip()  # repeats merged, blanks dropped
    assert sample(ctc, audio=wav) == want and "<pad>" not in want


def test_inputs_that_do_not_fit_the_model(tmp_path, whisper, llama):
    from .hf_saved import write_wav

    with pytest.raises(
        ConfigError, match=r"is a speech-to-text model: pass --audio FILE.wav to transcribe"
    ):
        sample(whisper)
    with pytest.raises(
        ConfigError,
        match=r"--prompt does not apply to .* \(speech-seq2seq, whisper\); a speech-to-"
        r"text model transcribes --audio FILE",
    ):
        sample(whisper, "hello", audio=write_wav(tmp_path / "a.wav", 300.0))
    with pytest.raises(
        ConfigError,
        match=r"--audio does not apply to .* \(causal-lm, llama\); a text model "
        r"continues --prompt",
    ):
        sample(llama, audio=tmp_path / "a.wav")
    with pytest.raises(ConfigError, match=r"--text does not apply to .* \(causal-lm, llama\)"):
        sample(llama, text="hello")
    with pytest.raises(DataError, match=r"nope.wav does not exist; pass a WAV"):
        sample(whisper, audio=tmp_path / "nope.wav")
    (tmp_path / "bad.wav").write_bytes(b"RIFF\x00\x00not really a wav")
    with pytest.raises(
        DataError, match=r"bad.wav cannot be decoded \(.*\); pass a WAV, FLAC or OGG file"
    ):
        sample(whisper, audio=tmp_path / "bad.wav")


# ---------------------------------------------------------------- text to speech: handed to lockstep.tools.speak


@pytest.fixture
def tts(tmp_path, monkeypatch):
    """A Higgs Audio v2 directory (config.json alone: a stand-in speaker never loads weights), and the calls the
    stand-in lockstep.tools.speak received."""
    path = tmp_path / "tts"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "higgs_audio_v2"}))
    (path / "lockstep.json").write_text(json.dumps({"format": "full"}))
    calls = []

    from lockstep.tools.speak import Spoken  # before the stand-in replaces the module

    def speak_from_checkpoint(source, cfg, text, out, reference):
        calls.append((source, cfg.model.path, text, out, reference))
        out.write_bytes(b"RIFF")
        return Spoken(out, 1.24, len(calls) == 1, 48, 1.92)  # the first call ends at end-of-speech

    monkeypatch.setitem(
        sys.modules,
        "lockstep.tools.speak",
        types.SimpleNamespace(speak_from_checkpoint=speak_from_checkpoint),
    )
    return path, calls


def test_a_tts_model_speaks_through_lockstep_tools_speak(tmp_path, tts, monkeypatch):
    from .hf_saved import write_wav

    path, calls = tts
    assert (
        sample(path, text="hi there", out=tmp_path / "hi.wav")
        == f"wrote {tmp_path / 'hi.wav'} (1.2 s, ended at end-of-speech)"
    )
    voice = write_wav(tmp_path / "voice.wav", 200.0)
    monkeypatch.chdir(tmp_path)
    assert sample(path, text="again", reference=voice) == (  # ./sample.wav by default
        "wrote sample.wav (1.2 s); stopped at the length cap of 48 frames (1.9 s) before the model "
        "emitted end-of-speech: the model may be undertrained, or the text too long for the cap"
    )
    assert calls == [
        (path, str(path), "hi there", tmp_path / "hi.wav", None),
        (path, str(path), "again", Path("sample.wav"), voice),
    ]
    with pytest.raises(ConfigError, match=r"is a text-to-speech model: pass --text 'what to say'"):
        sample(path)
    with pytest.raises(
        ConfigError,
        match=r"--audio does not apply to .* \(text-to-speech, higgs_audio_v2\); a text-"
        r"to-speech model speaks --text",
    ):
        sample(path, text="hi", audio=voice)
    with pytest.raises(DataError, match=r"--reference .*nope.wav is not a file"):
        sample(path, text="hi", reference=tmp_path / "nope.wav")
    assert len(calls) == 2
