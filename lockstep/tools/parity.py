"""`lockstep parity CONFIG`: the same seed and global batch for K steps on 1 process and on N, losses compared.

Both runs are ordinary `lockstep train` runs (subprocesses), so what is compared is exactly what
training does: the reference on one process with plain data parallelism off, the other with the
config's layout (ddp / fsdp / tp / pp) on N processes. Both log every step; the per-step loss
difference is the report. With fp32 the runs differ only by the order of floating-point sums
(all-reduce, sharded matmuls); bf16 autocast or dropout widen the gap, and the report says so.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from lockstep.config import Config, config_from_dict, config_to_dict


@dataclass
class ParityStep:
    step: int
    reference: float
    parallel: float

    @property
    def abs_diff(self) -> float:
        return abs(self.parallel - self.reference)

    @property
    def rel_diff(self) -> float:
        return self.abs_diff / max(abs(self.reference), 1e-12)


@dataclass
class ParityReport:
    world_size: int
    layout: str
    steps: list[ParityStep]
    tolerance: float

    @property
    def max_rel_diff(self) -> float:
        return max((s.rel_diff for s in self.steps), default=math.inf)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and self.max_rel_diff <= self.tolerance

    def format(self) -> str:
        lines = [f"parity: 1 process vs {self.world_size} ({self.layout}), {len(self.steps)} steps",
                 "step  loss (1 proc)  loss (N procs)  abs diff   rel diff"]
        lines += [f"{s.step:>4}  {s.reference:>13.6f}  {s.parallel:>14.6f}  {s.abs_diff:.2e}  {s.rel_diff:.2e}"
                  for s in self.steps]
        verdict = "within" if self.ok else "OUTSIDE"
        lines.append(f"max relative difference {self.max_rel_diff:.2e}: {verdict} the tolerance {self.tolerance:g}")
        return "\n".join(lines)


def _step_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split", "train") == "train" and "loss" in r}


def _train(cfg: Config, world_size: int, run_dir: Path, log: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "parity-config.yaml"
    config_file.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    cmd = [sys.executable, "-m", "lockstep", "train", "--config", str(config_file), "--world-size", str(world_size)]
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"the {world_size}-process run failed (exit {proc.returncode}); see {log}")


def run_parity(cfg: Config, world_size: int, steps: int, out_dir: Path, tolerance: float) -> ParityReport:
    """Train `steps` steps on 1 process and on `world_size` processes from the same seed; compare losses."""
    from lockstep.parallel.mesh import resolve_layout

    layout = resolve_layout(cfg.parallel, cfg.model, world_size)
    base = _copy(cfg)
    base.train.max_steps, base.train.epochs = steps, None
    base.train.log_interval, base.train.eval_interval, base.train.sample_tokens = 1, 0, 0
    base.data.eval_fraction = min(base.data.eval_fraction, 0.02)
    base.checkpoint.save_interval, base.checkpoint.resume = 0, "none"
    base.distributed.world_size, base.distributed.rank, base.distributed.master_port = None, None, None
    batch = base.train.batch_size or world_size // (layout.tp * layout.pp) * (base.train.micro_batch_size or 1)
    base.train.batch_size, base.train.grad_accum = batch, None  # the same global batch on both sides

    reference = _copy(base)
    reference.parallel.data_parallel, reference.parallel.tensor_parallel = "ddp", 1
    reference.parallel.pipeline_parallel = 1
    reference.checkpoint.output_dir = str(out_dir / "reference")
    parallel = _copy(base)
    parallel.checkpoint.output_dir = str(out_dir / "parallel")
    if layout.pp > 1:  # a pipeline needs its micro-batches: keep the per-rank split of the config
        parallel.train.grad_accum = cfg.train.grad_accum
    _train(reference, 1, Path(reference.checkpoint.output_dir), out_dir / "reference.log")
    _train(parallel, world_size, Path(parallel.checkpoint.output_dir), out_dir / "parallel.log")
    ref, par = _step_losses(Path(reference.checkpoint.output_dir)), _step_losses(Path(parallel.checkpoint.output_dir))
    report = ParityReport(world_size, layout.describe(),
                          [ParityStep(s, ref[s], par[s]) for s in sorted(ref) if s in par], tolerance)
    (out_dir / "parity.json").write_text(json.dumps(
        {"world_size": world_size, "layout": report.layout, "tolerance": tolerance, "ok": report.ok,
         "max_rel_diff": report.max_rel_diff, "steps": [asdict(s) for s in report.steps]}, indent=2))
    return report


def _copy(cfg: Config) -> Config:
    return config_from_dict(config_to_dict(cfg))
