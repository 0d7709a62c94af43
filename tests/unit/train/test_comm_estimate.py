"""The gradient all-reduce estimate (lockstep/train/comm_estimate.py) on numbers: the GPT team's 25M-parameter model
over 100 Mbit Ethernet and over 10 GB/s, the TTS team's LoRA gradient, one process, PowerSGD's bytes against a hand
count; the log lines a run prints at its start; and the probe all-reduce on a real 2-process gloo group."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from lockstep.config import ModelConfig, ParallelConfig
from lockstep.models.gpt import build_gpt
from lockstep.train.comm_estimate import (
    MiB,
    busbw_at,
    comm_notes,
    estimate_comm,
    fix_text,
    gradient_layout,
    max_powersgd_rank,
    note_link,
    probe_bus_bandwidth,
    sent_bytes,
)

ETHERNET = [(25 * MiB, 0.0125)]  # 100 Mbit/s = 12.5 MB/s
FAST = [(25 * MiB, 10.0)]


@pytest.fixture(scope="module")
def gpt25m() -> nn.Module:
    with torch.device("meta"):
        return build_gpt(ModelConfig(hidden_size=512, layers=8, attention_heads=8))


def test_the_25m_gpt_over_ethernet_needs_powersgd_and_over_10_gbps_bf16(gpt25m):
    layout = gradient_layout(gpt25m)
    params = sum(p.numel() for p in gpt25m.parameters())
    # fp32 gradients, tied head counted once
    assert 25e6 < params < 26e6 and sent_bytes(layout, "none") == 4 * params
    slow = estimate_comm(layout, 16, ETHERNET, compute_s=0.05)
    # ring all-reduce: 2(W-1)/W x bytes at the bus bandwidth
    assert slow.row("none")["comm_s"] == pytest.approx(2 * 15 / 16 * 4 * params / 12.5e6)  # ~15 s
    assert slow.row("bf16")["comm_s"] == pytest.approx(slow.row("none")["comm_s"] / 2)
    assert slow.row("none")["share"] == pytest.approx(15.25 / (15.25 + 0.05), rel=1e-3)
    # bf16 leaves 7.6 s against 0.05 s of compute
    assert slow.recommend == "powersgd" and slow.dominated
    assert "takes 305x the compute time and with bf16 still 153x the compute time" in slow.reason
    fast = estimate_comm(layout, 16, FAST, compute_s=0.05)
    assert fast.row("none")["comm_s"] == pytest.approx(2 * 15 / 16 * 4 * params / 10e9)  # 19 ms
    assert (fast.recommend, fast.dominated) == ("bf16", True)
    assert (
        fast.reason
        == "the all-reduce takes 38% of the compute time; bf16 halves it to 19% of the compute time"
    )
    # 2% of the step: keep the gradients exact
    long_steps = estimate_comm(layout, 16, FAST, compute_s=1.0)
    assert (long_steps.recommend, long_steps.dominated) == ("none", False)
    assert "under 20%" in long_steps.reason


def lora_layout(layers: int, hidden: int, kv: int, inter: int, r: int = 8) -> list:
    """peft's adapters on every linear of a Llama block: A (r, in) and B (out, r), fp32."""
    out = []
    for _ in range(layers):
        for fan_in, fan_out in (
            (hidden, hidden),
            (hidden, kv),
            (hidden, kv),
            (hidden, hidden),
            (hidden, inter),
            (hidden, inter),
            (inter, hidden),
        ):
            out += [((r, fan_in), 4), ((fan_out, r), 4)]
    return out


def test_lora_gradients():
    tiny = lora_layout(2, 64, 32, 128)  # the tiny test Llama: 64 KiB of adapters
    est = estimate_comm(tiny, 16, ETHERNET, compute_s=0.05)
    assert (est.recommend, est.dominated) == ("none", False) and "nothing to gain" in est.reason
    assert est.grad_bytes == 4 * 2 * 8 * (
        2 * (64 + 64) + 2 * (64 + 32) + 2 * (64 + 128) + (128 + 64)
    )
    # a 3B Llama (28 layers, 3072 wide, 8 KV heads of 128, MLP 8192): 12.2M adapter parameters, 49 MB
    big = lora_layout(28, 3072, 1024, 8192)
    assert sent_bytes(big, "none") == 4 * 12_156_928  # what peft builds for it on the meta device
    # r=8 thin matrices: nothing to compress at rank 4
    assert sent_bytes(big, "powersgd") == sent_bytes(big, "none")
    # InfiniBand: 4.6 ms against 200 ms
    ib = estimate_comm(big, 16, [(25 * MiB, 20.0)], compute_s=0.2)
    assert (ib.recommend, ib.dominated) == ("none", False)
    eth = estimate_comm(big, 16, ETHERNET, compute_s=0.2)
    assert eth.recommend == "bf16" and "stay uncompressed" in eth.reason


