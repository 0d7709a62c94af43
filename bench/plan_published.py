"""`lockstep plan` against published GPU figures: torchtitan's Llama 3 8B runs (FSDP2, bf16, context
8,192), each planned from the model's config.json as a user would plan it.

    python bench/plan_published.py            # every case; rewrites its BENCHMARKS.md section
    python bench/plan_published.py --quick    # a 2-layer Llama's plan only; prints, writes nothing

The published numbers (pytorch/torchtitan, docs/performance.md, read 27 Nov 2026):

- Llama 3.1 8B on 8 H100 (96 GB HBM2e at their 500 W power limit; Grand Teton hosts), FSDP, local
  batch 2, selective activation checkpointing, no torch.compile: 5,762 tokens/s per GPU, 82.4 GiB;
- Llama 3 8B on 64 A100 80GB, FSDP, local batch 1, selective (per-op) activation checkpointing:
  2,973 tokens/s per GPU, MFU 58.2%.

lockstep's checkpointing is per block (torchtitan's "full"), so its memory with and without
checkpointing bound a selective run's from below and above; its step time counts recomputing
every block's forward (torchtitan's selective AC recomputes less). Profiles: h100-80gb and
a100-80gb (lockstep/plan/profiles.py), whose compute efficiencies come from this project's H100
run and MosaicML's published A100 runs, not from these; the H100 in torchtitan's table has 96 GB
and a 500 W cap, which no profile describes. Nothing is a threshold.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

BEGIN = (
    "<!-- plan_published:begin (written by bench/plan_published.py; edits between the markers "
    "are replaced) -->"
)
END = "<!-- plan_published:end -->"
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)
# (case, profile, world, gpus a node, micro-batch, published tokens/s a GPU, published GiB, source)
CASES = [
    ("Llama 3.1 8B, FSDP x 8, batch 2", "h100-80gb", 8, 8, 2, 5762, 82.4, "Table 1"),
    ("Llama 3 8B, FSDP x 64, batch 1", "a100-80gb", 64, 8, 1, 2973, None, "Llama 3 table"),
]


def plan_case(model_dir: Path, profile: str, world: int, gpus: int, micro: int):
    from lockstep.config import load_config
    from lockstep.plan.build import make_plan
    from lockstep.plan.profiles import load_profile

    sets = {
        "model.kind": "hf",
        "model.path": str(model_dir),
        "model.max_seq_length": 8192,
        "model.gradient_checkpointing": True,
        "data.kind": "chatml",  # not read: a plan reads the model's config alone
        "data.path": "unread.json",
        "parallel.data_parallel": "fsdp",
        "train.batch_size": world * micro,
        "train.micro_batch_size": micro,
        "train.mixed_precision": "bf16",
    }
    return make_plan(load_config(None, sets), world, gpus, load_profile(profile))


def main(argv: list[str] | None = None) -> int:
    from transformers import LlamaConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama3-8b"
        layers = 2 if args.quick else LLAMA3_8B["num_hidden_layers"]
        LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers}).save_pretrained(model_dir)
        for name, profile, world, gpus, micro, tps, gib, where in CASES[: 1 if args.quick else 2]:
            plan = plan_case(model_dir, profile, world, gpus, micro)
            e = plan.estimate
            per_gpu = e.tokens_per_s / world
            without = plan.other_checkpointing[0].peak / 2**30
            memory = f"{gib:.1f}" if gib else "not given"
            rows.append(
                f"| {name} on {profile} | {tps:,} | {per_gpu:,.0f} ({per_gpu / tps:.2f}x) | "
                f"{e.mfu:.1%} | {memory} | {plan.peak / 2**30:.1f} / {without:.1f} | {where} |"
            )
            print(rows[-1], flush=True)
    if args.quick:
        return 0
    from bench_train import emit_section, machine_info

    m = machine_info()
    text = "\n".join(
        [
            BEGIN,
            "## `lockstep plan` against published GPU figures (torchtitan's Llama 3 8B)",
            "",
            f"{m['date']}, lockstep {m['commit']}, planned on {m['cpu']}, torch {m['torch']}.",
            "",
            "Command: `python bench/plan_published.py`. Context 8,192, bf16 autocast over float32",
            "parameters, FSDP2, activation checkpointing per block; the published figures are",
            "pytorch/torchtitan's docs/performance.md (the docstring says which runs).",
            "",
            "| run | published tokens/s a GPU | planned (ratio) | planned MFU | published GiB "
            "| planned GiB, with / without checkpointing | torchtitan's table |",
            "|---|---|---|---|---|---|---|",
            *rows,
            END,
        ]
    )
    emit_section(text, str(ROOT / "BENCHMARKS.md"), BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
