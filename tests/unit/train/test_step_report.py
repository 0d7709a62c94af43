"""A run's step time by rank and cause (lockstep/train/step_report.py), from a metrics.jsonl written as a
run writes it: the means per rank over the run, the windows each was behind, and the picture."""

from __future__ import annotations

import json
from pathlib import Path

from lockstep.metrics import MetricsWriter
from lockstep.train.step_report import figure, plot, table, windows

PHASES_MS = {"data_ms": 1.0, "compute_ms": 20.0, "comm_ms": 0.0, "optimizer_ms": 2.0}


def write_run(run: Path, slow_from: int = 3) -> Path:
    """5 log windows of 4 ranks on two hosts; from window `slow_from` rank 2 reads 30 ms more data a
    step, and the others wait that long in the all-reduce; an eval record between, as a run has."""
    with MetricsWriter(run, True, 50, tensorboard=False, progress=False) as writer:
        for window in range(1, 6):
            rows = []
            for r in range(4):
                row = {"rank": r, "host": f"node-{'ab'[r // 2]}", "local_rank": r % 2, "steps": 10}
                row |= PHASES_MS
                if window >= slow_from:
                    row["data_ms" if r == 2 else "comm_ms"] += 30.0
                rows.append(row | {"checkpoint_ms": 0.0, "other_ms": 0.5})
            writer.log(10 * window, {"loss": 3.0}, ranks=rows)
            writer.log(10 * window, {"loss": 3.1}, split="eval")
    return run / "metrics.jsonl"


def test_the_table_gives_each_rank_s_means_and_the_windows_it_was_behind(tmp_path):
    path = write_run(tmp_path)
    assert [step for step, _ in windows(path)] == [10, 20, 30, 40, 50]
    lines = table(path, 0.5).splitlines()
    assert lines[0].startswith("Milliseconds per step, means over 5 log windows (steps 10-50)")
    assert lines[2] == (
        "| rank | host | local rank | data (ms) | compute (ms) | comm (ms) | bubble (ms) | "
        "optimizer (ms) | checkpoint (ms) | other (ms) | own (ms) | behind |"
    )
    # records without bubble_ms (no pipeline, or written before it was timed) read 0
    assert lines[4:] == [
        "| 0 | node-a | 0 | 1.0 | 20.0 | 18.0 | 0.0 | 2.0 | 0.0 | 0.5 | 23.5 | 0 of 5 |",
        "| 1 | node-a | 1 | 1.0 | 20.0 | 18.0 | 0.0 | 2.0 | 0.0 | 0.5 | 23.5 | 0 of 5 |",
        "| 2 | node-b | 0 | 19.0 | 20.0 | 0.0 | 0.0 | 2.0 | 0.0 | 0.5 | 41.5 | 3 of 5 |",
        "| 3 | node-b | 1 | 1.0 | 20.0 | 18.0 | 0.0 | 2.0 | 0.0 | 0.5 | 23.5 | 0 of 5 |",
    ]


def test_the_picture_is_drawn_from_the_records_and_none_without_them(tmp_path):
    png = plot(write_run(tmp_path / "a"), tmp_path / "a" / "step_times.png", 0.5)
    assert png == tmp_path / "a" / "step_times.png" and png.read_bytes()[:4] == b"\x89PNG"
    with MetricsWriter(tmp_path / "b", True, 5, tensorboard=False, progress=False) as writer:
        writer.log(5, {"loss": 3.0})  # one process: no per-rank times
    assert plot(tmp_path / "b" / "metrics.jsonl", tmp_path / "b" / "x.png", 0.5) is None
    assert table(tmp_path / "b" / "metrics.jsonl", 0.5).endswith(
        "no record holds per-rank step times"
    )


def test_the_picture_names_the_rank_behind_and_its_cause(tmp_path):
    fig = figure(write_run(tmp_path), 0.5)
    bars = fig.axes[0]
    assert [label.get_text() for label in bars.get_yticklabels()] == [
        "rank 0 (node-a, 0)",
        "rank 1 (node-a, 1)",
        "rank 2 (node-b, 0)\nbehind 3 of 5: data",
        "rank 3 (node-b, 1)",
    ]
    assert fig.get_suptitle() == (
        f"Step time by rank and cause: {tmp_path.name}\n"
        "rank 2 (node-b, local rank 0) behind in 3 of 5 comparisons, cause data"
    )
    # a margin above its 53.5 ms of its own against 23.5 (2.28x): nobody named
    fig = figure(tmp_path / "metrics.jsonl", 1.5)
    assert fig.get_suptitle() == f"Step time by rank and cause: {tmp_path.name}"
    assert "behind" not in "".join(t.get_text() for t in fig.axes[0].get_yticklabels())


def test_an_elastic_run_whose_world_shrank_is_drawn_and_tabled(tmp_path):
    """4 ranks for 3 windows, then 3 (a node lost): each rank over the windows it was in."""
    path = write_run(tmp_path, slow_from=9)
    records = path.read_text().splitlines()
    shrunk = []
    for line in records:
        record = json.loads(line)
        if record.get("ranks") and record["step"] > 30:
            record["ranks"] = record["ranks"][:3]
        shrunk.append(json.dumps(record))
    path.write_text("\n".join(shrunk) + "\n")
    assert plot(path, tmp_path / "p.png", 0.5) == tmp_path / "p.png"
    rows = [line for line in table(path, 0.5).splitlines() if line.startswith("| 3 ")]
    assert rows == ["| 3 | node-b | 1 | 1.0 | 20.0 | 0.0 | 0.0 | 2.0 | 0.0 | 0.5 | 23.5 | 0 of 5 |"]
