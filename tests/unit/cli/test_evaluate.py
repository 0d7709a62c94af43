"""`lockstep evaluate`'s arguments (lockstep/cli/evaluate.py): their defaults, the total and --show N utterances on
stdout, and a model that transcribes nothing refused in one line. The scoring itself:
tests/unit/tools/test_evaluate.py."""

from __future__ import annotations

import json

import pytest
from conftest import run_main

from lockstep.cli import build_parser

pytest.importorskip("jiwer")


def test_defaults_and_values():
    parser, _ = build_parser()
    args = parser.parse_args(["evaluate", "runs/a"])
    assert (
        args.checkpoint,
        args.data,
        args.show,
        args.limit,
        args.batch_size,
        args.no_normalize,
        args.output,
        args.device,
    ) == ("runs/a", None, 0, None, 8, False, None, "auto")
    args = parser.parse_args(
        [
            "evaluate",
            "runs/a",
            "--data",
            "m.csv",
            "--show",
            "3",
            "--limit",
            "10",
            "--batch-size",
            "2",
            "--no-normalize",
            "-o",
            "w.json",
            "--device",
            "cpu",
        ]
    )
    assert (
        args.data,
        args.show,
        args.limit,
        args.batch_size,
        args.no_normalize,
        args.output,
        args.device,
    ) == ("m.csv", 3, 10, 2, True, "w.json", "cpu")


def test_prints_the_total_and_the_utterances_asked_for(tmp_path, capsys, tiny_whisper, tiny_llama):
    from ..tools.hf_saved import write_manifest, write_wav

    whisper = tiny_whisper  # read only: -o puts wer.json in tmp_path
    wavs = [write_wav(tmp_path / f"u{i}.wav", 300.0 * (i + 1)) for i in range(3)]
    manifest = write_manifest(
        tmp_path / "m.jsonl", [(w.name, f"Word {i}") for i, w in enumerate(wavs)]
    )
    code, out, err = run_main(
        capsys,
        "evaluate",
        whisper,
        "--data",
        manifest,
        "--show",
        "2",
        "--device",
        "cpu",
        "-o",
        tmp_path / "wer.json",
    )
    assert code == 0, err
    saved = json.loads((tmp_path / "wer.json").read_text())
    lines = out.splitlines()
    assert (
        lines[0] == f"u0.wav  WER {100 * saved['utterances'][0]['wer']:.0f}%"
        and lines[1] == "  REF: Word 0"
    )
    # 2 utterances of 3 lines, the total, where it went
    assert lines[3].startswith("u1.wav") and len(lines) == 8
    assert lines[-2].startswith(f"WER {100 * saved['wer']:.2f}% (") and lines[-2].endswith(
        f"on 3 utterances of {manifest}"
    )
    assert lines[-1] == f"wrote {tmp_path / 'wer.json'}"
    llama = tiny_llama
    code, out, err = run_main(capsys, "evaluate", llama, "--data", manifest)
    assert (
        (code, out) == (2, "")
        and err.startswith(
            "lockstep evaluate: error: lockstep evaluate scores speech-to-text models"
        )
        and len(err.splitlines()) == 1
    )
