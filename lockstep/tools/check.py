"""`lockstep check CONFIG`: the DDP compatibility check on its own, with a verdict a user can act on.

On every rank: build the workload, take the first `parallel.check_steps` steps' micro-batches
(the same ones training would read first), find the parameters each step leaves without a
gradient, choose the DDP settings, then run those steps again under DDP with that choice and
compare gradient hashes across ranks, and the buffers (BatchNorm statistics) they hold after them.
Rank 0 prints the report and writes RUN/ddp_check.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from lockstep.config import Config
from lockstep.data.batch import move_to_device
from lockstep.data.sampler import Cursor, rank_micro_batches, step_indices
from lockstep.errors import GradientDivergence, UnusedParameterError
from lockstep.parallel.buffers import (
    check_sync_batchnorm,
    convert_sync_batchnorm,
    differing_buffers,
    explain_buffers,
)
from lockstep.parallel.ddp import UsageGuard, apply_ddp
from lockstep.parallel.ddp_check import (
    DDPChoice,
    UsageReport,
    check_gradients_agree,
    choose_ddp_options,
    find_unused_parameters,
    gather_usage,
)
from lockstep.parallel.mesh import resolve_batch
from lockstep.rank_logs import init_rank_logging
from lockstep.rng import seed_everything
from lockstep.runtime import init_runtime, shutdown_runtime
from lockstep.train.step import build_autocast
from lockstep.train.workload import build_workload


@dataclass
class CheckResult:
    report: UsageReport
    choice: DDPChoice
    agreed: bool  # gradients identical on every rank after each step under DDP with the choice
    problem: str | None  # what went wrong under DDP, if anything
    # which buffers differ between ranks after those steps, and why (None: 1 rank)
    buffers: str | None = None


def run_check(cfg: Config) -> CheckResult:
    rt = init_runtime(cfg.distributed)
    run_dir = Path(cfg.checkpoint.output_dir)
    log = init_rank_logging(run_dir, rt.rank, rt.is_main)
    try:
        return _check(cfg, rt, run_dir, log)
    finally:
        shutdown_runtime(rt)


def _check(cfg: Config, rt, run_dir: Path, log: logging.Logger) -> CheckResult:
    steps_wanted = cfg.parallel.check_steps or 2
    plan = resolve_batch(cfg.train, rt.world_size)
    seed_everything(cfg.train.seed)
    wl = build_workload(cfg, rt, run_dir, log)
    model = wl.model.to(rt.device)
    check_sync_batchnorm(cfg.parallel.sync_batchnorm, "ddp", rt.device, rt.world_size)
    if cfg.parallel.sync_batchnorm and rt.distributed:
        convert_sync_batchnorm(model)  # as training does, before DDP
    autocast = build_autocast(cfg.train.mixed_precision, rt.device)
    lengths, n = wl.lengths, len(wl.train_ds)
    steps, cursor = [], Cursor()
    for _ in range(steps_wanted):
        indices, cursor = step_indices(n, cfg.train.seed, cursor, plan.global_batch, lengths)
        steps.append(
            [
                move_to_device(wl.collate([wl.train_ds[int(i)] for i in mb]), rt.device)
                for mb in rank_micro_batches(indices, plan, rt.rank)
            ]
        )
    seed_everything(cfg.train.seed + rt.rank)
    unused, opaque = find_unused_parameters(model, steps, wl.loss, autocast)
    report = gather_usage(rt, unused, sum(p.requires_grad for p in model.parameters()), opaque)
    choice = choose_ddp_options(report, cfg.parallel, plan.grad_accum, wl.uses_all_parameters)
    agreed, problem, buffers = True, None, None
    if rt.distributed:
        ddp_model = apply_ddp(
            model,
            rt,
            wl.loss,
            choice.find_unused_parameters,
            choice.static_graph,
            broadcast_buffers=cfg.parallel.broadcast_buffers,
        )
        # the guard turns a setting that these batches prove wrong into a report instead of a hang
        guard = (
            UsageGuard(rt, model, choice.static_graph, choice.reason) if choice.guarded else None
        )
        try:
            for number, micro_batches in enumerate(steps, start=1):
                model.zero_grad(set_to_none=True)
                for i, batch in enumerate(micro_batches):
                    last = i == len(micro_batches) - 1
                    with contextlib.nullcontext() if last else ddp_model.no_sync():
                        with autocast:
                            loss = ddp_model(batch)
                        if last and guard is not None:
                            guard(loss, number)
                        loss.backward()
                check_gradients_agree(rt, model, number)
            differ = differing_buffers(rt, model)
            buffers = (
                explain_buffers(differ, cfg.parallel.broadcast_buffers)
                if differ
                else (f"every rank holds the same {sum(1 for _ in model.buffers())} buffer(s)")
            )
        except (GradientDivergence, UnusedParameterError, RuntimeError) as e:
            agreed, problem = False, f"{type(e).__name__}: {e}"
        finally:
            model.zero_grad(set_to_none=True)
    result = CheckResult(report, choice, agreed, problem, buffers)
    if rt.is_main:
        verdict = (
            "DDP with these settings ran the checked steps and every rank held identical gradients"
            if agreed and rt.distributed
            else "one process: DDP was not exercised; run with --world-size 2 or more to test it"
            if agreed
            else f"DDP FAILED with these settings: {problem}"
        )
        text = (
            f"{report.format()}\nchoice: find_unused_parameters={choice.find_unused_parameters}, "
            f"static_graph={choice.static_graph} ({choice.reason})\n"
            + (f"note: {choice.hint}\n" if choice.hint else "")
            + verdict
            + (f"\nbuffers after the checked steps: {buffers}" if buffers else "")
        )
        print(text, flush=True)
        out = run_dir / "ddp_check.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "report": asdict(report),
                    "choice": asdict(choice),
                    "agreed": agreed,
                    "problem": problem,
                    "buffers": buffers,
                    "world_size": rt.world_size,
                },
                indent=2,
            )
        )
    return result
