"""`lockstep doctor --config` (lockstep/doctor/comm_check.py): the config's model built on the meta device (a real
tiny GPT config, a tiny Llama saved with save_pretrained, with and without LoRA) against the real build, compute
per step from FLOPs and the peak, the check and the report section fed clusters this machine does not have, and
one real 2-process run."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml
from conftest import one_process, run_lockstep

from lockstep.config import Config, DataConfig, ModelConfig, load_config
from lockstep.doctor import Report, format_report
from lockstep.doctor.comm_check import (
    ASSUMED_MFU,
    build_comm_check,
    build_meta_model,
    check_estimable,
    probe_comm_facts,
    tokens_per_step,
)
from lockstep.errors import ConfigError
from lockstep.models.gpt import build_gpt
from lockstep.train.comm_estimate import MiB, gradient_layout

GPT = {
    "model.hidden_size": 64,
    "model.attention_heads": 4,
    "model.layers": 2,
    "model.max_seq_length": 32,
    "train.batch_size": 16,
    "train.peak_flops": 1e12,
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
        )
    ).save_pretrained(path)
    return path


def test_the_gpt_on_meta_is_the_gpt_training_builds():
    cfg = load_config(None, GPT)
    meta = build_meta_model(cfg.model, cfg.data)
    real = build_gpt(cfg.model)
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert (
        gradient_layout(meta) == gradient_layout(real)
        and meta.flops_per_token() == real.flops_per_token()
    )
    # global 16 over 2 ranks, no accumulation, 32-token windows
    assert tokens_per_step(cfg, 2) == 8 * 32
    assert (
        tokens_per_step(replace(cfg, train=replace(cfg.train, micro_batch_size=2)), 2) == 4 * 2 * 32
    )
    bpe = load_config(None, {**GPT, "data.tokenizer": "bpe", "data.bpe_vocab_size": 1000})
    # the tokenizer's vocabulary
    assert build_meta_model(bpe.model, bpe.data).tok_emb.weight.shape == (1000, 64)


@pytest.mark.parametrize("lora", [False, True])
def test_a_saved_llama_on_meta_matches_the_loaded_one(llama_dir, lora):
    from lockstep.models.hf import build_hf_model, hf_flops_per_token

    cfg = load_config(
        None,
        {
            "model.kind": "hf",
            "model.path": str(llama_dir),
            "model.use_lora": lora,
            "model.dtype": "bfloat16",
            "data.kind": "chatml",
            "data.path": "x.jsonl",
        },
    )
    meta = build_meta_model(cfg.model, cfg.data)
    real = build_hf_model(cfg.model)
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    # shapes, and bf16 weights (2 bytes) or fp32 adapters
    assert gradient_layout(meta) == gradient_layout(real)
    assert hf_flops_per_token(meta) == hf_flops_per_token(real)
    sizes = {size for _, size in gradient_layout(meta)}
    assert sizes == ({4} if lora else {2})
    if lora:
        assert sum(p.numel() for p in meta.parameters() if p.requires_grad) == 2 * 8 * (
            2 * (64 + 64) + 2 * (64 + 32) + 2 * (64 + 128) + (128 + 64)
        )


def test_the_tts_teams_higgs_model_with_lora_on_meta_matches_the_loaded_one(tiny_tts):
    from lockstep.models.higgs import build_higgs_model

    m = ModelConfig(kind="hf", path=str(tiny_tts.model), use_lora=True)
    meta = build_meta_model(m, DataConfig(kind="chatml"))
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert gradient_layout(meta) == gradient_layout(build_higgs_model(m))


def test_what_the_estimate_cannot_model_is_refused_with_the_way_out():
    cfg = Config()
    check_estimable(cfg)  # the default GPT
    custom = replace(cfg, model=replace(cfg.model, kind="custom"))
    with pytest.raises(ConfigError, match="model.kind = 'custom' reports no FLOPs per token"):
        check_estimable(custom)
    audio = replace(cfg, model=replace(cfg.model, kind="hf"), data=replace(cfg.data, kind="audio"))
    with pytest.raises(ConfigError, match="data.kind = 'audio' has no fixed tokens per sample"):
        check_estimable(audio)
    fsdp = replace(cfg, parallel=replace(cfg.parallel, data_parallel="fsdp"))
    with pytest.raises(
        ConfigError, match="compresses DDP's gradient all-reduce.*data_parallel = 'fsdp'"
    ):
        check_estimable(fsdp)


def test_one_rank_facts_give_compute_from_flops_tokens_and_peak():
    cfg = load_config(None, GPT)
    facts = probe_comm_facts(one_process(), cfg)
    model = build_gpt(cfg.model)
    assert facts["trainable"] == sum(p.numel() for p in model.parameters())
    assert facts["tokens"] == 16 * 32 and facts["peak_source"] == "train.peak_flops"
    assert facts["compute_s"] == pytest.approx(
        model.flops_per_token() * 16 * 32 / (1e12 * ASSUMED_MFU)
    )
    broken = load_config(
        None,
        {
            **GPT,
            "model.kind": "hf",
            "model.path": "/nonexistent/model",
            "data.kind": "chatml",
            "data.path": "x.jsonl",
        },
    )
    assert "model.path = '/nonexistent/model'" in probe_comm_facts(one_process(), broken)["error"]


def _facts(comm: dict, ranks: int = 2) -> list[dict]:
    return [
        {"rank": r, "comm": {**comm, "compute_s": comm["compute_s"] * (1 + r)}}
        for r in range(ranks)
    ]


BIG = {
    "layout": [((4096, 4096), 4)] * 6,
    "trainable": 6 * 4096 * 4096,
    "flops_per_token": 6 * 6 * 4096 * 4096,
    "tokens": 4096,
    "peak_flops": 1e14,
    "peak_source": "measured bfloat16 matmul",
    "compute_s": 0.05,
}
TABLE = [{"bytes": 16 * MiB, "busbw_gbps": 0.0125}, {"bytes": 64 * MiB, "busbw_gbps": 0.0125}]


def test_a_slow_link_warns_with_the_setting_to_use():
    cfg = Config()
    check, comm = build_comm_check(_facts(BIG), TABLE, cfg)
    assert (check.name, check.status) == ("communication vs compute", "warn")
    assert (
        check.fix
        == "--set parallel.grad_compression=powersgd (and parallel.powersgd_rank to trade bytes for "
        "accuracy) for `lockstep train` / `lockstep launch`"
    )
    assert (
        "403 MB of gradients (100.66M trainable) at busbw 0.0125 GB/s (25 MiB messages)"
        in check.detail
    )
    assert comm["compute_s"] == 0.1 and "rank 1" in comm["compute"]  # the slowest rank's compute
    assert check.advice == []  # 25 MiB buckets: within the measured sizes
    short = build_comm_check(_facts(BIG), TABLE[:1], cfg)[0]  # measured up to 16 MiB only
    assert short.advice == [
        "busbw at 25 MiB messages is the largest measured size's (16 MiB): --max-size 25MiB or "
        "more measures DDP's buckets themselves"
    ]
    assert comm["settings"][0]["comm_s"] == pytest.approx(403e6 / 12.5e6, rel=1e-3)  # 2(n-1)/n = 1
    fast = [{"bytes": 64 * MiB, "busbw_gbps": 100.0}]
    assert build_comm_check(_facts(BIG), fast, cfg)[0].status == "ok"  # 4 ms against 100 ms
    already = replace(cfg, parallel=replace(cfg.parallel, grad_compression="powersgd"))
    check, _ = build_comm_check(_facts(BIG), TABLE, already)
    assert check.status == "ok" and check.detail.endswith("powersgd is set")
    wasted = build_comm_check(_facts(BIG), fast, already)[0]
    assert wasted.status == "ok" and "buys little" in wasted.advice[0]


def test_one_rank_a_failed_rank_and_the_report_section():
    cfg = Config()
    one, comm = build_comm_check(_facts(BIG, 1), [], cfg)
    assert one.status == "ok" and one.detail.startswith(
        "one process: there is no gradient all-reduce"
    )
    bad = _facts(BIG) + [
        {"rank": 2, "comm": {"error": "model.path = 'x' is not a local directory"}}
    ]
    failed, none = build_comm_check(bad, TABLE, cfg)
    assert (
        failed.status == "fail" and failed.detail.startswith("rank 2: model.path") and none is None
    )
    check, comm = build_comm_check(_facts(BIG), TABLE, cfg)
    report = Report("2 ranks", [check], [], [], comm=comm).to_dict()
    assert json.loads(json.dumps(report))["comm"]["recommend"] == "powersgd"
    assert "comm" not in Report("2 ranks", [check], [], []).to_dict()  # without --config: as before
    text = format_report(
        {
            **report,
            "ranks": [
                {
                    "rank": 0,
                    "local_rank": 0,
                    "host": "a",
                    "device": "cpu",
                    "python": "3",
                    "torch": "2",
                    "lockstep": "0",
                    "cuda": "-",
                    "nccl": "-",
                }
            ],
        }
    )
    section = text.split("\ncommunication vs compute (", 1)[1].splitlines()
    assert section[0].startswith(
        "403 MB of gradients per step over 2 rank(s), DDP buckets of 25 MiB"
    )
    assert section[1].startswith("compute: 0.1 s/step = 604.0 MFLOP/token x 4,096 tokens/rank/step")
    rows = {line.split()[0]: line.split() for line in section[3:7]}
    # rank 32, the default
    assert rows["none"][1:3] == ["(set)", "403"] and rows["powersgd"][-1] == "83%"
    assert section[7].startswith("recommended: powersgd: the all-reduce takes ")
    assert section[8].startswith("  --set parallel.grad_compression=powersgd")


@pytest.mark.slow  # two doctor processes: ~15 s
def test_doctor_with_a_config_on_two_ranks(tmp_path):
    config = tmp_path / "gpt.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"hidden_size": 128, "attention_heads": 4, "layers": 2},
                "train": {"batch_size": 8},
                "data": {"cache_dir": str(tmp_path / "cache")},
            }
        )
    )
    proc = run_lockstep(
        "doctor",
        "--nproc",
        "2",
        "--config",
        config,
        "--set",
        "parallel.grad_compression=bf16",
        "--max-size",
        "32MiB",
        "--output-dir",
        tmp_path / "runs",
        "--json",
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    check = {c["name"]: c for c in report["checks"]}["communication vs compute"]
    assert check["status"] in ("ok", "warn") and "of gradients" in check["detail"]
    comm = report["comm"]
    params = sum(p.numel() for p in build_gpt(load_config(config).model).parameters())
    assert (
        comm["grad_bytes"] == 4 * params and comm["world_size"] == 2 and comm["current"] == "bf16"
    )
    assert "512 tokens/rank/step" in comm["compute"]  # global 8 over 2 ranks x 128-token windows
    assert (
        "measured bfloat16 matmul" in comm["compute"]
        or "measured float32 matmul" in comm["compute"]
    )
    assert 1e-6 < comm["compute_s"] < 10
    table = {b["bytes"]: b["busbw_gbps"] for b in report["bandwidth"]}
    for row in comm["settings"]:
        assert min(table.values()) <= row["busbw_gbps"] <= max(table.values())
        # 2(n-1)/n = 1 on 2 ranks
        assert row["comm_s"] == pytest.approx(row["bytes"] / (row["busbw_gbps"] * 1e9))
    # under one 25 MiB bucket: the whole gradient
    assert comm["settings"][0]["message_bytes"] == 4 * params
