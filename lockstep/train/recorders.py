"""Optional per-rank recorders of a run: the sample indices of every step, and a profiler trace."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

import torch

from lockstep.config import parse_profile_steps
from lockstep.data.batches import Batches
from lockstep.data.sampler import rank_micro_batches, step_indices
from lockstep.runtime import Runtime


class SampleRecorder:
    """`train.record_samples`: this rank's micro-batch indices of every step, to RUN/samples/rank{r}.jsonl.

    Recomputed from the cursor (not taken from the loader), which is what resume relies on too;
    tests compare these files across world sizes.
    """

    def __init__(self, run_dir: Path, rank: int, batches: Batches):
        self.path = run_dir / "samples" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        r = batches.reading
        self.rank, self.num_samples, self.seed, self.plan = (
            rank,
            len(batches.source.train),
            r.seed,
            r.plan,
        )
        self.cursor, self.lengths = batches.cursor_at(batches.step), batches.source.lengths
        self.data_rank = r.dp_rank  # the data-parallel rank that picks the samples

    def record(self, step: int) -> None:
        indices, self.cursor = step_indices(
            self.num_samples, self.seed, self.cursor, self.plan.global_batch, self.lengths
        )
        mine = [m.tolist() for m in rank_micro_batches(indices, self.plan, self.data_rank)]
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "rank": self.rank, "micro_batches": mine}) + "\n")


def drop_abandoned_records(run_dir: Path, step: int) -> None:
    """A resume at `step`: drop the records of later steps from every rank's file (global rank 0 only).

    Those steps belong to a timeline that ended without a commit (a crash, a lost node); they are trained
    again from here, at whatever world size the run now has, so the files hold each step once, as trained in
    the run that counts. Other ranks append only after the first step's collectives, which rank 0 reaches
    after this.
    """
    for path in sorted((run_dir / "samples").glob("rank*.jsonl")):
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        if len(kept) != len(lines):
            tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)


class StepProfiler:
    """`train.profile_steps = "A:B"`: a torch.profiler trace of steps A..B-1, one file per rank."""

    def __init__(self, spec: str | None, out_dir: Path, rt: Runtime, log: logging.Logger):
        self.window = parse_profile_steps(spec) if spec else None
        self.out_dir, self.rank, self.log = out_dir, rt.rank, log
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if rt.device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler: torch.profiler.profile | None = None

    def before_step(self, step: int) -> None:
        if self.window and step == self.window[0]:
            self.profiler = torch.profiler.profile(activities=self.activities, record_shapes=True)
            with self._native_output():
                self.profiler.start()

    def after_step(self, step: int) -> None:
        if self.profiler is not None and step == self.window[1]:
            with self._native_output():
                self.profiler.stop()
            trace = (
                self.out_dir
                / f"rank{self.rank}.steps{self.window[0]}-{self.window[1]}.pt.trace.json"
            )
            trace.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(trace))
            self.log.info("profiler trace: %s (open in Perfetto or TensorBoard)", trace)
            self.profiler = None

    @contextlib.contextmanager
    def _native_output(self):
        """kineto prints "USDT: ... profiler_start" lines from C++ on every rank, at any log level that keeps its
        errors (KINETO_LOG_LEVEL, read once at process start): they go to RUN/profile/rank{r}.kineto.txt, not the
        console."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with open(self.out_dir / f"rank{self.rank}.kineto.txt", "ab") as f:
                os.dup2(f.fileno(), 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