def test_one_process_has_nothing_to_gain(gpt25m):
    est = estimate_comm(gradient_layout(gpt25m), 1, [], compute_s=0.05)
    assert [r["comm_s"] for r in est.rows] == [0.0] * 4
    assert (est.recommend, est.dominated) == ("none", False) and est.reason.startswith(
        "one process"
    )


def test_powersgd_bytes_match_a_hand_count_and_torchs_rule():
    model = nn.Sequential(
        nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 4), nn.Conv2d(3, 16, 3)
    )
    layout = gradient_layout(model)
    # (32, 64) -> P 32x4 + Q 64x4 = 384; (4, 32): 36 x 4 x 2 = 288 > 128, sent whole; conv (16, 27): 43 x 4 = 172;
    # vectors whole: 32 + 32 + 32 + 4 + 16
    assert sent_bytes(layout, "powersgd", 4) == 4 * (384 + 32 + 64 + 128 + 4 + 172 + 16)
    assert sent_bytes(layout, "none") == 4 * (2048 + 32 + 64 + 128 + 4 + 432 + 16)
    assert (
        sent_bytes(layout, "bf16") == sent_bytes(layout, "fp16") == sent_bytes(layout, "none") // 2
    )
    for p in model.parameters():  # the same choice as torch's hook
        n = p.shape[0]
        m = p.numel() // n
        compressed = _should_compress(n, m, min(n, m, 4), 2)[0]
        assert compressed == (p.dim() > 1 and p.shape != (4, 32))
    assert sent_bytes(layout, "powersgd", 1) == 4 * (96 + 32 + 64 + 36 + 4 + 43 + 16)
    # lockstep refuses a rank above the smallest matrix side (4, of the (4, 32) head): the fix says so
    assert max_powersgd_rank(layout) == 4 and max_powersgd_rank([((7,), 4)]) == 0
    assert (
        fix_text("powersgd", 8, 4)
        == "--set parallel.grad_compression=powersgd --set parallel.powersgd_rank=4"
    )
    assert fix_text("powersgd", 4, 4).startswith("--set parallel.grad_compression=powersgd (and")
    with pytest.raises(ValueError, match="'int8' is not one of none, bf16, fp16, powersgd"):
        sent_bytes(layout, "int8")


def test_16_bit_gradients_gain_nothing_from_bf16():
    layout = [((4096, 4096), 2)] * 4 + [((4096,), 2)] * 4  # a bf16 model's gradients
    assert sent_bytes(layout, "bf16") == sent_bytes(layout, "none")
    est = estimate_comm(layout, 8, ETHERNET, compute_s=0.1)
    assert est.recommend == "powersgd" and "with bf16 still" not in est.reason
    thin = [((8, 4096), 2)] * 64  # nothing PowerSGD compresses either
    est = estimate_comm(thin, 8, ETHERNET, compute_s=0.1)
    assert (
        est.recommend == "none"
        and "no setting pays" in est.reason
        and "train.grad_accum" in est.reason
    )


