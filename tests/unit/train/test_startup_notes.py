"""What rank 0 says at start (lockstep/train/startup_notes.py): the batch plan with each number's source, the lr
schedule, and the warnings for a warmup as long as the run and for accumulation nobody asked for."""

from __future__ import annotations

from lockstep.cli import build_parser
from lockstep.cli.train_flags import overrides_from_args
from lockstep.config import load_config
from lockstep.parallel.mesh import plan_world_sizes, resolve_batch, resolve_layout
from lockstep.train.startup_notes import (
    accumulation_warning,
    describe_batch,
    describe_lr,
    startup_warnings,
    warmup_warning,
)


def config(*argv: str, yaml_file=None):
    parser, _ = build_parser()
    return load_config(yaml_file, overrides_from_args(parser.parse_args(["train", *argv])))


def plan_line(cfg, world: int, launcher: str = "torchrun") -> str:
    layout = resolve_layout(cfg.parallel, cfg.model, world)
    return describe_batch(
        resolve_batch(cfg.train, layout.dp), layout, cfg.train, cfg.sources, launcher
    )


def test_the_plan_names_the_source_of_every_number():
    cfg = config("--micro-batch-size", "2")
    assert plan_line(cfg, 2) == (
        "batch plan: global batch 32 (default) = 2 ranks (world size, torchrun) x micro-batch 2 "
        "(--micro-batch-size 2) x 8 accumulation steps (derived: 32 / (2 x 2))"
    )
    cfg = config("--per-device-batch-size", "4", "--world-size", "2")
    assert plan_line(cfg, 2) == (
        "batch plan: global batch 8 (follows the world size: --per-device-batch-size 4) = 2 "
        "ranks (--world-size 2, torchrun) x micro-batch 4 (--per-device-batch-size 4) x 1 "
        "accumulation step (default)"
    )
    cfg = config("--global-batch-size", "64", "--grad-accum", "2")
    assert plan_line(cfg, 4, "slurm") == (
        "batch plan: global batch 64 (--global-batch-size 64) = 4 ranks (world size, "
        "srun) x micro-batch 8 (derived: 64 / (4 x 2)) x 2 accumulation steps "
        "(--grad-accum 2)"
    )
    cfg = config("--set", "parallel.tensor_parallel=2", "--set", "parallel.data_parallel=fsdp")
    assert plan_line(cfg, 4) == (
        "batch plan: global batch 32 (default) = 2 data-parallel replicas (world 4 (world size, "
        "torchrun) / tp 2 x pp 1) x micro-batch 16 (derived: 32 / (2 x 1)) x 1 accumulation "
        "step (default)"
    )


def test_the_lr_line_shows_the_peak_its_scaling_and_the_schedule():
    cfg = config("--learning-rate", "3e-4")
    assert describe_lr(cfg.optim, 3e-4, 32, 100, cfg.sources) == (
        "lr: peak 0.0003 (--learning-rate 3e-4), warmup 50 steps (default), cosine to 0.1 x peak at step 100"
    )
    cfg = config("--lr-scaling", "linear", "--global-batch-size", "16")
    assert describe_lr(cfg.optim, 1e-3, 16, 100, cfg.sources) == (
        "lr: peak 0.001 = optim.learning_rate 0.002 (default) scaled linear by global batch 16 / "
        "optim.reference_batch_size 32, warmup 50 steps (default), cosine to 0.1 x peak at step 100"
    )


def test_a_warmup_longer_than_the_run_says_the_peak_is_never_reached():
    cfg = config("--warmup-steps", "500", "--max-steps", "100")
    plan = resolve_batch(cfg.train, 1)
    assert warmup_warning(cfg.train, cfg.optim, plan, 100, 10_000, 1e-3, cfg.sources) == (
        "optim.warmup_steps = 500 (--warmup-steps 500) is longer than the run's 100 optimizer steps (train.max_steps): "
        "the learning rate never reaches its peak 0.001: it ramps up for the whole run, ends at 0.0002 (100/500 of "
        "the peak) and never decays; set --warmup-steps to a share of the run (e.g. 10, a tenth), or train longer "
        "(--max-steps / --epochs)"
    )
    equal = warmup_warning(cfg.train, cfg.optim, plan, 500, 10_000, 1e-3, cfg.sources)
    assert (
        "equals the run's 500 optimizer steps" in equal
        and "only on the last step and never decays" in equal
    )
    # peak at step 500
    assert warmup_warning(cfg.train, cfg.optim, plan, 501, 10_000, 1e-3, cfg.sources) is None


