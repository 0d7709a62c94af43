"""Generate text from a checkpoint (or a run directory's newest good checkpoint)."""

from __future__ import annotations

import argparse

from lockstep.tools.sample import generate_text, load_model_from_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN_DIR")
    p.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    model, tokenizer, ckpt = load_model_from_checkpoint(args.checkpoint)
    text = generate_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k or None,
                         args.seed)
    print(text)
    return 0
