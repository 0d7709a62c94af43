"""Pipeline parallelism on a real 2-process gloo group: GPipe and 1F1B train exactly like one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from conftest import start_ranks
from torch.distributed.device_mesh import init_device_mesh

from lockstep.config import ModelConfig
from lockstep.models.gpt import build_gpt
from lockstep.parallel.pp import build_pipeline, stage_layers
from lockstep.runtime import free_port, shutdown_runtime
from lockstep.train.step_clock import RankTimes
from lockstep.train.stragglers import behind

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, attention_heads=4, layers=4, max_seq_length=16, dropout=0.0
)
STEPS, MICRO, LR, CLIP = 5, 2, 1e-2, 1.0
RUNS = [("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)]  # (schedule, n_microbatches)
EVAL_AFTER = 2  # evaluate after this many steps, then go on training


def batches(n_microbatches: int) -> torch.Tensor:
    """(STEPS, n_microbatches * MICRO, T + 1) token ids: each step's whole (one dp rank's) batch."""
    g = torch.Generator().manual_seed(n_microbatches)
    return torch.randint(
        0, CFG.vocab_size, (STEPS, n_microbatches * MICRO, CFG.max_seq_length + 1), generator=g
    )


def optimizer(params) -> torch.optim.AdamW:
    # fused, as build_optimizer on CPU
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=True)


def reference(n_microbatches: int) -> dict:
    """One process, the whole batch at once: per-step losses and grad norms, the first step's gradients,
    the final weights, and the loss of an evaluation between steps."""
    torch.manual_seed(0)
    model = build_gpt(CFG)
    opt = optimizer(model.parameters())
    losses, norms, grads = [], [], {}
    for step, batch in enumerate(batches(n_microbatches)):
        if step == EVAL_AFTER:
            model.eval()
            with torch.no_grad():
                eval_loss = model(batch[:, :-1], batch[:, 1:])[1].item()
            model.train()
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if not grads:  # named_parameters() skips the tied head: a stage's head.weight has the embedding's gradient
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            grads["head.weight"] = grads["tok_emb.weight"]
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "state": model.state_dict(),
        "eval": eval_loss,
    }


def _worker(rank: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    out = {}
    for schedule, n_micro in RUNS:
        torch.manual_seed(0)  # as the trainer seeds every rank before building the model
        model = build_gpt(CFG)
        if rank == 1:  # a stale copy of the tied embedding: build_pipeline must take stage 0's
            with torch.no_grad():
                model.head.weight.add_(1.0)
        pipe = build_pipeline(model, mesh, schedule, n_micro)
        opt = optimizer(pipe.module.parameters())
        losses, norms, grads, laps = [], [], {}, []
        for step, batch in enumerate(batches(n_micro)):
            if step == EVAL_AFTER:  # forward only, then the schedule switches back to training
                eval_loss = pipe.evaluate(batch[:, :-1], batch[:, 1:]).item()
            # a step clock's laps, of the second step (the first also sets the stage up)
            lap = laps.append if step == 1 else None
            losses.append(pipe.step(batch[:, :-1], batch[:, 1:], lap).item())
            grads = grads or {k: p.grad.clone() for k, p in pipe.module.named_parameters()}
            norms.append(pipe.clip_grad_norm_(CLIP).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[(schedule, n_micro)] = {
            "schedule": type(pipe.schedule).__name__,
            "losses": losses,
            "norms": norms,
            "grads": grads,
            "eval": eval_loss,
            "state": {k: v.detach().clone() for k, v in pipe.module.state_dict().items()},
            "laps": laps,
        }
    out["slow stage"] = _slow_stage(rank, mesh)
    try:
        build_pipeline(build_gpt(CFG), mesh, "1f1b", 1)
    except ValueError as e:
        out["too few micro-batches"] = str(e)
    try:  # a shorter sequence than the buffers were sized for: an error on every stage, not a gloo abort
        pipe.step(batch[:, :-2], batch[:, 1:-1])
    except ValueError as e:
        out["other shape"] = str(e)
    torch.save(out, f"{path}.{rank}")
    shutdown_runtime()  # collects the DDP/FSDP garbage first: see its docstring


def _slow_stage(rank: int, mesh) -> dict:
    """3 GPipe steps of 2 micro-batches through a real step clock, stage 1's forward 30 ms slower a
    micro-batch: its phases per step."""
    import time

    from lockstep.train.step import pipeline_step
    from lockstep.train.step_clock import StepClock

    torch.manual_seed(0)
    pipe = build_pipeline(build_gpt(CFG), mesh, "gpipe", 2)
    if rank == 1:
        forward = pipe.stage.submod.forward
        pipe.stage.submod.forward = lambda *a, **k: (time.sleep(0.03), forward(*a, **k))[1]
    opt = optimizer(pipe.module.parameters())
    clock = StepClock(torch.device("cpu"))
    for batch in batches(2)[:3]:
        micro = [(m[:, :-1], m[:, 1:]) for m in batch.chunk(2)]
        pipeline_step(pipe, opt, micro, torch.device("cpu"), CLIP, clock=clock)
        clock.step_done()
    return clock.means()


def test_stage_layers_even_first_stages_get_the_extra_block():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert stage_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match=r"5 pipeline stages for 4 layers"):
        stage_layers(4, 5)


def test_two_stages_train_like_one_process(tmp_path):
    path = str(tmp_path / "result")
    start_ranks(_worker, free_port(), path, nprocs=2)
    stages = [torch.load(f"{path}.{rank}", weights_only=True) for rank in range(2)]
    # a slow stage: it computes 60 ms more a step, and the other waits that long in the bubble
    fast, slow = (stage["slow stage"] for stage in stages)
    assert slow["compute"] > 0.06 and fast["bubble"] > 0.05, (fast, slow)
    # the fast stage waits the slow one's extra 60 ms on top of whatever both wait (a loaded
    # machine's scheduling delays both: CI once read 146 ms against 50, a ratio under 3)
    assert fast["bubble"] > fast["compute"] and fast["bubble"] - slow["bubble"] > 0.04, (fast, slow)
    times = [RankTimes(r, "h", r, phases, steps=3) for r, phases in enumerate((fast, slow))]
    found = behind(times, margin=0.5)  # the bubble is a wait, not the fast stage's own time
    assert found is not None and (found.times.rank, found.cause) == (1, "compute"), found
    for stage in stages:
        assert "at least as many micro-batches as stages: 1 < 2" in stage["too few micro-batches"]
        assert "got a batch of shape (8, 15), the first was (8, 16)" in stage["other shape"]
    for schedule, n_micro in RUNS:
        first, last = stages[0][(schedule, n_micro)], stages[1][(schedule, n_micro)]
        ref = reference(n_micro)
        what = f"{schedule}, {n_micro} micro-batches"
        assert (
            first["schedule"]
            == last["schedule"]
            == {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[schedule]
        )

        def close(got, want, rtol, atol, name=""):
            torch.testing.assert_close(
                got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}"
            )

        # the stages hold disjoint parts whose names cover the model's; the tied tensor is at both ends
        assert first["state"].keys().isdisjoint(last["state"].keys()), what
        assert first["state"].keys() | last["state"].keys() == ref["state"].keys(), what
        assert "tok_emb.weight" in first["state"] and "head.weight" in last["state"], what
        assert {k.split(".")[1] for k in first["state"] if k.startswith("blocks.")} == {"0", "1"}, (
            what
        )
        # the first step's gradients are the one-process gradients of the mean loss (measured: <= 2.3e-8
        # apart); the tied copies each hold the sum of both uses
        grads = first["grads"] | last["grads"]
        assert grads.keys() == ref["grads"].keys(), what
        for name, want in ref["grads"].items():
            close(grads[name], want, 1e-5, 1e-7, name)
        # every stage reports the last stage's loss: the one-process loss of the whole batch (measured 1.2e-7
        # relative); the pre-clip grad norm counts the tied tensor once (measured 3.8e-7 relative)
        assert first["losses"] == last["losses"] and first["norms"] == last["norms"], what
        close(torch.tensor(first["losses"]), torch.tensor(ref["losses"]), 1e-6, 0)
        close(torch.tensor(first["norms"]), torch.tensor(ref["norms"]), 1e-5, 0)
        assert first["eval"] == last["eval"], what
        close(first["eval"], ref["eval"], 1e-6, 0)
        # the step clock's laps: up to each chunk the bubble, the chunk (and the last stage's loss)
        # compute; then the last sends' waits, and the tied gradients' exchange
        for stage, chunks in ((first, 2 * n_micro), (last, 3 * n_micro)):
            laps = stage["laps"]
            assert laps[-2:] == ["bubble", "comm"], (what, laps)
            assert (laps.count("compute"), laps.count("bubble"), len(laps)) == (
                chunks,
                2 * n_micro + 1,
                chunks + 2 * n_micro + 2,
            ), (what, laps)
        # identical gradients and updates: the tied copies keep the same bits
        assert torch.equal(first["state"]["tok_emb.weight"], last["state"]["head.weight"]), what
        # after 5 AdamW steps the weights agree to 1e-4 absolute, 1% of one step (lr 1e-2); measured 3.3e-5.
        # Not tighter: Adam divides by sqrt(v) + eps, so a gradient that is rounding noise becomes an lr-sized
        # step. Attention's k bias is one: its exact gradient is 0 (softmax ignores a shift per query).
        weights = first["state"] | last["state"]
        for name, want in ref["state"].items():
            close(weights[name], want, 1e-5, 1e-4, name)
    # the comparison is between trained weights, not two untouched copies
    torch.manual_seed(0)
    init = build_gpt(CFG).state_dict()["blocks.3.mlp.fc.weight"]
    assert (stages[1][("1f1b", 4)]["state"]["blocks.3.mlp.fc.weight"] - init).abs().max() > 1e-2


# --- stages with data-parallel replicas, and with tensor-parallel peers too: 4 and 8 real ranks ---

# (pp, dp, tp); pp 2 x tp 2 alone trains through lockstep parity (tests/e2e/test_train_parallel.py)
LAYOUTS = {"pp 2 x dp 2": (2, 2, 1), "pp 2 x dp 2 x tp 2": (2, 2, 2)}
N_MICRO = 2


def _stage_ranks(rt, name: str) -> dict:
    """STEPS 1f1b steps of the layout `name` through lockstep's own apply_tp and build_pipeline,
    each data-parallel replica on its half of the global batch: this rank's losses, norms and
    (whole-tensor) weights."""
    from lockstep.parallel.tp import apply_tp

    pp, dp, tp = LAYOUTS[name]
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(0)
    model = build_gpt(CFG)
    if tp > 1:
        apply_tp(model, mesh["tp"])
    pipe = build_pipeline(model, mesh["pp"], "1f1b", N_MICRO, dp_mesh=mesh["dp"])
    opt = optimizer(pipe.module.parameters())
    dp_rank = mesh["dp"].get_local_rank()
    losses, norms, grads = [], [], {}
    for batch in batches(dp * N_MICRO):
        mine = batch.chunk(dp)[dp_rank]  # the sampler's cut: by data-parallel rank
        losses.append(pipe.step(mine[:, :-1], mine[:, 1:]).item())
        grads = grads or {k: _whole(p.grad) for k, p in pipe.module.named_parameters()}
        norms.append(pipe.clip_grad_norm_(CLIP).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {k: _whole(v) for k, v in pipe.module.state_dict().items()}
    return {"losses": losses, "norms": norms, "grads": grads, "state": state, "dp_rank": dp_rank}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel DTensor's whole value (a plain tensor's copy)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stages_with_replicas_or_tensor_parallel_peers_train_like_one_process(name):
    from conftest import run_ranks

    pp, dp, _ = LAYOUTS[name]
    ranks = run_ranks(_stage_ranks, name, world_size=math.prod(LAYOUTS[name]))
    ref = reference(dp * N_MICRO)  # one process, the whole global batch of every step
    # a replica's loss is its half's mean: the mean over the replicas is the global batch's
    by_replica = {r["dp_rank"]: r["losses"] for r in ranks}
    mean = torch.tensor([by_replica[d] for d in range(dp)]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for r in ranks:  # the norm of the averaged gradients, the same on every rank
        torch.testing.assert_close(
            torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-4, atol=0
        )
    # the first step's gradients, averaged over the replicas: the one-process ones (the tied
    # copies each hold the sum of both uses)
    for r in ranks:
        for key, value in r["grads"].items():
            torch.testing.assert_close(
                value, ref["grads"][key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
            )
    # every rank's stage holds the one-process weights after 5 AdamW steps: within 1e-4 as above
    # without TP; with it 1e-3, a tenth of one step (its matmuls sum in another order, and Adam
    # makes an lr-sized step of a gradient that is rounding noise: measured 3.3e-4 on 1 of 4,096)
    atol = 1e-3 if LAYOUTS[name][2] > 1 else 1e-4
    for r in ranks:
        for key, value in r["state"].items():
            torch.testing.assert_close(
                value, ref["state"][key], rtol=1e-5, atol=atol, msg=lambda m, key=key: f"{key}: {m}"
            )
    covered = set().union(*(r["state"] for r in ranks))
    assert covered == set(ref["state"]), name
