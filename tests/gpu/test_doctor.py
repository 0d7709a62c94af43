"""`lockstep doctor` on a CUDA machine (issue 23, item 2j), run as a user types it on one GPU: the
device row names the GPU torch sees, with its memory, capability, SMs and NCCL version; a 1-rank
NCCL group runs the all_reduce checks (at world size 1 nothing else would run NCCL before training);
the bf16 matmul peak is measured and recorded (JUnit property), its row not failed.

The CPU twins: tests/unit/doctor/test_device.py (the rows fed an H100's facts, the 1-rank group on
gloo) and tests/unit/cli/test_doctor.py (the CPU's device row and peak).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import run_lockstep


def doctor(out, *flags: str):
    return run_lockstep(
        "doctor", "--nproc", "1", "--output-dir", out, "--max-size", "16MiB", *flags, timeout=240
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    proc = doctor(tmp_path_factory.mktemp("doctor") / "runs", "--json")
    return json.loads(proc.stdout)  # exit code 0: no check failed (run_lockstep raises otherwise)


def rows(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_the_device_row_names_the_gpu_torch_sees(report):
    props = torch.cuda.get_device_properties(0)
    hw = report["ranks"][0]["hardware"]
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    assert hw["kind"] == "cuda" and hw["name"] == torch.cuda.get_device_name(0)
    assert hw["memory_gib"] * 2**30 == pytest.approx(props.total_memory, abs=1.0)
    assert hw["capability"] == f"{props.major}.{props.minor}"
    assert hw["multiprocessors"] == props.multi_processor_count
    assert hw["cuda"] == torch.version.cuda and hw["nccl"] == nccl == report["ranks"][0]["nccl"]
    row = rows(report)["device"]
    assert row["status"] == "ok", row
    assert row["detail"].startswith(
        f"{torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.1f} GiB, capability "
        f"{props.major}.{props.minor}, {props.multi_processor_count} SMs"
    )
    assert f"NCCL {nccl}" in row["detail"]


def test_one_gpu_runs_the_all_reduce_checks_on_a_1_rank_nccl_group(report):
    assert "(a 1-rank nccl group, standalone)" in report["summary"], report["summary"]
    got = rows(report)
    assert got["process group"]["status"] == "ok", got["process group"]
    assert got["process group"]["detail"].startswith(
        "one process: a 1-rank nccl group on cuda:0 ran the all_reduce"
    )
    assert got["all_reduce correctness"]["status"] == "ok", got["all_reduce correctness"]
    assert (
        "float32, float64, int64, bfloat16 at 257 and 1048576 elements"
        in got["all_reduce correctness"]["detail"]
    )
    assert got["all_reduce bandwidth"]["status"] == "ok"
    bw = report["bandwidth"]
    assert [b["bytes"] for b in bw] == [1024 * 4**i for i in range(7)] + [16 << 20]
    assert all(b["algbw_gbps"] > 0 and b["busbw_gbps"] == 0.0 for b in bw)  # one rank: 2(n-1)/n = 0


def test_the_bf16_matmul_peak_is_measured(report, record_property):
    peak = report["ranks"][0]["peak"]
    row = rows(report)["matmul peak"]
    record_property("bf16_matmul_tflops", round(peak.get("flops", 0) / 1e12, 1))
    record_property("matmul_peak_row", f"{row['status']}: {row['detail']}")
    bf16 = report["ranks"][0]["hardware"]["bf16"]
    assert peak["dtype"] == ("bfloat16" if bf16 else "float16") and peak["size"] == 8192
    # warn: under half the datasheet's
    assert peak["flops"] > 0 and row["status"] in ("ok", "warn"), row


def test_the_table_shows_the_device_and_peak_rows(tmp_path):
    text = doctor(tmp_path / "runs").stdout
    name = torch.cuda.get_device_name(0)
    device = next(line for line in text.splitlines() if line.startswith("device "))
    assert re.match(
        rf"device\s+ok\s+{re.escape(name)}, [\d.]+ GiB, capability \d+\.\d+, \d+ SMs", device
    ), device
    matmul = next(line for line in text.splitlines() if line.startswith("matmul peak "))
    assert re.match(
        rf"matmul peak\s+(ok|warn)\s+b?float16 [\d.]+ TFLOP/s on {re.escape(name)} \(rank 0\)",
        matmul,
    ), matmul
    assert text.rstrip().splitlines()[-1].startswith("lockstep doctor: ok: no check failed")
