"""`lockstep sample`'s arguments (lockstep/cli/sample.py): the generation settings and their defaults, the options of
speech and text-to-speech models, a transcript on stdout, and a path without a checkpoint or an option the model
does not take refused in one line. Samples from trained checkpoints: tests/e2e/test_cli_run.py and
tests/unit/tools/test_sample.py."""

from __future__ import annotations

import pytest
from conftest import run_main

from lockstep.cli import build_parser


def test_defaults_and_values():
    parser, _ = build_parser()
    args = parser.parse_args(["sample", "runs/a"])
    assert (
        args.checkpoint,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
        # None: the GPT's "def ", 200 tokens; a transcript's model limit
    ) == ("runs/a", None, None, 0.8, 50, 0)
    assert (args.chat, args.audio, args.text, args.reference, args.out, args.device) == (
        False,
        None,
        None,
        None,
        None,
        "auto",
    )
    args = parser.parse_args(
        [
            "sample",
            "runs/a",
            "--text",
            "hi",
            "--reference",
            "v.wav",
            "--out",
            "o.wav",
            "--audio",
            "a.wav",
            "--chat",
            "--device",
            "cpu",
        ]
    )
    assert (args.text, args.reference, args.out, args.audio, args.chat, args.device) == (
        "hi",
        "v.wav",
        "o.wav",
        "a.wav",
        True,
        "cpu",
    )
    args = parser.parse_args(
        [
            "sample",
            "runs/a",
            "--prompt",
            "x",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
            "--top-k",
            "0",
            "--seed",
            "3",
        ]
    )
    assert (args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed) == (
        "x",
        5,
        0.0,
        0,
        3,
    )


def test_bad_values(tmp_path, capsys):
    code, out, err = run_main(capsys, "sample", "runs/a", "--temperature", "hot")
    assert code == 2 and out == "" and "argument --temperature: invalid float value: 'hot'" in err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    code, out, err = run_main(capsys, "sample", tmp_path / "run")
    assert (
        code == 1
        and out == ""
        and err
        == (
            f"lockstep sample: error: run directory {tmp_path / 'run'} holds no committed checkpoint yet "
            f"({tmp_path / 'run' / 'checkpoints'} has no step_N directory: its training saved none); pass a run directory "
            "that has checkpoints, or one of its checkpoints (RUN/checkpoints/step_N)\n"
        )
    )


def test_a_transcript_on_stdout_and_options_the_model_does_not_take(tmp_path, capsys, tiny_whisper):
    from ..tools.hf_saved import write_wav

    whisper = tiny_whisper
    wav = write_wav(tmp_path / "a.wav", 440.0)
    code, out, err = run_main(
        capsys, "sample", whisper, "--audio", wav, "--max-new-tokens", "5", "--device", "cpu"
    )
    assert code == 0 and out.endswith("\n") and len(out.splitlines()) == 1, (out, err)
    # transformers' warnings about the saved generation config are silenced
    assert "generation" not in err.lower()
    code, out, err = run_main(capsys, "sample", whisper)
    assert (code, out) == (2, "") and err == (
        f"lockstep sample: error: {whisper} (speech-seq2seq, whisper) is a "
        "speech-to-text model: pass --audio FILE.wav to transcribe\n"
    )
    code, out, err = run_main(capsys, "sample", whisper, "--audio", tmp_path / "nope.wav")
    assert (code, out) == (1, "") and "nope.wav does not exist; pass a WAV" in err


def test_a_tts_run_speaks_into_out(tmp_path, capsys, tts_run):
    # the text-to-speech branch: lockstep.tools.speak does the speaking
    pytest.importorskip("lockstep.tools.speak")
    import soundfile as sf

    run = tts_run  # `lockstep train`, 2 steps of LoRA on the tiny Higgs (tests/unit/conftest.py)
    # checkpoint, adapter dir
    for source, out in ((run, tmp_path / "a.wav"), (run / "final", tmp_path / "b.wav")):
        code, stdout, err = run_main(
            capsys, "sample", source, "--text", "hello there", "--out", out, "--device", "cpu"
        )
        seconds = sf.info(out).duration
        # 2 steps of training do not teach the model to end its speech: the cap for 11 characters
        # ends it
        assert (code, stdout) == (
            0,
            f"wrote {out} ({seconds:.1f} s); stopped at the length cap "
            "of 48 frames (1.9 s) before the model emitted end-of-speech: "
            "the model may be undertrained, or the text too long for the "
            "cap\n",
        ), err
        assert seconds > 0
    code, out, err = run_main(capsys, "sample", run, "--prompt", "hello")
    assert (
        (code, out) == (2, "")
        and "--prompt does not apply to" in err
        and "(text-to-speech, higgs_audio_v2)" in err
    )
