"""`lockstep plan` against real runs of Hugging Face models on this CPU: each rank's peak memory as
the plan simulates it, as its formula estimates it, and as measured.

    python bench/bench_plan_hf.py            # every case; rewrites its BENCHMARKS.md section
    python bench/bench_plan_hf.py --quick    # the smallest case only; prints, writes nothing

The seeds' jobs are Hugging Face models (Higgs Audio v2 with LoRA, a Whisper-style ASR model, a
Llama with LoRA on ChatML), which lockstep.plan.hf_models builds from their config.json, and the
formula (lockstep.plan.formula) stands for the step wherever fake tensors cannot run it (Higgs
Audio v2). bench/bench_plan.py checks the plan on lockstep's own GPT; this checks the other path.
Each case's model is made here at random with transformers' own classes and saved, so the real run
loads it as `lockstep train` does (lockstep.models.hf.build_hf_model, or build_higgs_model), wraps
it as train does (apply_parallelism, DDP through apply_ddp) and runs three optimizer steps of
lockstep.train.step on micro-batches of the shapes the plan assumes (the plan's own batch maker).
Measured as in bench/bench_plan.py: each rank's peak resident set less its resident set before the
model is loaded, glibc returning freed blocks of 64 KiB and more; the peak is reset
(/proc/self/clear_refs) once the model is loaded, so the loader's passing copies do not count.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_plan import peak_resident, resident, write_table  # noqa: E402

BEGIN = (
    "<!-- bench_plan_hf:begin (written by bench/bench_plan_hf.py; edits between the markers are "
    "replaced) -->"
)
END = "<!-- bench_plan_hf:end -->"
LLAMA = dict(  # a 58M Llama: the Llama 3 block's shape (grouped-query attention, SwiGLU)
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
WHISPER = dict(  # whisper-tiny's shape: 39M, 30 s of audio a sample
    vocab_size=51865,
    d_model=384,
    encoder_layers=4,
    decoder_layers=4,
    encoder_attention_heads=6,
    decoder_attention_heads=6,
    encoder_ffn_dim=1536,
    decoder_ffn_dim=1536,
    num_mel_bins=80,
    max_source_positions=1500,
    max_target_positions=448,
    pad_token_id=50257,
    bos_token_id=50257,
    eos_token_id=50257,
    decoder_start_token_id=50258,
)
HIGGS = dict(  # Higgs Audio v2's LLM at the Llama's size, 8 codebooks of 1,024 codes
    {k: v for k, v in LLAMA.items() if k != "tie_word_embeddings"},
    head_dim=64,
    codebook_size=1026,
    audio_token_id=31999,
    audio_bos_token_id=31998,
    audio_delay_token_id=31997,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
LORA = {"model.use_lora": True, "model.lora_rank": 16}
CHECKPOINTED = {**LORA, "model.gradient_checkpointing": True}
HIGGS_DATA = {"data.kind": "chatml", "data.path": "unread.jsonl"}  # the path is not read
CASES = [  # (name, model, settings, data parallel, ranks)
    ("Llama 58M, LoRA r16", "llama", LORA, "ddp", 2),
    ("Llama 58M, LoRA r16, checkpointing", "llama", CHECKPOINTED, "ddp", 2),
    ("Llama 58M, full", "llama", {}, "ddp", 2),
    ("Llama 58M, full", "llama", {}, "fsdp", 2),
    ("Whisper-tiny shape, full", "whisper", {"model.task": "speech-seq2seq"}, "ddp", 2),
    ("Higgs Audio v2 58M, LoRA r16", "higgs", {**LORA, **HIGGS_DATA}, "ddp", 2),
]


def save_models(root: Path) -> dict[str, str]:
    """Each kind of model at random, saved with its weights (the real runs load them)."""
    from transformers import (
        HiggsAudioV2Config,
        HiggsAudioV2ForConditionalGeneration,
        LlamaConfig,
        LlamaForCausalLM,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    torch.manual_seed(0)
    paths = {}
    for kind, cls, config in (
        ("llama", LlamaForCausalLM, LlamaConfig(**LLAMA)),
        ("whisper", WhisperForConditionalGeneration, WhisperConfig(**WHISPER)),
        ("higgs", HiggsAudioV2ForConditionalGeneration, HiggsAudioV2Config(**HIGGS)),
    ):
        paths[kind] = str(root / kind)
        cls(config).save_pretrained(paths[kind])
    return paths


def config(path: str, settings: dict, data_parallel: str):
    from lockstep.config import load_config

    sets = {
        "model.kind": "hf",
        "model.path": path,
        "model.max_seq_length": 256,
        "parallel.data_parallel": data_parallel,
        "train.batch_size": None,
        "train.micro_batch_size": 2,
        "train.grad_accum": 2,
        "train.mixed_precision": "no",
        **settings,
    }
    return load_config(None, sets)


def _rank(rank: int, world: int, port: int, cfg, kind: str, out: str) -> None:
    from lockstep.models.hf import build_hf_model
    from lockstep.models.hf_loss import hf_loss
    from lockstep.models.higgs import build_higgs_model, higgs_forward_loss, is_higgs
    from lockstep.models.loss import Loss
    from lockstep.optim import build_optimizer
    from lockstep.parallel.apply import apply_parallelism
    from lockstep.parallel.ddp import LossModule, apply_ddp
    from lockstep.parallel.mesh import check_layout, resolve_batch
    from lockstep.plan.hf_models import fake_hf_model
    from lockstep.runtime.group import Runtime
    from lockstep.train.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    rt = Runtime(rank, rank, world, world, 0, torch.device("cpu"), "gloo", "bench", "h")
    lay = check_layout(cfg, world)
    plan = resolve_batch(cfg.train, lay.dp)
    batch = fake_hf_model(cfg).batch  # the plan's micro-batch shapes (its model is on meta)
    importlib.import_module("torch.distributed.fsdp")  # before the baseline: modules are memory

    base = resident()
    torch.manual_seed(0)
    higgs = kind == "higgs"  # lockstep.train.tts_workload's model and loss, else hf_workload's
    model = (build_higgs_model if higgs else build_hf_model)(cfg.model).train()  # as build_trainee
    assert is_higgs(model.config) == higgs
    loss = Loss(higgs_forward_loss) if higgs else hf_loss(model, cfg.model.task, False)
    apply_parallelism(
        model,
        lay,
        rt,
        cfg.parallel,
        mixed_precision="no",
        autocast=contextlib.nullcontext(),
        grad_accum=plan.grad_accum,
        uses_all_parameters=True,
    )
    wrapped = apply_ddp(model, rt, loss) if lay.data_parallel == "ddp" else LossModule(model, loss)
    optimizer = build_optimizer(model, cfg.optim, 1e-4, "cpu")
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here: the loader's copies gone
    for _ in range(3):
        batches = [batch(plan.micro_batch) for _ in range(plan.grad_accum)]
        train_step(
            wrapped,
            model,
            optimizer,
            batches,
            rt,
            grad_accum=plan.grad_accum,
            clip_norm=cfg.optim.gradient_clip_norm,
            loss=loss,
        )
    torch.save(peak_resident() - base, f"{out}.{rank}")
    dist.destroy_process_group()


def measure(cfg, kind: str, world: int) -> list[int]:
    """Each rank's peak resident growth over three optimizer steps."""
    from lockstep.runtime import free_port

    port = free_port()
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, (world, port, cfg, kind, f"{tmp}/peak"), nprocs=world, start_method="spawn"
        )
        return [torch.load(f"{tmp}/peak.{r}") for r in range(world)]


