"""The optimizer step on a real 2-process gloo group: one all-reduce per step, and accumulation = a bigger batch."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lockstep.config import ModelConfig
from lockstep.train.step import train_step
from lockstep.models.gpt import build_gpt
from lockstep.parallel.ddp import apply_ddp, loss_through
from lockstep.runtime import Runtime, free_port

CFG = ModelConfig(vocab_size=64, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16)
STEPS, GLOBAL = 3, 16  # global batch 16 = 2 ranks x 8 per rank per step


def _run(micro: int, accum: int, rank: int, data: torch.Tensor) -> tuple[dict, int]:
    rt = Runtime(rank, rank, 2, 2, 0, torch.device("cpu"), "gloo", "test", "localhost")
    torch.manual_seed(0)
    model = build_gpt(CFG)
    ddp = apply_ddp(model, rt, lambda m, batch: m(*batch)[1])
    calls = [0]

    def counting_allreduce(state, bucket):  # the real all-reduce, counted
        calls[0] += 1
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / dist.get_world_size())

    ddp.register_comm_hook(None, counting_allreduce)
    # SGD: its update is linear in the gradient. AdamW divides by sqrt(v) + eps, which turns the rounding
    # noise of near-zero gradient entries into full-size steps and would hide what is compared here.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        # rank r's share of step s: 8 sequences, cut into `accum` micro-batches of `micro`
        mine = data[step, rank * 8:(rank + 1) * 8]
        micro_batches = [(mine[i * micro:(i + 1) * micro, :-1], mine[i * micro:(i + 1) * micro, 1:]) for i in range(accum)]
        train_step(ddp, model, opt, micro_batches, accum, rt.device, contextlib.nullcontext(), 1.0, loss_through)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, calls[0]


def _worker(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    data = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL, CFG.max_seq_length + 1), generator=torch.Generator().manual_seed(1))
    plain, plain_calls = _run(8, 1, rank, data)
    accum, accum_calls = _run(2, 4, rank, data)
    if rank == 0:
        torch.save({"plain": plain, "accum": accum, "calls": (plain_calls, accum_calls)}, out["path"])
    dist.destroy_process_group()


def test_accumulation_one_allreduce_per_step_and_same_weights(tmp_path):
    path = str(tmp_path / "result.pt")
    mp.start_processes(_worker, args=(free_port(), {"path": path}), nprocs=2, start_method="spawn")
    result = torch.load(path, weights_only=True)
    plain_calls, accum_calls = result["calls"]
    # the tiny model fits DDP's first bucket: one all-reduce per backward that syncs
    assert plain_calls == STEPS, plain_calls
    assert accum_calls == STEPS, f"{accum_calls} all-reduces for {STEPS} steps of 4 micro-steps each"
    for name, tensor in result["plain"].items():
        torch.testing.assert_close(result["accum"][name], tensor, rtol=1e-5, atol=2e-6, msg=name)
    # and the steps did change the weights (the comparison is not between two untouched models)
    torch.manual_seed(0)
    init = build_gpt(CFG).state_dict()["blocks.0.attn.qkv.weight"]
    assert (result["plain"]["blocks.0.attn.qkv.weight"] - init).abs().max() > 1e-3
