"""What rank 0 says once at start: the batch plan with where each number came from, and settings that surprise.

    batch plan: global batch 32 (default) = 2 ranks (world size, torchrun) x micro-batch 2 (--micro-batch-size 2)
    x 8 accumulation steps (derived: 32 / (2 x 2))

A number's source is the flag as typed, `--set KEY=V`, the YAML file, "default", or the arithmetic that derived
it (lockstep.parallel.mesh.resolve_batch). The warnings name the numbers and the fix:

- warmup as long as the run or longer: the learning rate never leaves warmup (lockstep.optim.lr_at reaches
  the peak at step warmup, 1-based; warmup is optim.warmup_steps, or optim.warmup_ratio x the
  run's steps rounded up: lockstep.optim.warmup_steps_for) and never decays;
- accumulation nobody asked for: a micro-batch set against lockstep's default global batch (the trap of a
  per-device batch given as --micro-batch-size).
"""

from __future__ import annotations

from lockstep.config import OptimConfig, TrainConfig
from lockstep.data.sampler import steps_per_epoch
from lockstep.optim import warmup_steps_for
from lockstep.parallel.mesh import BatchPlan, Layout

LAUNCHERS = {
    "torchrun": "torchrun",
    "slurm": "srun",
    "manual": "started by hand",
    "none": "one process",
}


def describe_batch(
    plan: BatchPlan, layout: Layout, train: TrainConfig, sources: dict[str, str], launcher: str
) -> str:
    """`batch plan: global batch G (source) = R ranks (source) x micro-batch M (source) x A accumulation steps (source)`."""
    g, w, mb, acc = plan.global_batch, plan.world_size, plan.micro_batch, plan.grad_accum
    if train.batch_size is not None:
        global_text = f"global batch {g} ({sources.get('train.batch_size', 'default')})"
    else:
        why = sources.get("train.batch_size", "train.batch_size none")
        global_text = f"global batch {g} (follows the world size: {why})"
    how = LAUNCHERS.get(launcher, launcher)
    world_src = (
        f"{sources['distributed.world_size']}, {how}"
        if "distributed.world_size" in sources
        else f"world size, {how}"
    )
    if layout.dp == layout.world_size:
        ranks = f"{w} rank{'s' if w > 1 else ''} ({world_src})"
    else:
        ranks = (
            f"{w} data-parallel replica{'s' if w > 1 else ''} (world {layout.world_size} ({world_src}) / "
            f"tp {layout.tp} x pp {layout.pp})"
        )
    if train.micro_batch_size is not None:
        micro = f"micro-batch {mb} ({sources.get('train.micro_batch_size', 'default')})"
    else:
        micro = f"micro-batch {mb} (derived: {g} / ({w} x {acc}))"
    steps = f"{acc} accumulation step{'s' if acc > 1 else ''}"
    if train.grad_accum is not None:
        accum = f"{steps} ({sources.get('train.grad_accum', 'default')})"
    elif train.batch_size is None or train.micro_batch_size is None:
        accum = f"{steps} (default)"
    else:
        accum = f"{steps} (derived: {g} / ({w} x {mb}))"
    return f"batch plan: {global_text} = {ranks} x {micro} x {accum}"


def describe_lr(
    optim: OptimConfig, lr: float, global_batch: int, total_steps: int, sources: dict[str, str]
) -> str:
    """`lr: peak 0.002 (default), warmup 50 steps (default), cosine to 0.1 x peak at step 600`."""
    src = sources.get("optim.learning_rate", "default")
    if optim.lr_scaling == "none" or lr == optim.learning_rate:
        peak = f"peak {lr:.3g} ({src})"
    else:
        peak = (
            f"peak {lr:.3g} = optim.learning_rate {optim.learning_rate:.3g} ({src}) scaled {optim.lr_scaling} by "
            f"global batch {global_batch} / optim.reference_batch_size {optim.reference_batch_size}"
        )
    warmup = f"warmup {describe_warmup(optim, total_steps, sources)}"
    if optim.schedule == "constant":
        return f"lr: {peak}, {warmup}, then constant"
    decay = f"{optim.schedule} to {optim.min_lr_ratio:g} x peak at step {total_steps}"
    return f"lr: {peak}, {warmup}, {decay}"


def describe_warmup(optim: OptimConfig, total_steps: int, sources: dict[str, str]) -> str:
    """`50 steps (default)`, or for a ratio `30 steps (optim.warmup_ratio 0.05 x 600 steps,
    rounded up; --warmup-ratio 0.05)`."""
    steps = warmup_steps_for(optim, total_steps)
    if optim.warmup_ratio is None:
        return f"{steps} steps ({sources.get('optim.warmup_steps', 'default')})"
    src = sources.get("optim.warmup_ratio", "optim.warmup_ratio")
    share = f"optim.warmup_ratio {optim.warmup_ratio:g} x {total_steps} steps"
    return f"{steps} steps ({share}, rounded up; {src})"


