"""`lockstep doctor --config`: the config's gradient all-reduce on this cluster's links against its compute.

Every rank builds the config's model on the meta device (shapes and dtypes, no weights, no memory) and takes
its compute per optimizer step as flops_per_token x tokens per rank per step / (its matmul peak x ASSUMED_MFU);
the all-reduce time per step comes from the doctor's bandwidth table (the model of both, and the thresholds:
lockstep.train.comm_estimate). The check uses the slowest rank's compute.

Compute is estimated, not measured with a real forward + backward: that needs the weights (GBs for a 3B model),
a device that holds them and the data, while the doctor checks a cluster in seconds. The peak is the cached
matmul peak that `lockstep train` divides by for MFU (lockstep.peak_flops), in the dtype the run computes in.
ASSUMED_MFU = 0.5: well-tuned runs reach 40-60% of that peak; a lower MFU means longer compute and a smaller
share for the link. `lockstep train` says the same at its start from a measured step (comm_notes).
Tokens per sample are model.max_seq_length: exact for the GPT's windows and packed ChatML, an upper bound for
unpacked or audio ChatML samples (more compute: the link's share is then underestimated).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from lockstep.config import Config, DataConfig, ModelConfig
from lockstep.doctor.report import Check, format_size
from lockstep.errors import ConfigError
from lockstep.runtime import Runtime
from lockstep.train.comm_estimate import (
    CommEstimate,
    MiB,
    estimate_comm,
    fix_text,
    format_bytes,
    gradient_layout,
    max_powersgd_rank,
)

NAME = "communication vs compute"
ASSUMED_MFU = 0.5
HIGGS_MODEL_TYPE = "higgs_audio_v2"


def check_estimable(cfg: Config) -> None:
    """Refuse, before any rank starts, a config whose all-reduce or compute the estimate cannot model."""
    where = "lockstep doctor --config"
    if cfg.model.kind == "custom":
        raise ConfigError(
            f"{where}: model.kind = 'custom' reports no FLOPs per token, so its compute per step is "
            "unknown; run the doctor without --config and read the gradient all-reduce note "
            "`lockstep train` logs at its start (it measures a real step)"
        )
    if cfg.model.kind == "hf" and cfg.data.kind != "chatml":
        raise ConfigError(
            f"{where}: data.kind = {cfg.data.kind!r} has no fixed tokens per sample to estimate compute "
            "from (model.max_seq_length is used for the GPT's text and ChatML); run the doctor without "
            "--config and read the note `lockstep train` logs at its start"
        )
    par = cfg.parallel
    if par.data_parallel != "ddp" or par.tensor_parallel > 1 or par.pipeline_parallel > 1:
        raise ConfigError(
            f"{where}: parallel.grad_compression compresses DDP's gradient all-reduce, and this config "
            f"trains with data_parallel = {par.data_parallel!r}, tensor_parallel = "
            f"{par.tensor_parallel}, pipeline_parallel = {par.pipeline_parallel}; the estimate covers "
            "plain DDP (ddp, 1, 1): --set those to check it"
        )


def build_meta_model(m: ModelConfig, d: DataConfig) -> nn.Module:
    """The model `lockstep train` would build from m, on the meta device (LoRA adapters included)."""
    match m.kind:
        case "gpt":
            from lockstep.models.gpt import build_gpt

            # a BPE tokenizer sets the vocabulary (lockstep.train.workload); its configured size stands in for it
            vocab = max(m.vocab_size, d.bpe_vocab_size if d.tokenizer == "bpe" else 0)
            with torch.device("meta"):
                return build_gpt(replace(m, vocab_size=vocab))
        case "hf":
            return _hf_on_meta(m)
        case _:
            raise ConfigError(
                f"model.kind = {m.kind!r}: the doctor builds 'gpt' and 'hf' models only"
            )


def _hf_on_meta(m: ModelConfig) -> nn.Module:
    from lockstep.models.hf import (
        apply_training_options,
        auto_class,
        check_task,
        load_hf_config,
        resolve_hf_path,
    )

    path, _ = resolve_hf_path(m.path)
    config = load_hf_config(path, m.path)
    dtype = getattr(torch, m.dtype)
    if getattr(config, "model_type", None) == HIGGS_MODEL_TYPE:
        from transformers import HiggsAudioV2ForConditionalGeneration as cls

        build = lambda: cls._from_config(config, dtype=dtype)  # noqa: E731
    else:
        auto = auto_class(m.task)
        check_task(config, auto, m.task, m.path)
        build = lambda: auto.from_config(config, dtype=dtype)  # noqa: E731
    with torch.device("meta"):
        # checkpointing changes no shape; peft's adapters are created on the meta device too
        return apply_training_options(build(), replace(m, gradient_checkpointing=False))


def _flops_per_token(model: nn.Module, kind: str) -> float:
    if kind == "gpt":
        return float(model.flops_per_token())
    from lockstep.models.hf import hf_flops_per_token

    return hf_flops_per_token(model)


def tokens_per_step(cfg: Config, world_size: int) -> int:
    """Tokens one rank computes per optimizer step: micro-batch x accumulation x model.max_seq_length."""
    from lockstep.parallel.mesh import resolve_batch

    plan = resolve_batch(cfg.train, world_size)
    return plan.micro_batch * plan.grad_accum * cfg.model.max_seq_length


def _peak(rt: Runtime, cfg: Config) -> tuple[float, str]:
    from lockstep.peak_flops import load_peak_flops
    from lockstep.train.step import AMP_DTYPES, resolve_mixed_precision

    precision = resolve_mixed_precision(cfg.train.mixed_precision, rt.device)[0]
    dtype = AMP_DTYPES.get(precision, torch.float32)
    if cfg.train.peak_flops:
        return cfg.train.peak_flops, "train.peak_flops"
    cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path.home() / ".cache" / "lockstep"
    return load_peak_flops(
        rt.device, dtype, cache
    ), f"measured {str(dtype).removeprefix('torch.')} matmul"


def probe_comm_facts(rt: Runtime, cfg: Config) -> dict:
    """This rank's share of the check: gradient layout, FLOPs, tokens and peak; {"error": ...} when it cannot."""
    try:
        model = build_meta_model(cfg.model, cfg.data)
        tokens = tokens_per_step(cfg, rt.world_size)
    except ConfigError as e:
        return {"error": str(e)}
    # reported in the check: a rank that raised here would leave the others waiting
    except Exception as e:
        return {
            "error": f"building {cfg.model.kind} model on the meta device failed: {type(e).__name__}: {e}"
        }
    flops = _flops_per_token(model, cfg.model.kind)
    peak, peak_source = _peak(rt, cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "layout": gradient_layout(model),
        "trainable": trainable,
        "flops_per_token": flops,
        "tokens": tokens,
        "peak_flops": peak,
        "peak_source": peak_source,
        "compute_s": flops * tokens / (peak * ASSUMED_MFU),
    }


