"""`lockstep doctor`'s arguments (lockstep/cli/doctor.py): sizes and counts refused in one line, and one process
checked in-process: the table, the JSON document, and the report file a launching process reads. Several ranks:
tests/unit/doctor/test_probes.py."""

from __future__ import annotations

import json
import re

import torch
from conftest import run_main

from lockstep.peak_flops import cpu_model


def test_help_lists_the_options_but_not_the_internal_one(capsys):
    code, out, _ = run_main(capsys, "doctor", "--help")
    assert code == 0
    for option in (
        "--nproc N",
        "--output-dir DIR",
        "--json",
        "--max-size SIZE",
        "--timeout S",
        "--nnodes",
        "--node-rank",
        "--rdzv-endpoint HOST:PORT",
        "--rdzv-timeout",
        "--config CFG.yaml",
        "--set KEY=VALUE",
    ):
        assert option in out, option
    assert "--report-file" not in out  # set by the launching process for its workers


def test_bad_values_are_one_line_and_exit_2(tmp_path, capsys):
    assert run_main(capsys, "doctor", "--max-size", "lots", "--output-dir", tmp_path) == (
        2,
        "",
        "lockstep doctor: error: --max-size 'lots' is not a size of at least 1 KiB; e.g. 64MiB, 256KiB, 1GiB\n",
    )
    # below 1 KiB
    assert run_main(capsys, "doctor", "--max-size", "512", "--output-dir", tmp_path)[0] == 2
    assert run_main(capsys, "doctor", "--nproc", "0", "--output-dir", tmp_path) == (
        2,
        "",
        "lockstep doctor: error: --nproc 0 must be at least 1\n",
    )


def test_one_process_json(tmp_path, capsys):
    code, out, err = run_main(
        capsys, "doctor", "--nproc", "1", "--output-dir", tmp_path / "runs", "--json"
    )
    assert code == 0 and err == ""
    report = json.loads(out)  # stdout is one JSON document
    assert (
        report["ok"] is True
        and report["bandwidth"] == []
        and [r["rank"] for r in report["ranks"]] == [0]
    )
    assert {c["name"]: c["status"] for c in report["checks"]}["process group"] == "skip"
    assert not (tmp_path / "runs").exists()


def test_one_process_table(tmp_path, capsys):
    code, out, _ = run_main(capsys, "doctor", "--nproc", "1", "--output-dir", tmp_path)
    lines = out.splitlines()
    assert (
        code == 0
        and lines[0]
        == f"lockstep doctor: 1 rank on 1 host (no process group, standalone); output dir "
        f"{tmp_path}"
    )
    assert lines[-1] == "lockstep doctor: ok: no check failed (0 warnings)"


def test_one_cpu_process_shows_its_device_and_a_measured_matmul_peak(tmp_path, capsys):
    code, out, _ = run_main(capsys, "doctor", "--nproc", "1", "--output-dir", tmp_path, "--json")
    report = json.loads(out)
    hardware, peak = report["ranks"][0]["hardware"], report["ranks"][0]["peak"]
    assert code == 0 and hardware["kind"] == "cpu" and hardware["name"] == cpu_model()
    assert hardware["threads"] == torch.get_num_threads() and hardware["memory_gib"] > 0
    assert peak["dtype"] == ("bfloat16" if hardware["bf16"] else "float32") and peak["flops"] > 0
    rows = {c["name"]: c for c in report["checks"]}
    assert rows["device"]["status"] == "ok"
    assert rows["device"]["detail"].startswith(f"CPU {cpu_model()}, ")
    assert rows["matmul peak"]["status"] == "ok"
    code, out, _ = run_main(capsys, "doctor", "--nproc", "1", "--output-dir", tmp_path)
    device = next(line for line in out.splitlines() if line.startswith("device "))
    assert device.split()[1:4] == ["ok", "CPU", *cpu_model().split()[:1]]
    matmul = next(line for line in out.splitlines() if line.startswith("matmul peak "))
    m = re.fullmatch(
        r"matmul peak +ok +(float32|bfloat16) ([\d.]+) [GT]FLOP/s on (.*) \(rank 0\)", matmul
    )
    assert m and float(m.group(2)) > 0 and m.group(3) == cpu_model(), matmul


def test_a_worker_writes_its_report_for_the_launching_process(tmp_path, capsys):
    report_file = tmp_path / "report.json"
    assert run_main(
        capsys, "doctor", "--output-dir", tmp_path / "runs", "--report-file", report_file
    ) == (0, "", "")
    assert json.loads(report_file.read_text())["ok"] is True  # the launching process prints it


def test_config_adds_the_communication_check(tmp_path, capsys):
    code, out, err = run_main(
        capsys,
        "doctor",
        "--nproc",
        "1",
        "--output-dir",
        tmp_path / "runs",
        "--json",
        "--set",
        "train.peak_flops=1e12",
        "--set",
        "model.layers=2",
    )
    assert code == 0, err
    report = json.loads(out)
    check = {c["name"]: c for c in report["checks"]}["communication vs compute"]
    assert check["status"] == "ok" and check["detail"].startswith(
        "one process: there is no gradient all-reduce"
    )
    assert report["comm"]["world_size"] == 1 and report["comm"]["recommend"] == "none"
    assert report["comm"]["compute"].endswith("train.peak_flops, rank 0)")
    code, out, _ = run_main(
        capsys,
        "doctor",
        "--nproc",
        "1",
        "--output-dir",
        tmp_path / "runs",
        "--set",
        "train.peak_flops=1e12",
    )
    assert "\ncommunication vs compute (" in out and "recommended: none: one process" in out


def test_config_the_estimate_cannot_model_is_refused_before_any_rank_starts(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("parallel:\n  data_parallel: fsdp\n")
    code, out, err = run_main(
        capsys, "doctor", "--nproc", "2", "--config", config, "--output-dir", tmp_path
    )
    assert (
        (code, out) == (2, "")
        and "lockstep doctor: error: lockstep doctor --config: parallel.grad_compression "
        "compresses DDP's gradient all-reduce"
        in err
    )
    assert "starting" not in err  # no worker was launched
    assert run_main(capsys, "doctor", "--set", "model.layers", "--output-dir", tmp_path)[2] == (
        "lockstep doctor: error: --set 'model.layers' is not KEY=VALUE; e.g. --set train.batch_size=64\n"
    )
