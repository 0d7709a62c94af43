import io
import json
import logging

import pytest
import torch

from lockstep.metrics import (
    MetricsWriter,
    _console_line,
    format_duration,
    format_si,
    mfu,
    plot_loss,
    read_metrics,
    remaining_seconds,
)
from lockstep.rank_logs import LOGGER_NAME, init_rank_logging


@pytest.fixture(autouse=True)
def clean_logger():
    """The "lockstep" logger is process-wide: leave no handlers (open files) behind."""
    yield
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


# ----------------------------------------------------------------------------- writer


def test_console_line_format(tmp_path, capsys):
    init_rank_logging(tmp_path, rank=0, is_main=True)
    writer = MetricsWriter(
        tmp_path, is_main=True, total_steps=400, tensorboard=False, progress=False
    )
    writer.log(
        120, {"loss": 2.314, "lr": 9.1e-4, "grad_norm": 0.84, "tokens_per_s": 10234, "mfu": 0.123}
    )
    writer.close()
    err = capsys.readouterr().err.rstrip()
    # the ETA at this attempt's rate closes a train line (its value depends on the time taken here)
    line, eta = err.rsplit(" | ", 1)
    assert line.endswith(
        "step 120/400 | loss 2.3140 | lr 9.1e-04 | grad_norm 0.84 | 10.2k tok/s | mfu 12.3%"
    )
    assert eta.startswith("eta ") and eta.endswith("s")


def test_console_line_shows_epochs_done_of_the_total_and_the_eta():
    # the end of a 2-epoch run: epochs done, not the next epoch's index
    end = {"loss": 1.25, "epoch": 2.0, "epochs": 2.0, "eta_s": 0.0}
    assert _console_line(32, 32, end, "train") == "step 32/32 | loss 1.2500 | epoch 2.00/2 | eta 0s"
    # the last step of the first epoch; a run bound by steps shows epochs done alone
    assert (
        _console_line(16, 32, {"epoch": 1.0, "epochs": 2.0, "eta_s": 192.4}, "train")
        == "step 16/32 | epoch 1.00/2 | eta 3m12s"
    )
    assert (
        _console_line(6, 600, {"epoch": 0.75, "eta_s": 7380}, "train")
        == "step 6/600 | epoch 0.75 | eta 2h03m"
    )


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0s"),
        (0.4, "0s"),
        (45, "45s"),
        (59.6, "1m00s"),
        (192, "3m12s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
        (7380, "2h03m"),
        (-3, "0s"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_remaining_seconds_counts_this_attempts_steps_only():
    assert remaining_seconds(10, 0, 100, elapsed=20.0) == 180.0  # 2 s a step, 90 to go
    # resumed at step 50: its 10 steps took 20 s; the 50 it skipped took nothing here
    assert remaining_seconds(60, 50, 100, elapsed=20.0) == 80.0
    assert remaining_seconds(100, 50, 100, elapsed=20.0) == 0.0  # done
    assert remaining_seconds(50, 50, 100, elapsed=3.0) == 0.0  # no step yet: no rate


def test_writer_main_writes_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path, is_main=True, total_steps=20) as writer:
        for step in range(1, 21):
            writer.advance(step)
            if step % 10 == 0:
                writer.log(step, {"loss": 3.0 - step / 10, "lr": 1e-3, "tokens_per_s": 5000.0})
        writer.log(20, {"loss": 2.5}, split="eval")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["split"]) for r in records] == [
        (10, "train"),
        (20, "train"),
        (20, "eval"),
    ]
    assert records[0]["loss"] == pytest.approx(2.0) and records[0]["lr"] == 1e-3
    assert records[2]["loss"] == 2.5 and "time" in records[2]
    assert read_metrics(tmp_path / "metrics.jsonl") == records

    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/tokens_per_s", "eval/loss"} <= set(
        acc.Tags()["scalars"]
    )
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (10, pytest.approx(2.0)),
        (20, pytest.approx(1.0)),
    ]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(20, 2.5)]


def test_writer_non_main_creates_nothing(tmp_path):
    run_dir = tmp_path / "run"
    writer = MetricsWriter(run_dir, is_main=False, total_steps=10)
    writer.advance(1)
    writer.log(1, {"loss": 1.0})
    writer.close()
    assert not run_dir.exists()


def test_progress_bar_silent_without_tty(tmp_path, capsys):
    writer = MetricsWriter(tmp_path, is_main=True, total_steps=10, tensorboard=False)
    for step in range(1, 11):
        writer.advance(step)
    writer.close()
    assert capsys.readouterr().err == ""  # pytest's captured stderr is not a TTY


def test_progress_bar_on_tty(tmp_path, monkeypatch):
    class FakeTTY(io.StringIO):
        def isatty(self):
            return True

    fake = FakeTTY()
    monkeypatch.setattr("sys.stderr", fake)
    writer = MetricsWriter(tmp_path, is_main=True, total_steps=10, start_step=4, tensorboard=False)
    writer.log(5, {"loss": 1.5, "tokens_per_s": 2000})
    writer.advance(10)
    writer.close()
    out = fake.getvalue()
    assert "10/10" in out and "loss=1.5000" in out and "tok/s=2k" in out


