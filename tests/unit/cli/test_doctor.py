"""`lockstep doctor`'s arguments (lockstep/cli/doctor.py): sizes and counts refused in one line, and one process
checked in-process: the table, the JSON document, and the report file a launching process reads. Several ranks:
tests/unit/doctor/test_probes.py."""

from __future__ import annotations

import json

from conftest import run_main


def test_help_lists_the_options_but_not_the_internal_one(capsys):
    code, out, _ = run_main(capsys, "doctor", "--help")
    assert code == 0
    for option in ("--nproc N", "--output-dir DIR", "--json", "--max-size SIZE", "--timeout S", "--nnodes",
                   "--node-rank", "--rdzv-endpoint HOST:PORT", "--rdzv-timeout"):
        assert option in out, option
    assert "--report-file" not in out  # set by the launching process for its workers


def test_bad_values_are_one_line_and_exit_2(tmp_path, capsys):
    assert run_main(capsys, "doctor", "--max-size", "lots", "--output-dir", tmp_path) == (
        2, "", "lockstep doctor: error: --max-size 'lots' is not a size of at least 1 KiB; e.g. 64MiB, 256KiB, 1GiB\n")
    assert run_main(capsys, "doctor", "--max-size", "512", "--output-dir", tmp_path)[0] == 2  # below 1 KiB
    assert run_main(capsys, "doctor", "--nproc", "0", "--output-dir", tmp_path) == (
        2, "", "lockstep doctor: error: --nproc 0 must be at least 1\n")


def test_one_process_json(tmp_path, capsys):
    code, out, err = run_main(capsys, "doctor", "--nproc", "1", "--output-dir", tmp_path / "runs", "--json")
    assert code == 0 and err == ""
    report = json.loads(out)  # stdout is one JSON document
    assert report["ok"] is True and report["bandwidth"] == [] and [r["rank"] for r in report["ranks"]] == [0]
    assert {c["name"]: c["status"] for c in report["checks"]}["process group"] == "skip"
    assert not (tmp_path / "runs").exists()


def test_one_process_table(tmp_path, capsys):
    code, out, _ = run_main(capsys, "doctor", "--nproc", "1", "--output-dir", tmp_path)
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"lockstep doctor: 1 rank on 1 host (no process group, standalone); output dir " \
                                      f"{tmp_path}"
    assert lines[-1] == "lockstep doctor: ok: no check failed (0 warnings)"


def test_a_worker_writes_its_report_for_the_launching_process(tmp_path, capsys):
    report_file = tmp_path / "report.json"
    assert run_main(capsys, "doctor", "--output-dir", tmp_path / "runs", "--report-file", report_file) == (0, "", "")
    assert json.loads(report_file.read_text())["ok"] is True  # the launching process prints it