def test_an_epoch_run_says_how_its_steps_were_counted():
    cfg = config("--epochs", "1")  # default warmup 50; 640 samples / 32 = 20 steps
    plan = resolve_batch(cfg.train, 2)
    text = warmup_warning(cfg.train, cfg.optim, plan, 20, 640, 1e-3, cfg.sources)
    assert (
        "optim.warmup_steps = 50 (default) is longer than the run's 20 optimizer steps (train.epochs 1 x 20 "
        "steps per epoch: 640 samples / global batch 32)" in text
    )


def test_accumulation_nobody_asked_for_is_said_with_the_ways_out():
    cfg = config("--micro-batch-size", "2")
    plan = resolve_batch(cfg.train, 2)
    assert accumulation_warning(cfg.train, plan, cfg.set_keys, cfg.sources) == (
        "8 gradient-accumulation steps per optimizer step that nothing asked for: the global batch 32 is lockstep's "
        "default (train.batch_size, samples per step over all ranks), and micro-batch 2 (--micro-batch-size 2) on 2 "
        "ranks covers 4 of it per forward, so every step runs 8 forward and backward passes per rank. For no "
        "accumulation pass --global-batch-size 4 (the global batch = ranks x 2), or --per-device-batch-size 2 instead "
        "(the HF Trainer way: the global batch follows the world size); to keep 32 and accumulate on purpose pass "
        "--global-batch-size 32 or --grad-accum 8"
    )
    for asked in (
        config("--micro-batch-size", "2", "--grad-accum", "8"),  # accumulation asked for
        config("--micro-batch-size", "2", "--global-batch-size", "32"),  # both numbers given
        config("--per-device-batch-size", "2"),
    ):  # HF way: no accumulation
        assert (
            accumulation_warning(
                asked.train, resolve_batch(asked.train, 2), asked.set_keys, asked.sources
            )
            is None
        )


def test_an_elastic_jobs_workers_do_not_warn_about_the_accumulation_of_a_smaller_world():
    cfg = config("--per-device-batch-size", "4")
    overrides, plans = plan_world_sizes(cfg, [4, 8])
    assert plans[4].grad_accum == 2  # at 4 of 8 ranks, two accumulation steps keep the global batch
    worker = config(
        *(a for k, v in overrides.items() for a in ("--set", f"{k}={'none' if v is None else v}"))
    )
    plan = resolve_batch(worker.train, 4)
    assert (plan.global_batch, plan.grad_accum) == (32, 2)
    assert (
        startup_warnings(
            worker.train, worker.optim, plan, 1000, 10_000, 1e-3, worker.set_keys, worker.sources
        )
        == []
    )


def test_a_plain_run_has_nothing_to_warn_about():
    cfg = config()
    plan = resolve_batch(cfg.train, 2)
    assert (
        startup_warnings(cfg.train, cfg.optim, plan, 1000, 10_000, 1e-3, cfg.set_keys, cfg.sources)
        == []
    )


def test_the_lr_line_names_the_schedule_and_a_warmup_ratio_in_steps():
    cfg = config("--lr-schedule", "linear", "--min-lr-ratio", "0", "--warmup-ratio", "0.05")
    assert describe_lr(cfg.optim, 2e-3, 32, 590, cfg.sources) == (
        "lr: peak 0.002 (default), warmup 30 steps (optim.warmup_ratio 0.05 x 590 steps, rounded "
        "up; --warmup-ratio 0.05), linear to 0 x peak at step 590"
    )  # 29.5 -> 30, as HF rounds
    cfg = config("--lr-schedule", "constant", "--warmup-steps", "10")
    assert describe_lr(cfg.optim, 2e-3, 32, 100, cfg.sources) == (
        "lr: peak 0.002 (default), warmup 10 steps (--warmup-steps 10), then constant"
    )


def test_the_warmup_warning_counts_a_ratio_in_steps():
    cfg = config("--warmup-ratio", "0.95", "--max-steps", "10")  # 9.5 rounds up to the whole run
    plan = resolve_batch(cfg.train, 1)
    assert warmup_warning(cfg.train, cfg.optim, plan, 10, 10_000, 1e-3, cfg.sources) == (
        "warmup 10 steps (optim.warmup_ratio 0.95 x 10 steps, rounded up; --warmup-ratio 0.95) "
        "equals the run's 10 optimizer steps (train.max_steps): the learning rate reaches its peak "
        "0.001 only on the last step and never decays; set --warmup-ratio to a smaller share of "
        "the run (e.g. 0.1, a tenth), or train longer (--max-steps / --epochs)"
    )
    # the default warmup_steps 50 is replaced by the ratio: 0.1 of 20 steps warns of nothing
    short = config("--warmup-ratio", "0.1", "--max-steps", "20")
    assert warmup_warning(short.train, short.optim, plan, 20, 10_000, 1e-3, short.sources) is None
