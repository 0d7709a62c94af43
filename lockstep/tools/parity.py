"""`lockstep parity CONFIG`: the same seed and global batch for K steps on 1 process and on N, losses compared.

Both runs are ordinary `lockstep train` runs (subprocesses), so what is compared is exactly what
training does: the reference on one process with plain data parallelism off, the other with the
config's layout (ddp / fsdp / tp / pp) on N processes. Both log every step; the per-step loss
difference is the report. With fp32 the runs differ only by the order of floating-point sums
(all-reduce, sharded matmuls); bf16 autocast or dropout widen the gap, and the report says so.

The reference config does not depend on the layout, so one reference run serves every layout:
`reference_dir` (`lockstep parity --reference DIR`) compares against an earlier run's reference
instead of training it again, once its parity-config.yaml is the one this comparison would train.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from lockstep.config import Config, ParallelConfig, config_from_dict, config_to_dict
from lockstep.config.overrides import flatten
from lockstep.errors import ConfigError

if TYPE_CHECKING:
    from lockstep.parallel.mesh import Layout


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
    reference: str = ""  # the 1-process run's folder
    reused: bool = False  # True: an earlier run's reference (--reference), not trained by this one

    @property
    def max_rel_diff(self) -> float:
        return max((s.rel_diff for s in self.steps), default=math.inf)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and self.max_rel_diff <= self.tolerance

    def format(self) -> str:
        lines = [f"parity: 1 process vs {self.world_size} ({self.layout}), {len(self.steps)} steps"]
        if self.reused:
            lines.append(f"reference: {self.reference} (an earlier run's: not trained again)")
        lines.append("step  loss (1 proc)  loss (N procs)  abs diff   rel diff")
        lines += [
            f"{s.step:>4}  {s.reference:>13.6f}  {s.parallel:>14.6f}  {s.abs_diff:.2e}  {s.rel_diff:.2e}"
            for s in self.steps
        ]
        verdict = "within" if self.ok else "OUTSIDE"
        lines.append(
            f"max relative difference {self.max_rel_diff:.2e}: {verdict} the tolerance {self.tolerance:g}"
        )
        return "\n".join(lines)


def _step_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: r["loss"] for r in rows if r.get("split", "train") == "train" and "loss" in r
    }


def write_run_config(cfg: Config, run_dir: Path) -> Path:
    """run_dir/parity-config.yaml: a parity run's config, as `lockstep train --config` reads it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "parity-config.yaml"
    config_file.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return config_file


def _train(cfg: Config, world_size: int, run_dir: Path, log: Path) -> None:
    config_file = write_run_config(cfg, run_dir)
    cmd = [
        sys.executable,
        "-m",
        "lockstep",
        "train",
        "--config",
        str(config_file),
        "--world-size",
        str(world_size),
    ]
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(
            f"the {world_size}-process run failed (exit {proc.returncode}); see {log}"
        )


def parity_configs(
    cfg: Config, world_size: int, steps: int, out_dir: Path
) -> tuple[Config, Config, Layout]:
    """(reference, parallel, layout): the 1-process and the `world_size`-process configs of parity.

    The reference is the same whatever the layout: ddp on 1 process, tp 1, pp 1, the same seed,
    steps and global batch, and the layout-only keys (pipeline_schedule and
    fsdp_reshard_after_forward: read only at pp > 1 / with fsdp) at their defaults, so that one
    reference run serves every layout."""
    from lockstep.parallel.mesh import resolve_layout

    layout = resolve_layout(cfg.parallel, cfg.model, world_size)
    base = _copy(cfg)
    base.train.max_steps, base.train.epochs = steps, None
    base.train.log_interval, base.train.eval_interval, base.train.sample_tokens = 1, 0, 0
    base.data.eval_fraction = min(base.data.eval_fraction, 0.02)
    base.checkpoint.save_interval, base.checkpoint.resume = 0, "none"
    base.distributed.world_size, base.distributed.rank, base.distributed.master_port = (
        None,
        None,
        None,
    )
    replicas = world_size // (layout.tp * layout.pp)
    batch = base.train.batch_size or replicas * (base.train.micro_batch_size or 1)
    # the same global batch on both sides
    base.train.batch_size, base.train.grad_accum = (batch, None)

    reference = _copy(base)
    reference.parallel.data_parallel, reference.parallel.tensor_parallel = "ddp", 1
    reference.parallel.pipeline_parallel = 1
    defaults = ParallelConfig()
    reference.parallel.pipeline_schedule = defaults.pipeline_schedule
    reference.parallel.fsdp_reshard_after_forward = defaults.fsdp_reshard_after_forward
    reference.checkpoint.output_dir = str(out_dir / "reference")
    parallel = _copy(base)
    parallel.checkpoint.output_dir = str(out_dir / "parallel")
    if layout.pp > 1:  # a pipeline needs its micro-batches: keep the per-rank split of the config
        parallel.train.grad_accum = cfg.train.grad_accum
    return reference, parallel, layout


