"""Metrics files (JSONL, TensorBoard), progress bar, loss plot and MFU. Per-rank log files: lockstep.rank_logs.

MetricsWriter also hands every record to its sinks: the experiment trackers of lockstep.train.trackers.

Rank roles (docs/architecture.md, "Rank roles"): only the main rank (global rank 0) writes shared files
and draws the progress bar. This module never
calls torch.distributed: the trainer all-reduces values first and passes `is_main`.

Value keys the console line knows how to format (others are shown as `key 1.23`):
    loss, lr, grad_norm, tokens_per_s (all ranks together), mfu (a fraction), epoch (epochs done, a
    float as HF's) with epochs (the total, in an epoch-bound run): `epoch 1.50/2`, and eta_s.
MetricsWriter adds eta_s to each train record: the seconds left at this attempt's step rate.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from lockstep.rank_logs import LOGGER_NAME

# ----------------------------------------------------------------------------- formatting


def format_si(x: float) -> str:
    """10234 -> "10.2k", 3.1e9 -> "3.1G" (three significant digits)."""
    if not math.isfinite(x):
        return str(x)
    for unit in ("", "k", "M", "G", "T", "P"):
        # 999.5 rather than 1000: "%.3g" would round 999.7 up to "1e+03".
        if abs(x) < 999.5 or unit == "P":
            return f"{x:.3g}{unit}"
        x /= 1000
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """45 -> "45s", 192 -> "3m12s", 7380 -> "2h03m": the console's ETA."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def remaining_seconds(step: int, start_step: int, total_steps: int, elapsed: float) -> float:
    """Seconds until total_steps at the rate of the steps this attempt ran (start_step -> step in
    `elapsed` s): the steps a resumed run skipped took no time here, so they do not count."""
    done = step - start_step
    return 0.0 if done <= 0 or step >= total_steps else (total_steps - step) * elapsed / done


def _console_line(step: int, total_steps: int, values: dict[str, float], split: str) -> str:
    parts = [
        f"step {step}/{total_steps}" if split == "train" else f"{split} step {step}/{total_steps}"
    ]
    for key, value in values.items():
        match key:
            case "epoch":  # epochs done; of the total where the run is epoch-bound
                total = f"/{values['epochs']:g}" if "epochs" in values else ""
                parts.append(f"epoch {value:.2f}{total}")
            case "epochs":
                pass  # shown with epoch
            case "eta_s":
                parts.append(f"eta {format_duration(value)}")
            case "loss":
                parts.append(f"loss {value:.4f}")
            case "lr":
                parts.append(f"lr {value:.1e}")
            case "grad_norm":
                parts.append(f"grad_norm {value:.2f}")
            case "tokens_per_s":
                parts.append(f"{format_si(value)} tok/s")
            case "mfu":
                parts.append(f"mfu {100 * value:.1f}%")
            case "data_wait_ms":
                parts.append(f"data {value:.1f} ms")
            case "skipped_steps":
                parts.append(f"skipped {value:.0f}")
            case "loss_scale":
                parts.append(f"scale {value:g}")
            case "peak_mem_mb":
                parts.append(f"mem {value:,.0f} MB")
            case "state_mb":
                parts.append(f"state {value:,.0f} MB")
            case _:
                parts.append(f"{key} {value:.4g}")
    return " | ".join(parts)


# ----------------------------------------------------------------------------- writer


class MetricsSink(Protocol):
    """Where MetricsWriter also sends each record (an experiment tracker): the same values, step and split."""

    def log(self, step: int, values: dict[str, float], split: str) -> None: ...


