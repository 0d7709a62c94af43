"""A plan as the console shows it: the layout, memory per rank by part, communication per step,
the step's estimated time, and (--choose) the layouts that fit, fastest first."""

from __future__ import annotations

from lockstep.plan.build import Plan
from lockstep.plan.fake_step import ORDER

GiB = 2**30


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def describe(plan: Plan) -> list[str]:
    lay, b, p, first = plan.layout, plan.batch, plan.profile, plan.ranks[0]
    nodes = -(-lay.world_size // plan.gpus_per_node)
    lines = [
        f"model: {first.full_params / 1e6:,.1f}M parameters; layout {lay.describe()} on {nodes} "
        f"node{'s' if nodes > 1 else ''} of {min(plan.gpus_per_node, lay.world_size)}",
        f"batch: global {b.global_batch} = dp {lay.dp} x micro-batch {b.micro_batch} x "
        f"{b.grad_accum} accumulation step{'s' if b.grad_accum > 1 else ''}, "
        f"{first.shape.tokens_per_sample} tokens a sample; mixed precision "
        f"{plan.cfg.train.mixed_precision}",
        f"device: {p.name}, {p.memory_gib:g} GiB ({p.reserve_gib:g} kept for the CUDA context, "
        f"NCCL and the allocator), {p.bf16_tflops:g} dense bf16 TFLOP/s; {p.source}",
        *[f"note: {n}" for n in first.notes],
        "",
    ]
    return lines + memory_table(plan) + [""] + comm_lines(plan) + [""] + [step_line(plan)]


def memory_table(plan: Plan) -> list[str]:
    heads = [f"rank {r.rank} (stage {r.coords[0]})" for r in plan.ranks]
    width = max(14, *(len(h) for h in heads))
    rows = [
        f"{'memory per rank at the peak (GiB)':<36}" + "".join(f"{h:>{width + 2}}" for h in heads)
    ]
    for part in ORDER:
        values = [r.memory.get(part, 0) for r in plan.ranks]
        if any(values):
            rows.append(f"  {part:<34}" + "".join(f"{gib(v):>{width + 2}}" for v in values))
    rows.append(f"  {'peak':<34}" + "".join(f"{gib(r.peak):>{width + 2}}" for r in plan.ranks))
    if plan.other_checkpointing:
        ac = "with" if not plan.cfg.model.gradient_checkpointing else "without"
        rows.append(
            f"  {f'peak {ac} activation checkpointing':<34}"
            + "".join(f"{gib(r.peak):>{width + 2}}" for r in plan.other_checkpointing)
        )
    for r in {r.estimated: r for r in plan.ranks if r.estimated}.values():
        rows.append(
            "  ESTIMATED by formula (lockstep/plan/formula.py), not simulated: the step cannot "
            f"run on fake tensors ({r.estimated})"
        )
    usable = plan.profile.usable_bytes
    verdict = "fits" if plan.fits else "does NOT fit"
    rows.append(f"  the largest peak {gib(plan.peak)} GiB of {gib(usable)} usable: {verdict}")
    return rows


def comm_lines(plan: Plan) -> list[str]:
    est = plan.estimate
    if not est.collectives:
        return ["communication per step: none (one replica, no shards)"]
    lines = ["communication per step, sent by each rank (ring algorithms)"]
    for c in est.collectives:
        lines.append(
            f"  {c.name:<28} {c.group:<24} {c.bytes / 1e9:9.3f} GB {c.launches:>5} calls "
            f"{c.seconds * 1e3:9.1f} ms   exposed {c.exposed * 1e3:.1f} ms"
        )
    return lines


def step_line(plan: Plan) -> str:
    e = plan.estimate
    bubble = f" + bubble {e.bubble_s * 1e3:.1f} ms" if e.bubble_s else ""
    return (
        f"step (estimated): compute {e.compute_s * 1e3:.1f} ms{bubble} + exposed communication "
        f"{e.exposed_s * 1e3:.1f} ms = {e.step_s * 1e3:.1f} ms; {e.tokens_per_s:,.0f} tokens/s, "
        f"MFU {e.mfu:.0%}"
    )


def choice_lines(plans: list[Plan], refused: list[str]) -> list[str]:
    fit = sorted((p for p in plans if p.fits), key=lambda p: -p.estimate.tokens_per_s)
    lines = [f"layouts compared: {len(plans)} simulated, {len(fit)} fit"]
    for p in fit[:8]:
        ac = ", activation checkpointing" if p.cfg.model.gradient_checkpointing else ""
        reshard = (
            ", no reshard after forward"
            if p.layout.data_parallel == "fsdp" and not p.cfg.parallel.fsdp_reshard_after_forward
            else ""
        )
        if p.layout.data_parallel == "fsdp" and p.cfg.parallel.fsdp_reduce_every_micro_batch:
            reshard += ", reduce-scatter every micro-batch"
        lines.append(
            f"  {p.estimate.tokens_per_s:>14,.0f} tokens/s  peak {gib(p.peak):>7} GiB  "
            f"{p.layout.describe()}, micro-batch {p.batch.micro_batch}{ac}{reshard}"
        )
    lines += [f"  refused: {why}" for why in refused[:8]]
    if fit:
        lines.append(f"best: {fit[0].settings()}")
    return lines