def test_bus_bandwidth_is_read_at_the_message_size():
    table = [(16 * MiB, 1.0), (64 * MiB, 3.0), (1 * MiB, 0.5)]
    assert busbw_at(table, 32 * MiB) == pytest.approx(2.0)  # halfway in log(size)
    assert busbw_at(table, 16 * MiB) == 1.0 and busbw_at(table, 4 * MiB) == pytest.approx(0.75)
    # held at the measured ends
    assert busbw_at(table, 1024) == 0.5 and busbw_at(table, 1 << 30) == 3.0
    with pytest.raises(ValueError, match="no measured bandwidth"):
        busbw_at([], 1.0)
    # 400 MiB: 25 MiB buckets
    est = estimate_comm([((1024, 1024), 4)] * 100, 2, table, compute_s=1.0)
    assert [r["message_bytes"] for r in est.rows[:2]] == [25 * MiB, 25 * MiB // 2]
    assert est.row("bf16")["busbw_gbps"] < est.row("none")["busbw_gbps"]  # smaller messages, slower


def test_the_notes_a_run_logs_at_its_start(gpt25m):
    none, psgd = ParallelConfig(), ParallelConfig(grad_compression="powersgd")
    assert comm_notes(gpt25m, 1, math.inf, 25 * MiB, 1.0, none) is None
    # 2% of the step: nothing to say
    assert comm_notes(gpt25m, 16, 10.0, 25 * MiB, 1.0, none) is None
    # the step measured with plain all-reduce over Ethernet: 15.25 s of it are the all-reduce
    lines = comm_notes(gpt25m, 16, 0.0125, 25 * MiB, 15.3, none)
    assert len(lines) == 2 and "102 MB per step over 16 ranks at busbw 0.0125 GB/s" in lines[0]
    assert "none 15.3 s, bf16 7.63 s, powersgd " in lines[0] and "~0.05 s of compute" in lines[0]
    assert lines[1].startswith("the link dominates") and lines[1].endswith(
        "--set parallel.grad_compression=powersgd "
        "(and parallel.powersgd_rank to trade bytes "
        "for accuracy)"
    )
    fine = comm_notes(gpt25m, 16, 10.0, 25 * MiB, 1.0, psgd)
    assert "parallel.grad_compression = powersgd buys little here" in fine[1]
    assert fine[1].endswith("--set parallel.grad_compression=none keeps the gradients exact")
    # powersgd in force on Ethernet: right
    kept = comm_notes(gpt25m, 16, 0.0125, 25 * MiB, 0.3, psgd)
    assert kept[1].startswith("parallel.grad_compression = powersgd fits")
    fp16 = comm_notes(gpt25m, 16, 10.0, 25 * MiB, 0.06, ParallelConfig(grad_compression="fp16"))
    assert (
        fp16[1].startswith("parallel.grad_compression = fp16 fits: ")
        and "bf16 halves it" in fp16[1]
    )


def _probe(rt) -> dict:
    before = torch.get_rng_state()
    gbps = probe_bus_bandwidth(rt, 1 * MiB)
    return {"gbps": gbps, "rng_unchanged": torch.equal(before, torch.get_rng_state())}


def test_probe_bus_bandwidth_on_two_ranks(two_ranks):
    ranks = [rank["probe"] for rank in two_ranks]
    assert ranks[0]["gbps"] == ranks[1]["gbps"]  # the slowest rank's time, on both
    assert 0 < ranks[0]["gbps"] < 1000 and all(r["rng_unchanged"] for r in ranks)


class Lines:
    def __init__(self):
        self.lines = []

    def info(self, fmt, *args):
        self.lines.append(fmt % args)


def _note(rt, step_seconds) -> list[str]:
    torch.manual_seed(0)
    model = build_gpt(ModelConfig(hidden_size=64, layers=2, attention_heads=2, max_seq_length=32))
    log = Lines()
    note_link(rt, model, ParallelConfig(), step_seconds, log)
    return log.lines


def _probe_and_notes(rt) -> dict:
    """The probe first (it must leave the RNG as it found it), then note_link for a step of 100 s and
    of 1 us, on the same ranks."""
    return {"probe": _probe(rt), "slow": _note(rt, 100.0), "fast": _note(rt, 1e-6)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_probe_and_notes)


def test_note_link_logs_on_rank_0_what_the_probe_found(two_ranks):
    # a step of 100 s: the loopback all-reduce of 0.6 MB is nothing against it; of 1 us: it is all of the step
    slow_steps = [rank["slow"] for rank in two_ranks]
    fast_steps = [rank["fast"] for rank in two_ranks]
    assert slow_steps[1] == [] and fast_steps[1] == []  # rank 0 alone says it
    assert len(slow_steps[0]) == 1 and slow_steps[0][0].startswith("gradient all-reduce: busbw ")
    assert "parallel.grad_compression = none fits this link" in slow_steps[0][0]
    assert len(fast_steps[0]) == 2 and fast_steps[0][1].startswith("the link dominates: ")
    assert "--set parallel.grad_compression=" in fast_steps[0][1]
