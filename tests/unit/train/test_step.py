"""lockstep/train/step.py: the optimizer step on a real 2-process gloo group (one all-reduce per step, and
accumulation = a bigger batch); the evaluation's mean over every rank's shard; autocast and the loss scaler."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from conftest import one_process, run_ranks
from lockstep.config import ModelConfig
from lockstep.models.gpt import build_gpt
from lockstep.parallel.ddp import apply_ddp, loss_through
from lockstep.runtime import Runtime
from lockstep.train.step import build_autocast, build_grad_scaler, evaluate, train_step

CFG = ModelConfig(vocab_size=64, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16)
STEPS, GLOBAL = 3, 16  # global batch 16 = 2 ranks x 8 per rank per step


def _run(rt: Runtime, micro: int, accum: int, data: torch.Tensor) -> tuple[dict, int]:
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
        mine = data[step, rt.rank * 8:(rt.rank + 1) * 8]
        micro_batches = [(mine[i * micro:(i + 1) * micro, :-1], mine[i * micro:(i + 1) * micro, 1:]) for i in range(accum)]
        train_step(ddp, model, opt, micro_batches, accum, rt.device, contextlib.nullcontext(), 1.0, loss_through)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, calls[0]


def _plain_and_accumulated(rt: Runtime) -> tuple:
    data = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL, CFG.max_seq_length + 1), generator=torch.Generator().manual_seed(1))
    return _run(rt, 8, 1, data), _run(rt, 2, 4, data)


def test_accumulation_one_allreduce_per_step_and_same_weights():
    (plain, plain_calls), (accum, accum_calls) = run_ranks(_plain_and_accumulated)[0]
    # the tiny model fits DDP's first bucket: one all-reduce per backward that syncs
    assert plain_calls == STEPS, plain_calls
    assert accum_calls == STEPS, f"{accum_calls} all-reduces for {STEPS} steps of 4 micro-steps each"
    for name, tensor in plain.items():
        torch.testing.assert_close(accum[name], tensor, rtol=1e-5, atol=2e-6, msg=name)
    # and the steps did change the weights (the comparison is not between two untouched models)
    torch.manual_seed(0)
    init = build_gpt(CFG).state_dict()["blocks.0.attn.qkv.weight"]
    assert (plain["blocks.0.attn.qkv.weight"] - init).abs().max() > 1e-3


class Scale(torch.nn.Module):
    """loss = mean(batch) x w: each batch's loss is known in advance, and autograd would see w."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))


def _evaluate_on(rt) -> tuple:
    model = Scale()
    seen = []

    def forward_loss(m, batch):
        loss = batch.float().mean() * m.w
        seen.append((m.training, loss.requires_grad))
        return loss

    # rank 0's shard: batches of mean 1 and 2; rank 1's: 3 and 6
    batches = [torch.full((4,), v) for v in ((1.0, 2.0) if rt.rank == 0 else (3.0, 6.0))]
    mean = evaluate(model, iter(batches), rt=rt, autocast=contextlib.nullcontext(), forward_loss=forward_loss)
    return mean, seen, model.training


def test_evaluate_is_the_mean_over_every_ranks_batches():
    for mean, seen, training in run_ranks(_evaluate_on):
        assert mean == 3.0  # (1 + 2 + 3 + 6) / 4, on both ranks
        assert seen == [(False, False), (False, False)]  # eval mode, no graph
        assert training  # the model is handed back in train mode
    model = Scale().eval()
    assert evaluate(model, iter([]), rt=one_process(), autocast=contextlib.nullcontext(),
                    forward_loss=lambda m, b: m.w) == 0.0  # no held-out batch: 0, not a division by zero
    assert not model.training  # and the mode it came in is kept


def test_autocast_runs_matmuls_in_the_chosen_dtype():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    assert isinstance(build_autocast("no", torch.device("cpu")), contextlib.nullcontext)
    with build_autocast("no", torch.device("cpu")):
        assert (a @ b).dtype == torch.float32
    with build_autocast("bf16", torch.device("cpu")):
        assert (a @ b).dtype == torch.bfloat16
        assert torch.nn.functional.cross_entropy(a, torch.tensor([0, 1, 2, 3])).dtype == torch.float32  # the loss
    assert (a @ b).dtype == torch.float32  # only inside


def test_only_fp16_on_cuda_scales_the_loss():
    for precision in ("no", "bf16", "fp16"):  # fp16 on a CPU is refused before (runtime.check_mixed_precision)
        assert build_grad_scaler(precision, torch.device("cpu")) is None
    for precision in ("no", "bf16"):
        assert build_grad_scaler(precision, torch.device("cuda")) is None  # bf16 has fp32's range


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp16_on_cuda_gets_a_grad_scaler():
    scaler = build_grad_scaler("fp16", torch.device("cuda"))
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    with build_autocast("fp16", torch.device("cuda")):
        assert (torch.randn(4, 4, device="cuda") @ torch.randn(4, 4, device="cuda")).dtype == torch.float16
