"""parallel.grad_compression across two namespace "nodes" on a throttled link: what crosses the wire, and the losses.

Two `lockstep launch --nnodes 2` nodes, one process each, joined by a veth pair that tc tbf holds to 50 Mbit/s in
each direction. The bytes both veth ends send are sampled while the GPT trains (fp32, so a gradient is 4 bytes);
those between two logged steps are the traffic of the steps between them, which leaves out start-up (rendezvous,
DDP's parameter broadcast) and the end (eval, checkpoint). Values only, no timings: a busy machine changes the
step time, not the bytes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import netns
import pytest
from lockstep_process import run_pair

pytestmark = pytest.mark.slow

STEPS = 10
MEASURED_FROM = 4  # powersgd_start_step is 2: from step 3 on every step is compressed
# a 0.43M-parameter GPT: 1.7 MB of fp32 gradients a step, ~0.3 s over 50 Mbit/s
MODEL = "model: {hidden_size: 128, attention_heads: 4, layers: 2, max_seq_length: 64}"


def write_config(path: Path, run: Path, corpus: Path, cache: Path, compression: str) -> Path:
    path.write_text(
        "\n".join(
            [
                MODEL,
                f"train: {{max_steps: {STEPS}, batch_size: 8, sample_tokens: 0, log_interval: 1, eval_interval: 0, "
                # the straggler watch's link probe would add its own bytes to the ones counted
                "mixed_precision: 'no', peak_flops: 1.0e12, probe_links: false, plots: false}",
                "optim: {warmup_steps: 2}",
                f"data: {{num_workers: 0, path: '{corpus}', cache_dir: '{cache}'}}",
                f"checkpoint: {{output_dir: '{run}', save_interval: 0, resume: none}}",
                f"parallel: {{grad_compression: {compression}, powersgd_rank: 4, powersgd_start_step: 2}}",
            ]
        )
        + "\n"
    )
    return path


@pytest.fixture(scope="module")
def link():
    yield from netns.two_nodes_or_skip("50mbit")


@pytest.fixture(scope="module")
def trained(link, corpus, token_cache, tmp_path_factory):
    """trained(setting) -> that setting's run: bytes per step over the link, train losses, final eval loss (run once)."""
    done: dict[str, dict] = {}
    port = 29600 + os.getpid() % 300

    def get(compression: str) -> dict:
        if compression not in done:
            work = tmp_path_factory.mktemp(f"link-{compression}")
            cfg = write_config(work / "c.yaml", work / "run", corpus, token_cache, compression)
            args = tuple(
                [
                    "launch",
                    str(cfg),
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(rank),
                    "--rdzv-endpoint",
                    f"{link.a.addr}:{port + len(done)}",
                    "--rdzv-timeout",
                    "30",
                ]
                for rank in (0, 1)
            )
            with netns.ByteMeter(link) as meter:
                run_pair(link, args, timeout=90)
            done[compression] = summarize(work / "run", meter)
        return done[compression]

    return get


def summarize(run: Path, meter: netns.ByteMeter) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["split"] == "train"}
    assert sorted(train) == list(range(1, STEPS + 1))
    sent = meter.bytes_at(train[STEPS]["time"]) - meter.bytes_at(train[MEASURED_FROM]["time"])
    return {
        "bytes_per_step": sent / (STEPS - MEASURED_FROM),
        "losses": [train[s]["loss"] for s in sorted(train)],
        "eval_loss": next(r["loss"] for r in records if r["split"] == "eval"),
        "log": (run / "logs" / "rank0.log").read_text(),
    }


def test_uncompressed_steps_send_the_fp32_gradients_each_way(trained):
    none = trained("none")
    grads = 4 * int(float(re.search(r"GPT ([\d.]+)M params", none["log"])[1]) * 1e6)
    # 2 ranks' ring all-reduce: each rank sends half the buckets to reduce and half back, so each way carries the
    # whole gradient once; headers and the step's small metric all-reduces add a few percent
    assert 2 * grads * 0.97 < none["bytes_per_step"] < 2 * grads * 1.15, (
        none["bytes_per_step"],
        grads,
    )


@pytest.mark.parametrize("compression, low, high", [("bf16", 0.40, 0.62), ("powersgd", 0.02, 0.15)])
def test_compressed_steps_send_fewer_bytes(trained, compression, low, high):
    # measured (Nov 2026): bf16 0.498, powersgd 0.056 (rank-4 factors; vectors such as biases go uncompressed)
    ratio = trained(compression)["bytes_per_step"] / trained("none")["bytes_per_step"]
    assert low <= ratio <= high, f"{compression}: {ratio:.3f} of the uncompressed bytes per step"
    assert f"grad compression: {compression}" in trained(compression)["log"]


# measured (Nov 2026): bf16 within 2e-5 of the uncompressed losses, powersgd within 8e-4, at every step
@pytest.mark.parametrize("compression, tolerance", [("bf16", 0.002), ("powersgd", 0.01)])
def test_compressed_losses_stay_close_to_uncompressed(trained, compression, tolerance):
    none, comp = trained("none"), trained(compression)
    # same seed, same data, same first loss
    assert comp["losses"][0] == pytest.approx(none["losses"][0], rel=1e-6)
    for step, (a, b) in enumerate(zip(none["losses"], comp["losses"]), 1):
        assert abs(b - a) / a < tolerance, (
            f"step {step}: {compression} loss {b:.4f} vs {a:.4f} uncompressed"
        )
    assert abs(comp["eval_loss"] - none["eval_loss"]) / none["eval_loss"] < tolerance