_REUSE_FIX = "or drop --reference to train the 1-process reference"


def reference_losses(reference: Config, run_dir: Path, steps: int) -> dict[int, float]:
    """The losses of an earlier parity's reference run in `run_dir`, or a ConfigError when that
    run is not the one `reference` describes (output_dir aside) or logged fewer than `steps`."""
    for name in ("parity-config.yaml", "metrics.jsonl"):
        if not (run_dir / name).is_file():
            raise ConfigError(
                f"--reference {run_dir}: no {name} there; --reference takes the parity/reference "
                "folder of an earlier `lockstep parity` (it holds parity-config.yaml and "
                f"metrics.jsonl): pass that folder, {_REUSE_FIX}"
            )
    config_file = run_dir / "parity-config.yaml"
    try:
        tree = yaml.safe_load(config_file.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--reference {run_dir}: {config_file} is not valid YAML: {e}; {_REUSE_FIX}"
        ) from None
    if not isinstance(tree, dict):
        raise ConfigError(
            f"--reference {run_dir}: {config_file} holds no mapping of config sections; "
            f"{_REUSE_FIX}"
        )
    theirs = flatten(config_to_dict(config_from_dict(tree, str(config_file))), str(config_file))
    ours = flatten(config_to_dict(reference), "reference")
    differing = [k for k in ours if k != "checkpoint.output_dir" and theirs.get(k) != ours[k]]
    if differing:
        shown = "; ".join(f"{k} = {theirs[k]!r} there, {ours[k]!r} here" for k in differing[:3])
        more = f" (and {len(differing) - 3} more keys)" if len(differing) > 3 else ""
        raise ConfigError(
            f"--reference {run_dir} trained another config than this comparison's reference: "
            f"{shown}{more}; the reference must be the run this parity would train (same model, "
            "data, seed, steps and global batch; only its output_dir may differ): pass the options "
            f"of that run, {_REUSE_FIX}"
        )
    losses = _step_losses(run_dir)
    missing = [s for s in range(1, steps + 1) if s not in losses]
    if missing:
        raise ConfigError(
            f"--reference {run_dir} logged the loss of {steps - len(missing)} of the --steps "
            f"{steps} steps (none at step {missing[0]}): the reference needs every step compared, "
            f"and that run did not finish (see its logs/): pass a finished one, {_REUSE_FIX}"
        )
    return losses


def run_parity(
    cfg: Config,
    world_size: int,
    steps: int,
    out_dir: Path,
    tolerance: float,
    reference_dir: Path | None = None,
) -> ParityReport:
    """Train `steps` steps on 1 process and on `world_size` processes from the same seed; compare.

    With `reference_dir` (an earlier run's parity/reference folder) only the parallel run is
    trained, once reference_losses accepts that folder; the report compares against it."""
    reference, parallel, layout = parity_configs(cfg, world_size, steps, out_dir)
    reused = reference_dir is not None
    if reference_dir is not None:
        ref = reference_losses(reference, reference_dir, steps)  # refuses before anything runs
        out_dir.mkdir(parents=True, exist_ok=True)
    else:
        reference_dir = Path(reference.checkpoint.output_dir)
        _train(reference, 1, reference_dir, out_dir / "reference.log")
        ref = _step_losses(reference_dir)
    parallel_dir = Path(parallel.checkpoint.output_dir)
    _train(parallel, world_size, parallel_dir, out_dir / "parallel.log")
    par = _step_losses(parallel_dir)
    report = ParityReport(
        world_size,
        layout.describe(),
        [ParityStep(s, ref[s], par[s]) for s in sorted(ref) if s in par],
        tolerance,
        str(reference_dir),
        reused,
    )
    (out_dir / "parity.json").write_text(
        json.dumps(
            {
                "world_size": world_size,
                "layout": report.layout,
                "tolerance": tolerance,
                "ok": report.ok,
                "max_rel_diff": report.max_rel_diff,
                "reference": report.reference,
                "reference_reused": reused,
                "steps": [asdict(s) for s in report.steps],
            },
            indent=2,
        )
    )
    return report


def _copy(cfg: Config) -> Config:
    return config_from_dict(config_to_dict(cfg))