def startup_warnings(
    train: TrainConfig,
    optim: OptimConfig,
    plan: BatchPlan,
    total_steps: int,
    num_samples: int,
    lr: float,
    set_keys: set[str],
    sources: dict[str, str],
) -> list[str]:
    """The surprises of this run's settings, each a message with the numbers and the fix; [] when none."""
    out = []
    warmup = warmup_warning(
        train, optim, plan, total_steps, num_samples=num_samples, lr=lr, sources=sources
    )
    if warmup:
        out.append(warmup)
    accumulation = accumulation_warning(train, plan, set_keys, sources)
    if accumulation:
        out.append(accumulation)
    return out


def warmup_warning(
    train: TrainConfig,
    optim: OptimConfig,
    plan: BatchPlan,
    total_steps: int,
    num_samples: int,
    lr: float,
    sources: dict[str, str],
) -> str | None:
    """Step k (0-based) trains at lr x (k+1)/warmup during warmup: the peak is reached at step `warmup` (1-based)."""
    warmup = warmup_steps_for(optim, total_steps)
    if warmup < total_steps or warmup == 0:
        return None
    if optim.warmup_ratio is None:
        said = f"optim.warmup_steps = {warmup} ({sources.get('optim.warmup_steps', 'default')})"
        tenth = max(1, total_steps // 10)
        fix = f"set --warmup-steps to a share of the run (e.g. {tenth}, a tenth)"
    else:  # a ratio rounds up to the whole run only when it is near 1 (0.95 of 10 steps)
        said = f"warmup {describe_warmup(optim, total_steps, sources)}"
        fix = "set --warmup-ratio to a smaller share of the run (e.g. 0.1, a tenth)"
    run = _run_length(train, plan, total_steps, num_samples)
    fix += ", or train longer (--max-steps / --epochs)"
    if warmup == total_steps:
        return (
            f"{said} equals the run's {run}: the learning rate reaches its peak "
            f"{lr:.3g} only on the last step and never decays; {fix}"
        )
    return (
        f"{said} is longer than the run's {run}: the learning rate never "
        f"reaches its peak {lr:.3g}: it ramps up for the whole run, ends at {lr * total_steps / warmup:.3g} "
        f"({total_steps}/{warmup} of the peak) and never decays; {fix}"
    )


def _run_length(train: TrainConfig, plan: BatchPlan, total_steps: int, num_samples: int) -> str:
    if train.epochs and total_steps != train.max_steps:
        per_epoch = steps_per_epoch(num_samples, plan.global_batch)
        return (
            f"{total_steps} optimizer steps (train.epochs {train.epochs:g} x {per_epoch} steps per epoch: "
            f"{num_samples} samples / global batch {plan.global_batch})"
        )
    return f"{total_steps} optimizer steps (train.max_steps)"


def accumulation_warning(
    train: TrainConfig, plan: BatchPlan, set_keys: set[str], sources: dict[str, str]
) -> str | None:
    """Accumulation that follows from a micro-batch set against lockstep's default global batch.

    Said only when neither train.grad_accum nor train.batch_size was set: a user who set both the global batch
    and the micro-batch asked for their quotient (the plan line shows it), and an elastic job's workers get the
    launcher's explicit `train.grad_accum=none` (accumulation that makes up for missing ranks is the plan).
    """
    g, w, mb, acc = plan.global_batch, plan.world_size, plan.micro_batch, plan.grad_accum
    if (
        acc <= 1
        or "train.grad_accum" in set_keys
        or "train.batch_size" in set_keys
        or train.batch_size is None
    ):
        return None
    src = sources.get("train.micro_batch_size", "train.micro_batch_size")
    return (
        f"{acc} gradient-accumulation steps per optimizer step that nothing asked for: the global batch {g} is "
        f"lockstep's default (train.batch_size, samples per step over all ranks), and micro-batch {mb} ({src}) on "
        f"{w} rank{'s' if w > 1 else ''} covers {w * mb} of it per forward, so every step runs {acc} forward and "
        f"backward passes per rank. For no accumulation pass --global-batch-size {w * mb} (the global batch "
        f"= ranks x {mb}), or --per-device-batch-size {mb} instead (the HF Trainer way: the global batch follows "
        f"the world size); to keep {g} and accumulate on purpose pass --global-batch-size {g} or --grad-accum {acc}"
    )
