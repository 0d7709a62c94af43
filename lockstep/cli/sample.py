"""Sample from a trained model: text from a GPT or an HF LM, a transcript of --audio, speech of --text.

RUN_OR_CHECKPOINT is a run directory (its newest checkpoint that verifies), one of its checkpoints
(RUN/checkpoints/step_N), or a model directory lockstep wrote (RUN/final, `lockstep export` output). What to pass
depends on the model:

    built-in GPT, HF causal LM    --prompt TEXT (HF chat models: --chat replies to it)
    HF speech-to-text (Whisper)   --audio FILE.wav
    HF text-to-speech (Higgs)     --text TEXT [--reference VOICE.wav] [--out sample.wav]

Text is printed as the model generated it, control bytes included: whoever pipes it on
(`> out.txt`, `| xxd`) asked for the model's output; the copy of a run's final sample in its log
is escaped instead (lockstep.tools.final.printable), as a log must stay readable to grep. Speech
prints where the wav went, its length, and whether the model ended it or the length cap cut it.
"""

from __future__ import annotations

import argparse

from lockstep.tools.sample import DEFAULT_NEW_TOKENS, DEFAULT_PROMPT, DEFAULT_WAV, sample


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("--prompt", help=f"text to continue (default for the GPT: {DEFAULT_PROMPT!r})")
    p.add_argument(
        "--chat",
        action="store_true",
        help="HF chat models: reply to --prompt through the chat template",
    )
    p.add_argument(
        "--audio", metavar="FILE", help="speech-to-text models: the audio file to transcribe"
    )
    p.add_argument("--text", help="text-to-speech models: what to say")
    p.add_argument(
        "--reference",
        metavar="WAV",
        help="text-to-speech models: a recording of the voice to speak in",
    )
    p.add_argument(
        "--out",
        metavar="WAV",
        help=f"text-to-speech models: where to write the speech (default: ./{DEFAULT_WAV})",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"default: {DEFAULT_NEW_TOKENS} for text, the model's limit for transcripts",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ..."
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    print(
        sample(
            args.checkpoint,
            args.prompt,
            audio=args.audio,
            text=args.text,
            reference=args.reference,
            out=args.out,
            chat=args.chat,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            seed=args.seed,
            device=args.device,
        )
    )
    return 0