def build_comm_check(
    facts: list[dict], bandwidth: list[dict], cfg: Config
) -> tuple[Check, dict | None]:
    """The check and the report's "comm" section from every rank's probe_comm_facts (facts[r]["comm"])."""
    bad = [f for f in facts if "error" in f["comm"]]
    if bad:
        return Check(
            NAME,
            "fail",
            f"rank {bad[0]['rank']}: {bad[0]['comm']['error']}",
            "fix the config as the message says, or run the doctor without --config",
        ), None
    par, n = cfg.parallel, len(facts)
    first = facts[0]["comm"]
    slow = max(facts, key=lambda f: f["comm"]["compute_s"])
    bucket = int(par.bucket_cap_mb * MiB)
    est = estimate_comm(
        first["layout"],
        n,
        [(b["bytes"], b["busbw_gbps"]) for b in bandwidth],
        slow["comm"]["compute_s"],
        bucket,
        par.powersgd_rank,
    )
    c = slow["comm"]
    compute = (
        f"{c['flops_per_token'] / 1e6:,.1f} MFLOP/token x {c['tokens']:,} tokens/rank/step / "
        f"({ASSUMED_MFU:.0%} of {c['peak_flops'] / 1e12:.3g} TFLOP/s, {c['peak_source']}, rank {slow['rank']})"
    )
    comm = {
        **est.to_dict(),
        "trainable": first["trainable"],
        "compute": compute,
        "current": par.grad_compression,
        "bucket_bytes": bucket,
        "fix": fix_text(est.recommend, par.powersgd_rank, max_powersgd_rank(first["layout"])),
    }
    if n == 1:
        return Check(NAME, "ok", f"{est.reason} (compute {est.compute_s:.3g} s/step)"), comm
    none = est.row("none")
    detail = (
        f"{format_bytes(est.grad_bytes)} of gradients ({first['trainable'] / 1e6:,.2f}M trainable) at busbw "
        f"{none['busbw_gbps']:.3g} GB/s ({format_size(none['message_bytes'])} messages): {none['comm_s']:.3g} s "
        f"per step uncompressed vs {est.compute_s:.3g} s compute; {est.reason}"
    )
    current = par.grad_compression
    largest, tips = max((b["bytes"] for b in bandwidth), default=0), []
    if none["message_bytes"] > largest:
        tips = [
            f"busbw at {format_size(none['message_bytes'])} messages is the largest measured size's "
            f"({format_size(largest)}): --max-size {math.ceil(none['message_bytes'] / MiB)}MiB or more "
            "measures DDP's buckets themselves"
        ]
    check = _verdict(est, current, detail, comm)
    check.advice = tips + check.advice
    return check, comm


def _verdict(est: CommEstimate, current: str, detail: str, comm: dict) -> Check:
    if est.recommend == current:
        return Check(NAME, "ok", f"{detail}; {current} is set" if current != "none" else detail)
    if est.recommend == "none":
        return Check(
            NAME,
            "ok",
            detail,
            advice=[
                f"grad_compression = {current} buys little here: "
                f"{fix_text('none')} keeps the gradients exact"
            ],
        )
    # fp16 for bf16: as good
    if est.row(current)["comm_s"] <= 1.1 * est.row(est.recommend)["comm_s"]:
        return Check(NAME, "ok", f"{detail}; {current} is set")
    return Check(NAME, "warn", detail, f"{comm['fix']} for `lockstep train` / `lockstep launch`")