def predict(cfg, world: int) -> tuple[list, list]:
    """Each rank's RankSim simulated (or estimated, where fake tensors cannot run the step) and
    by the formula."""
    from lockstep.parallel.mesh import check_layout, resolve_batch
    from lockstep.plan.simulate import simulate_rank

    lay = check_layout(cfg, world)
    plan = resolve_batch(cfg.train, lay.dp)
    sims = [simulate_rank(cfg, lay, plan, r) for r in range(world)]
    formula = [simulate_rank(cfg, lay, plan, r, formula=True) for r in range(world)]
    return sims, formula


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = save_models(Path(tmp))
        for name, kind, settings, data_parallel, world in CASES[:1] if args.quick else CASES:
            cfg = config(paths[kind], settings, data_parallel)
            got = measure(cfg, kind, world)
            sims, formula = predict(cfg, world)
            for rank in sorted({0, world - 1}):
                sim, peak = sims[rank], got[rank]
                simulated = "estimated" if sim.estimated else f"{sim.peak / 2**20:,.1f}"
                rows.append(
                    f"| {name} | {data_parallel} | {world} | {rank} | {simulated} | "
                    f"{formula[rank].peak / 2**20:,.1f} | {peak / 2**20:,.1f} | "
                    f"{sim.peak / peak:.2f} | {formula[rank].peak / peak:.2f} |"
                )
                print(rows[-1], flush=True)
    if args.quick:
        return 0
    method = [
        "Command: `python bench/bench_plan_hf.py`. 256 tokens a sample (Whisper: 30 s of audio",
        "and 256 label tokens), micro-batch 2, 2 accumulation steps, AdamW, one thread a rank;",
        "measured: each rank's peak resident set over three steps less its resident set",
        "before the model is loaded (the docstring). Simulated: the plan's step on fake",
        'tensors ("estimated" where they cannot run it: the plan uses the formula then);',
        "formula: lockstep.plan.formula on the same shards. Ratios: predicted / measured.",
    ]
    columns = "model, data parallel, ranks, rank, simulated MiB, formula MiB, measured MiB, "
    columns += "simulated ratio, formula ratio"
    title = "`lockstep plan` against real runs of Hugging Face models (float32, CPU): memory"
    write_table(title, method, columns.split(", "), rows, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
