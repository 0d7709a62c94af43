"""Write a checkpoint as files other tools load: safetensors, or a from_pretrained directory for hf models."""

from __future__ import annotations

import argparse

from lockstep.tools.export import export_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN_DIR")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write")
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="hf + LoRA: merge the adapters into the base weights (default: the adapter alone)",
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    out = export_checkpoint(args.checkpoint, args.output, merge_lora=args.merge_lora)
    print(f"wrote {out}")
    return 0
