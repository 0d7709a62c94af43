"""Word error rate of a speech-to-text model: transcribe held-out audio and score it against its transcripts.

RUN_OR_CHECKPOINT is a run directory, one of its checkpoints, or a model directory lockstep wrote (RUN/final).
--data is a manifest as data.kind: audio reads it (.csv / .jsonl / .parquet, or a folder of them, with the run's
data.audio_column and data.text_column); without it, the eval split the run held out of its own data.path.
Writes RUN/eval/wer.json: the WER, CER, their counts, and every utterance's reference and transcript.
"""

from __future__ import annotations

import argparse

from lockstep.tools.evaluate import evaluate_wer, format_total, format_utterance


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT")
    p.add_argument(
        "--data", metavar="MANIFEST", help="held-out audio (default: the run's own eval split)"
    )
    p.add_argument(
        "--show", type=int, default=0, metavar="N", help="print the first N utterances' transcripts"
    )
    p.add_argument("--limit", type=int, metavar="N", help="score only the first N utterances")
    p.add_argument(
        "--batch-size", type=int, default=8, help="utterances per forward (default: %(default)s)"
    )
    p.add_argument(
        "--no-normalize",
        action="store_true",
        help="score the exact text (default: lower case, punctuation dropped on both sides)",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="where to write the result (default: RUN/eval/wer.json)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ..."
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    result = evaluate_wer(
        args.checkpoint,
        args.data,
        normalize=not args.no_normalize,
        batch_size=args.batch_size,
        limit=args.limit,
        output=args.output,
        device=args.device,
    )
    for utterance in result["utterances"][: max(args.show, 0)]:
        print(format_utterance(utterance))
    print(f"{format_total(result)} of {result['data']}")
    print(f"wrote {result['written']}")
    return 0