class MetricsWriter:
    """Main-rank sink for already all-reduced metrics; a no-op on every other rank.

    Steps count completed optimizer steps: a run resumed at `start_step` logs steps > start_step,
    and the progress bar runs from start_step to total_steps.
    """

    def __init__(
        self,
        run_dir: Path,
        is_main: bool,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        progress: bool = True,
        sinks: Sequence[MetricsSink] = (),
    ):
        self.is_main = is_main
        self.total_steps, self.start_step = total_steps, start_step
        self._start = time.perf_counter()  # this attempt's step rate, for the ETA, counts from here
        self._jsonl = self._tb = self._bar = None
        # experiment trackers (lockstep.train.trackers); their owner closes them
        self._sinks = list(sinks) if is_main else []
        if not is_main:
            return
        self._logger = logging.getLogger(LOGGER_NAME)
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # Append, so a resumed run continues the same file; read_metrics drops the superseded tail.
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "TensorBoard logging needs the tensorboard package: "
                    "pip install tensorboard, or pass tensorboard=False"
                ) from e
            # purge_step hides events a crashed attempt wrote after the checkpoint we resumed from.
            self._tb = SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step > 0 else None
            )
        if progress:
            # disable=None: no bar when stderr is not a TTY (batch jobs); the console lines suffice.
            # Under `lockstep launch` stderr is a pipe to a terminal (lockstep.launch.elastic
            # CppFramesToLog, which sets LOCKSTEP_CONSOLE_IS_TTY): the bar is drawn there.
            seen = os.environ.get("LOCKSTEP_CONSOLE_IS_TTY") == "1"
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                disable=False if seen else None,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def log(
        self,
        step: int,
        values: dict[str, float],
        split: str = "train",
        ranks: list[dict] | None = None,
    ) -> None:
        """One record: `values` (the console line shows them), and `ranks`, every rank's own numbers
        (lockstep.train.step_clock's step times), in the record and the trackers, not the console."""
        if not self.is_main:
            return
        values = {k: float(v) for k, v in values.items()}  # tensors / numpy scalars -> JSON floats
        # the console's ETA, and TrainJob progress's (lockstep.train.trainjob_progress)
        if split == "train":
            values["eta_s"] = remaining_seconds(
                step, self.start_step, self.total_steps, time.perf_counter() - self._start
            )
        record = {"step": step, "split": split, **values, "time": time.time()}
        if ranks:
            record["ranks"] = ranks
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()  # a crash should not lose the last lines before it
        # after the file: a tracker that fails or stalls cannot cost metrics.jsonl a line
        per_rank = {
            f"rank{row['rank']}/{key}": value
            for row in ranks or []
            for key, value in row.items()
            if isinstance(value, float)
        }
        for sink in self._sinks:
            sink.log(step, values, split)
            if per_rank:
                sink.log(step, per_rank, "ranks")
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(f"{split}/{key}", value, step)
            for key, value in per_rank.items():
                self._tb.add_scalar(f"ranks/{key}", value, step)
        if self._bar is not None and split == "train":
            postfix = {}
            if "loss" in values:
                postfix["loss"] = f"{values['loss']:.4f}"
            if "tokens_per_s" in values:
                postfix["tok/s"] = format_si(values["tokens_per_s"])
            self._bar.set_postfix(postfix, refresh=False)
        self._logger.info(_console_line(step, self.total_steps, values, split))

    def advance(self, step: int) -> None:
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)  # tqdm rate-limits redraws, so this is cheap

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self._jsonl = self._tb = self._bar = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl, in order, without the ones a resumed run superseded.

    A resumed run appends steps the crashed attempt had already logged. From the first record
    that goes back in steps, the older attempt's records at or after that step (any split) are dropped.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records: list[dict] = []
    max_step, last_step = -math.inf, {}  # over all splits; per split
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # a crash mid-write leaves a partial last line
                break
            raise ValueError(f"{path}:{number} is not valid JSON ({e})") from e
        step, split = record["step"], record.get("split", "train")
        if step < max_step or step <= last_step.get(split, -math.inf):
            records = [r for r in records if r["step"] < step]
            max_step = max((r["step"] for r in records), default=-math.inf)
            last_step = {r.get("split", "train"): r["step"] for r in records}
        records.append(record)
        max_step, last_step[split] = max(max_step, step), step
    return records


def plot_loss(metrics_path: Path, out_png: Path) -> Path | None:
    """Train loss (line), eval loss (markers) and learning rate (twin axis) vs step; None if no train points."""
    # Figure + FigureCanvasAgg instead of pyplot: no display needed, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics_path = Path(metrics_path)
    records = read_metrics(metrics_path) if metrics_path.exists() else []
    train = [r for r in records if r.get("split") == "train" and "loss" in r]
    if not train:
        return None
    evals = [r for r in records if r.get("split") == "eval" and "loss" in r]
    with_lr = [r for r in train if "lr" in r]

    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    handles = ax.plot(
        [r["step"] for r in train], [r["loss"] for r in train], color="tab:blue", label="train loss"
    )
    if evals:
        handles += ax.plot(
            [r["step"] for r in evals],
            [r["loss"] for r in evals],
            "o",
            color="tab:red",
            label="eval loss",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if with_lr:
        ax_lr = ax.twinx()
        handles += ax_lr.plot(
            [r["step"] for r in with_lr],
            [r["lr"] for r in with_lr],
            "--",
            color="tab:gray",
            label="learning rate",
        )
        ax_lr.set_ylabel("learning rate")
    ax.legend(handles=handles, loc="upper right")
    ax.set_title(f"loss: {metrics_path.parent.name}")
    fig.tight_layout()

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png


# ----------------------------------------------------------------------------- throughput


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory so far: allocated device memory on CUDA, resident set (VmHWM) on CPU.

    On CPU it counts everything the process holds (Python, torch's libraries: a few hundred MB), so
    compare layouts by their differences, not by the absolute number.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def held_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor this rank holds: a DTensor's shard on this rank, any other whole."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def model_state_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """What this rank holds of the model's state: parameters, optimizer state and any gradients (its shards only).

    The number sharding changes (FSDP halves it on 2 ranks), apart from activations and the process itself.
    Measured between steps, when the trainer has already freed the gradients.
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:  # tied parameters once
            seen.add(id(p))
            total += held_bytes(p) + (held_bytes(p.grad) if p.grad is not None else 0)
    for state in optimizer.state.values():
        total += sum(
            held_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        )
    return total / 2**20


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops_total: float) -> float:
    """Model FLOPs utilisation as a fraction; peak_flops_total is the peak summed over all ranks."""
    if peak_flops_total <= 0:
        raise ValueError(
            f"peak_flops_total must be positive, got {peak_flops_total}; "
            "set train.peak_flops or let it be measured"
        )
    return tokens_per_second * flops_per_token / peak_flops_total
