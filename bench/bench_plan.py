"""`lockstep plan` against real runs on this CPU: predicted vs measured peak memory per rank, and
step time.

    python bench/bench_plan.py            # every case; rewrites its BENCHMARKS.md section
    python bench/bench_plan.py --quick    # the default GPT's cases only; prints, writes nothing

The prediction is lockstep.plan.simulate.simulate_rank (fake tensors, torch's fake process group,
torch's memory trackers). The measurement is the same layout run for real: W processes in a gloo
group, the GPT built and sharded by lockstep's own code (apply_parallelism, DDP through
lockstep.parallel.ddp.apply_ddp), three optimizer steps of lockstep.train.step; each rank's peak
resident set (ru_maxrss) less its resident set before the model is built, glibc returning freed
blocks of 64 KiB and more to the system so that the resident set follows the live tensors. It
counts what the plan leaves out too (Python objects the run makes, gloo's buffers, the model's
unsharded build before FSDP shards it). torch.profiler's memory events were tried first and
dropped: most likely they miss the frees on threads the profiler does not follow, and they read
FSDP's real 2-rank run at 131-134 MiB where torch's FSDPMemTracker on that same run counted 56.0
and the resident set grew 87. A second measurement, of the tensors alone: torch's MemTracker
(FSDPMemTracker under FSDP) over a fourth real step, the same trackers the plan runs on its fake
step, here on real tensors (it is entered after the resident peak is read: its bookkeeping is not
in it). Where the model is tens of MiB the resident set's other growth outweighs the model; the
tracked peak says what the plan's own part is worth there.

The step time predicted is lockstep.plan.estimate's on the profile `lockstep doctor --nproc N
--json` measures on this machine (as docs/plan.md tells a user to: the ranks' bf16 matmul peak,
gloo's all-reduce bus bandwidth; one thread a rank, as here), N the case's ranks (2 for one
process: the doctor needs two to measure a link); measured: the fastest of steps 2 and 3 of the
real run (the first step allocates AdamW's state), the slowest rank's. Nothing is a threshold.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

BEGIN = "<!-- bench_plan:begin (written by bench/bench_plan.py; edits between the markers are replaced) -->"
END = "<!-- bench_plan:end -->"
DEFAULT = {}  # lockstep's default GPT (hidden 256, 4 layers, 128 tokens)
GPT2 = {
    "model.hidden_size": 768,
    "model.attention_heads": 12,
    "model.layers": 12,
    "model.max_seq_length": 256,
    "model.vocab_size": 50304,
}
GPT2_NAME = "GPT-2 124M, 256 tokens"
LAYOUTS = {  # the degree: the case's ranks
    "ddp": {},
    "fsdp": {"parallel.data_parallel": "fsdp"},
    "tp": {"parallel.tensor_parallel": None},
    "pp": {"parallel.pipeline_parallel": None, "parallel.pipeline_schedule": "gpipe"},
}
CASES = [
    ("default GPT", DEFAULT, "ddp", 1),
    ("default GPT", DEFAULT, "ddp", 2),
    ("default GPT", DEFAULT, "fsdp", 2),
    ("default GPT", DEFAULT, "tp", 2),
    ("default GPT", DEFAULT, "pp", 2),
    ("default GPT", DEFAULT, "ddp", 4),
    ("default GPT", DEFAULT, "fsdp", 4),
    ("default GPT", DEFAULT, "tp", 4),
    ("default GPT", DEFAULT, "pp", 4),
    *((GPT2_NAME, GPT2, layout, 2) for layout in LAYOUTS),
    ("GPT-2 124M, 256 tokens", GPT2, "ddp", 1),
    *((GPT2_NAME, GPT2, layout, 4) for layout in LAYOUTS),
]


def config(model: dict, layout: str, world: int):
    from lockstep.config import load_config

    sets = {
        **model,
        **{key: world if value is None else value for key, value in LAYOUTS[layout].items()},
        "train.batch_size": None,
        "train.micro_batch_size": 2,
        "train.grad_accum": 2,
        "train.mixed_precision": "no",
    }
    return load_config(None, sets)


def resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rank(rank: int, world: int, port: int, model: dict, layout: str, out: str) -> None:
    from lockstep.models.gpt import batch_loss, build_gpt
    from lockstep.models.loss import Loss
    from lockstep.optim import build_optimizer
    from lockstep.parallel.apply import apply_parallelism
    from lockstep.parallel.ddp import LossModule, apply_ddp
    from lockstep.parallel.mesh import check_layout, resolve_batch
    from lockstep.plan.trackers import step_tracker
    from lockstep.runtime.group import Runtime
    from lockstep.train.step import pipeline_step, train_step

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    rt = Runtime(
        rank,
        rank,
        world,
        world,
        0,
        torch.device("cpu"),
        "gloo" if world > 1 else None,
        "bench",
        "h",
    )
    cfg = config(model, layout, world)
    lay = check_layout(cfg, world)
    plan = resolve_batch(cfg.train, lay.dp)
    loss = Loss(batch_loss)
    # what the run imports on its way, imported before the baseline: modules are memory too
    for module in ("fsdp", "pipelining", "tensor.parallel"):
        importlib.import_module(f"torch.distributed.{module}")

    base = resident()
    torch.manual_seed(0)
    gpt = build_gpt(cfg.model)
    pipeline = apply_parallelism(
        gpt,
        lay,
        rt,
        cfg.parallel,
        mixed_precision="no",
        autocast=contextlib.nullcontext(),
        grad_accum=plan.grad_accum,
        uses_all_parameters=True,
    )
    wrapped = LossModule(gpt, loss)
    if lay.dp > 1 and lay.data_parallel == "ddp":
        wrapped = apply_ddp(gpt, rt, loss)
    optimizer = build_optimizer(gpt, cfg.optim, 1e-4, "cpu")
    seq, vocab = cfg.model.max_seq_length, cfg.model.vocab_size

    def step() -> None:
        batches = [
            (torch.randint(0, vocab, (plan.micro_batch, seq)),) * 2 for _ in range(plan.grad_accum)
        ]
        if pipeline is not None:
            pipeline_step(pipeline, optimizer, batches, rt.device, cfg.optim.gradient_clip_norm)
        else:
            train_step(
                wrapped,
                gpt,
                optimizer,
                batches,
                rt,
                grad_accum=plan.grad_accum,
                clip_norm=cfg.optim.gradient_clip_norm,
                loss=loss,
            )

    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    grown = peak_resident() - base
    # a fourth step under torch's memory tracker, as the plan tracks its fake one: the tensors'
    # own peak, without the resident set's other growth (after the resident peak is read)
    tracker = step_tracker(gpt, optimizer, fsdp=lay.data_parallel == "fsdp" and lay.dp > 1)
    top = wrapped if pipeline is None else pipeline.stage.submod

    def each_micro_batch(module, args) -> None:  # the trackers take one forward of a module a step
        if module is top:
            tracker.reset_mod_stats()  # (the peak stays), as the plan's fake step does

    # registered before the tracker's own global hooks (entering it), so it runs first
    hook = torch.nn.modules.module.register_module_forward_pre_hook(each_micro_batch)
    with tracker:
        step()
    hook.remove()
    tracked = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    torch.save((grown, min(times[1:]), tracked), f"{out}.{rank}")
    if world > 1:
        dist.destroy_process_group()


def measure(model: dict, layout: str, world: int) -> list[tuple[int, float, int]]:
    """Each rank's (peak resident growth, step seconds, tracked tensors' peak)."""
    from lockstep.runtime import free_port

    port = free_port()
    # glibc returns blocks of 64 KiB and more to the system when they are freed: the resident set
    # follows the live tensors instead of keeping their high-water mark in its free lists
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, (world, port, model, layout, f"{tmp}/peak"), nprocs=world, start_method="spawn"
        )
        return [torch.load(f"{tmp}/peak.{r}") for r in range(world)]


def predict(model: dict, layout: str, world: int, profile) -> tuple[list[int], float]:
    """Each rank's simulated peak, and the step's estimated seconds on `profile`."""
    from lockstep.parallel.mesh import check_layout, resolve_batch
    from lockstep.plan.build import make_plan
    from lockstep.plan.simulate import simulate_rank

    cfg = config(model, layout, world)
    lay = check_layout(cfg, world)
    plan = resolve_batch(cfg.train, lay.dp)
    step = make_plan(cfg, world, world, profile, other=False).estimate.step_s
    return [simulate_rank(cfg, lay, plan, r).peak for r in range(world)], step


def doctor_profile(ranks: int):
    """This machine at `ranks` processes as `lockstep doctor --json` measures it
    (lockstep.plan.profiles' profile_from_doctor); its exit status is not read (a CPU's report
    warns of things)."""
    from lockstep.plan.profiles import profile_from_doctor

    command = [sys.executable, "-m", "lockstep", "doctor", "--nproc", str(ranks), "--json"]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600).stdout
    return profile_from_doctor(json.loads(out), f"lockstep doctor --nproc {ranks} --json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    rows, profiles = [], {}
    for name, model, layout, world in CASES:
        if args.quick and model is not DEFAULT:
            continue
        ranks = max(world, 2)
        if ranks not in profiles:
            profiles[ranks] = doctor_profile(ranks)
            print(f"{profiles[ranks].source}: {profiles[ranks].bf16_tflops * 1e3:.0f} GFLOP/s, "
                  f"{profiles[ranks].intra_node_gbs:.2f} GB/s", flush=True)  # fmt: skip
        got = measure(model, layout, world)
        want, step = predict(model, layout, world, profiles[ranks])
        measured_step = max(seconds for _, seconds, _ in got)
        for rank in sorted({0, world - 1}):
            peak, _, tracked = got[rank]
            rows.append(
                f"| {name} | {layout} | {world} | {rank} | {want[rank] / 2**20:,.1f} | "
                f"{peak / 2**20:,.1f} | {want[rank] / peak:.2f} | {tracked / 2**20:,.1f} | "
                f"{want[rank] / tracked:.2f} | {step:.2f} | {measured_step:.2f} | "
                f"{step / measured_step:.2f} |"
            )
            print(rows[-1], flush=True)
    if args.quick:
        return 0
    profiled = "; ".join(
        f"{n} ranks {p.bf16_tflops * 1e3:.0f} GFLOP/s bf16, {p.intra_node_gbs:.2f} GB/s"
        for n, p in sorted(profiles.items())
    )
    method = [
        "Command: `python bench/bench_plan.py`. Micro-batch 2, 2 accumulation steps,",
        "AdamW, one thread a rank; memory measured: each rank's peak resident set less its",
        "resident set before the model is built, glibc returning freed blocks of 64 KiB and",
        "more; step time predicted on the profile `lockstep doctor --nproc N --json` measured",
        "here, measured: the slowest rank's faster of steps 2 and 3 (the docstring); tracked:",
        "torch's MemTracker (FSDPMemTracker under FSDP) on a fourth real step, the tensors' own",
        "peak, as the plan tracks its fake step. Profiles: " + profiled + ".",
    ]
    columns = "model, layout, ranks, rank, predicted MiB, measured MiB, ratio, tracked MiB, ratio, "
    columns += "predicted step s, measured step s, ratio"
    title = "`lockstep plan` against real runs (float32, CPU): memory and step time"
    write_table(title, method, columns.split(", "), rows, BEGIN, END)
    return 0


def write_table(title: str, method: list[str], columns: list[str], rows, begin: str, end: str):
    """A BENCHMARKS.md section between `begin` and `end`: the title, this machine, how it was
    measured, the table (bench/bench_plan_hf.py writes its own with it too)."""
    from bench_train import emit_section, machine_info

    m = machine_info()
    text = "\n".join(
        [
            begin,
            f"## {title}",
            "",
            f"{m['date']}, lockstep {m['commit']}, {m['cpu']} ({m['isa']}), {m['cores']} cores, "
            f"torch {m['torch']}.",
            "",
            *method,
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
            *rows,
            end,
        ]
    )
    emit_section(text, str(ROOT / "BENCHMARKS.md"), begin, end)


if __name__ == "__main__":
    sys.exit(main())
