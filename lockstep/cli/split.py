"""Split a dataset into N disjoint, reproducible parts (to train independent copies, then `lockstep merge`)."""

from __future__ import annotations

import argparse

from lockstep.tools.split import split_dataset


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "data",
        metavar="DATA",
        help="a text file, .jsonl, .csv, .tsv or .parquet file, or a folder or glob of files",
    )
    p.add_argument("--parts", type=int, required=True, metavar="N", help="number of parts")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT_DIR",
        help="directory for the parts and split.json",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the permutation (default: %(default)s)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty OUT_DIR, replacing earlier part-* files and split.json",
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    parts = split_dataset(args.data, args.parts, args.output, seed=args.seed, force=args.force)
    for part in parts:
        print(part)
    return 0