def test_read_metrics_drops_superseded_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        (10, "train"),
        (20, "train"),
        (20, "eval"),
        (30, "train"),  # crashed after 30
        (20, "train"),
        (30, "train"),
    ]  # resumed from the step-10 checkpoint
    path.write_text(
        "".join(
            json.dumps({"step": s, "split": sp, "loss": i}) + "\n" for i, (s, sp) in enumerate(rows)
        )
        + '{"step": 40, "spl'
    )  # partial last line from a crash
    records = read_metrics(path)
    assert [(r["step"], r["split"], r["loss"]) for r in records] == [
        (10, "train", 0),
        (20, "train", 4),
        (30, "train", 5),
    ]


# ----------------------------------------------------------------------------- plot


def test_plot_loss_writes_png(tmp_path):
    import matplotlib.image

    with MetricsWriter(
        tmp_path, is_main=True, total_steps=50, tensorboard=False, progress=False
    ) as writer:
        for step in range(5, 51, 5):
            writer.log(step, {"loss": 4.0 / step**0.5, "lr": 1e-3 * min(1, step / 20)})
        writer.log(25, {"loss": 0.9}, split="eval")
        writer.log(50, {"loss": 0.7}, split="eval")
    out = plot_loss(tmp_path / "metrics.jsonl", tmp_path / "plots" / "loss.png")
    assert out == tmp_path / "plots" / "loss.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0.01  # not a blank canvas


def test_plot_loss_without_train_points(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 10, "split": "eval", "loss": 1.0}) + "\n")
    assert plot_loss(path, tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()
    assert plot_loss(tmp_path / "missing.jsonl", tmp_path / "loss.png") is None


# ----------------------------------------------------------------------------- throughput


def test_mfu():
    # 10k tok/s x 6 * 10M params FLOPs per token = 6e11 FLOP/s on 1.2e12 peak -> 50%
    assert mfu(10_000, 6 * 10e6, 1.2e12) == pytest.approx(0.5)
    assert mfu(0, 1e6, 1e12) == 0.0
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1, 1, 0)


@pytest.mark.parametrize(
    "x, text",
    [
        (10234, "10.2k"),
        (3.1e9, "3.1G"),
        (0, "0"),
        (950, "950"),
        (12.5, "12.5"),
        (999.7, "1k"),
        (1500, "1.5k"),
        (2.5e6, "2.5M"),
        (-4200, "-4.2k"),
        (7e13, "70T"),
    ],
)
def test_format_si(x, text):
    assert format_si(x) == text


class ListSink:
    """A sink that keeps what it is given, and can see how far metrics.jsonl had got when it was called."""

    def __init__(self, jsonl):
        self.jsonl, self.calls = jsonl, []

    def log(self, step, values, split):
        self.calls.append((step, split, values, len(self.jsonl.read_text().splitlines())))


def test_writer_hands_sinks_each_record_after_writing_it(tmp_path):
    sink = ListSink(tmp_path / "metrics.jsonl")
    with MetricsWriter(
        tmp_path, is_main=True, total_steps=2, tensorboard=False, progress=False, sinks=[sink]
    ) as writer:
        writer.log(1, {"loss": torch.tensor(2.5), "lr": 1e-3})
        writer.log(2, {"loss": 2.0}, split="eval")
    assert sink.calls[0][2].pop("eta_s") >= 0.0  # train records gain the ETA, eval ones don't
    assert sink.calls == [(1, "train", {"loss": 2.5, "lr": 1e-3}, 1), (2, "eval", {"loss": 2.0}, 2)]
    assert isinstance(sink.calls[0][2]["loss"], float)  # plain floats, as in the file
    assert not (tmp_path / "tensorboard").exists()
    other = ListSink(tmp_path / "metrics.jsonl")
    MetricsWriter(tmp_path / "r1", is_main=False, total_steps=2, sinks=[other]).log(
        1, {"loss": 1.0}
    )
    assert other.calls == []  # only the main rank reports


def test_every_rank_s_numbers_go_into_the_record_and_the_trackers_not_the_console(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = ListSink(tmp_path / "metrics.jsonl")
    ranks = [
        {"rank": 0, "host": "a", "local_rank": 0, "data_ms": 1.0, "comm_ms": 40.0},
        {"rank": 1, "host": "b", "local_rank": 0, "data_ms": 41.0, "comm_ms": 2.0},
    ]
    with caplog.at_level(logging.INFO):
        with MetricsWriter(tmp_path, True, 4, progress=False, sinks=[sink]) as writer:
            writer.log(4, {"loss": 2.0}, ranks=ranks)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["ranks"] == ranks and record["loss"] == 2.0
    assert [(split, values) for _, split, values, _ in sink.calls[1:]] == [
        (
            "ranks",
            {
                "rank0/data_ms": 1.0,
                "rank0/comm_ms": 40.0,
                "rank1/data_ms": 41.0,
                "rank1/comm_ms": 2.0,
            },
        )
    ]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("ranks/rank1/data_ms")] == [(4, 41.0)]
    assert "data_ms" not in caplog.text and "rank1" not in caplog.text
