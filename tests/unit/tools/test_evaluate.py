"""lockstep/tools/evaluate.py: WER and CER by jiwer against hand-counted cases, the text normalization, and a tiny
Whisper scored end to end on real wav files: references equal to its own transcripts score 0, changed ones
the WER their edits make; the eval split a run held out; RUN/eval/wer.json; and the inputs it refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lockstep.errors import ConfigError, DataError
from lockstep.tools.evaluate import error_rates, evaluate_wer, format_total, normalize_text

from .hf_saved import save_hf_checkpoint, whisper_cfg, write_manifest, write_wav

pytest.importorskip("jiwer")


@pytest.fixture(scope="module")
def whisper(tiny_whisper, tmp_path_factory):
    # a copy of the session's: evaluate_wer writes eval/wer.json into a model dir outside a run
    return shutil.copytree(tiny_whisper, tmp_path_factory.mktemp("whisper") / "model")


@pytest.fixture
def wavs(tmp_path):
    return [
        write_wav(tmp_path / "audio" / f"u{i}.wav", freq)
        for i, freq in enumerate((300.0, 600.0, 900.0))
    ]


def test_error_rates_count_what_a_hand_count_gives():
    # "the cat sat" -> "the cat sit": 1 substitution; "hello world" -> "hello": 1 deletion; 5 reference words
    r = error_rates(["the cat sat", "hello world"], ["the cat sit", "hello"])
    assert (r["substitutions"], r["deletions"], r["insertions"], r["words"]) == (1, 1, 0, 5)
    assert r["wer"] == pytest.approx(2 / 5)
    # characters: 1 substitution (a -> i) in 11, and " world" deleted: 6 of 11
    assert r["cer"] == pytest.approx((1 + 6) / 22)
    r = error_rates(["a b"], ["a b c d"])  # insertions count against the reference's 2 words
    assert (r["insertions"], r["wer"]) == (2, 1.0)
    assert r["cer"] == pytest.approx(4 / 3)  # " c d" inserted: 4 characters against "a b"'s 3
    assert (
        format_total({**r, "utterances": [{}]})
        == "WER 100.00% (0 sub, 0 del, 2 ins / 2 words), CER 133.33% on 1 utterances"
    )


def test_normalization_drops_case_punctuation_and_spacing():
    assert normalize_text("  Hello, World!  It's 'fine'... ") == "hello world it's fine"
    assert normalize_text("Grüße — aus Köln?") == "grüße aus köln"
    assert (
        error_rates([normalize_text("Hello, world.")], [normalize_text("hello world")])["wer"] == 0
    )


def test_references_equal_to_the_transcripts_score_zero_and_edits_score_what_they_cost(
    tmp_path, whisper, wavs
):
    rows = [(f"audio/{w.name}", "placeholder") for w in wavs]
    first = evaluate_wer(
        whisper, str(write_manifest(tmp_path / "m.jsonl", rows)), normalize=False, device="cpu"
    )
    hyps = [u["hypothesis"] for u in first["utterances"]]
    assert [u["audio"] for u in first["utterances"]] == [str(w) for w in wavs] and all(
        isinstance(h, str) for h in hyps
    )
    # a model directory outside a run: beside it
    assert first["written"] == str(whisper / "eval" / "wer.json")

    same = evaluate_wer(
        whisper,
        str(write_manifest(tmp_path / "same.jsonl", [(a, h) for (a, _), h in zip(rows, hyps)])),
        normalize=False,
        device="cpu",
    )
    assert (
        same["wer"],
        same["cer"],
        same["substitutions"],
        same["deletions"],
        same["insertions"],
    ) == (0, 0, 0, 0, 0)
    assert [u["wer"] for u in same["utterances"]] == [0, 0, 0]

    # two words the model did not say, in front of the first reference: 2 deletions
    edited = [(rows[0][0], f"extra words {hyps[0]}")] + [
        (a, h) for (a, _), h in zip(rows[1:], hyps[1:])
    ]
    got = evaluate_wer(
        whisper,
        str(write_manifest(tmp_path / "edited.jsonl", edited)),
        normalize=False,
        device="cpu",
        output=tmp_path / "out" / "wer.json",
        batch_size=2,
    )
    words = sum(len(h.split()) for h in hyps) + 2
    assert (got["deletions"], got["substitutions"], got["insertions"], got["words"]) == (
        2,
        0,
        0,
        words,
    )
    assert got["wer"] == pytest.approx(2 / words)
    saved = json.loads((tmp_path / "out" / "wer.json").read_text())
    assert (
        saved["wer"] == got["wer"]
        and saved["utterances"][0]["reference"] == f"extra words {hyps[0]}"
    )
    assert (saved["model"], saved["task"], saved["normalized"]) == (
        str(whisper),
        "speech-seq2seq",
        False,
    )
    assert evaluate_wer(whisper, str(tmp_path / "edited.jsonl"), limit=1, device="cpu")[
        "utterances"
    ][0]["audio"] == str(wavs[0])


def test_a_run_is_scored_on_the_eval_split_it_held_out(tmp_path, whisper, wavs):
    from lockstep.models.hf import build_hf_model

    manifest = write_manifest(
        tmp_path / "m.jsonl", [(f"audio/{w.name}", f"word {i}") for i, w in enumerate(wavs)]
    )
    cfg = whisper_cfg(whisper, manifest, eval_fraction=0.34)  # round(0.34 * 3) = 1: the last row
    ckpt = save_hf_checkpoint(tmp_path / "run", build_hf_model(cfg.model), cfg)
    result = evaluate_wer(tmp_path / "run", device="cpu")
    assert [u["audio"] for u in result["utterances"]] == [str(wavs[2])]
    assert result["utterances"][0]["reference"] == "word 2"
    assert result["data"] == f"{manifest} (eval split: last 1 of 3 rows)" and result[
        "model"
    ] == str(ckpt)
    assert result["written"] == str(tmp_path / "run" / "eval" / "wer.json")
    assert json.loads((tmp_path / "run" / "eval" / "wer.json").read_text())["words"] == 2
    # the run's own weights: a checkpoint whose weights differ transcribes with them
    model = build_hf_model(cfg.model)
    with torch.no_grad():
        model.proj_out.weight.mul_(-1)
    save_hf_checkpoint(tmp_path / "flipped", model, cfg)
    other = evaluate_wer(tmp_path / "flipped", device="cpu")
    assert other["utterances"][0]["hypothesis"] != result["utterances"][0]["hypothesis"]


def test_what_it_refuses(tmp_path, whisper, wavs, tiny_llama):
    llama = tiny_llama
    with pytest.raises(
        ConfigError,
        match=r"lockstep evaluate scores speech-to-text models .*; .*llama \(causal-lm, "
        r"llama\) is not one; try `lockstep sample",
    ):
        evaluate_wer(llama, "m.jsonl")
    with pytest.raises(
        ConfigError, match=r"names no audio data of its own .*; pass --data MANIFEST"
    ):
        evaluate_wer(whisper)
    manifest = write_manifest(tmp_path / "m.jsonl", [(f"audio/{w.name}", "x") for w in wavs])
    save_hf_checkpoint(
        tmp_path / "run", torch.nn.Linear(1, 1), whisper_cfg(whisper, manifest, eval_fraction=0)
    )
    with pytest.raises(
        ConfigError, match=r"the run held out no audio \(data.eval_fraction = 0.0\); pass --data"
    ):
        evaluate_wer(tmp_path / "run")
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"audio": "audio/gone.wav", "text": "x", "duration": 1.0}) + "\n")
    with pytest.raises(DataError, match=r"gone.wav does not exist; .* \(from .*missing.jsonl:1\)"):
        evaluate_wer(whisper, str(missing), device="cpu")
    with pytest.raises(ConfigError, match=r"--batch-size 0 and --limit None must be >= 1"):
        evaluate_wer(whisper, str(manifest), batch_size=0)
