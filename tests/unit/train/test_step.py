"""lockstep/train/step.py: the optimizer step on a real 2-process gloo group (one all-reduce per step, and
accumulation = a bigger batch, also for padded variable-length Hugging Face batches normalized by their target
tokens); the evaluation's mean over every rank's shard; autocast and the loss scaler."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from conftest import one_process, run_ranks

from lockstep.config import ModelConfig
from lockstep.models.gpt import build_gpt
from lockstep.models.loss import Loss
from lockstep.parallel.ddp import LossModule, apply_ddp
from lockstep.runtime import Runtime
from lockstep.train.step import build_autocast, build_grad_scaler, evaluate, train_step

CFG = ModelConfig(vocab_size=64, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16)
STEPS, GLOBAL = 3, 16  # global batch 16 = 2 ranks x 8 per rank per step


def _run(rt: Runtime, micro: int, accum: int, data: torch.Tensor) -> tuple[dict, int, list]:
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
    grads = []  # after each step: None, or (the storages the gradients are in, all zero)
    for step in range(STEPS):
        # rank r's share of step s: 8 sequences, cut into `accum` micro-batches of `micro`
        mine = data[step, rt.rank * 8 : (rt.rank + 1) * 8]
        micro_batches = [
            (mine[i * micro : (i + 1) * micro, :-1], mine[i * micro : (i + 1) * micro, 1:])
            for i in range(accum)
        ]
        train_step(ddp, model, opt, micro_batches, rt, grad_accum=accum, clip_norm=1.0)
        held = [p.grad for p in model.parameters() if p.grad is not None]
        storages = {g.untyped_storage().data_ptr() for g in held}
        grads.append(held and (len(storages), all(bool((g == 0).all()) for g in held)))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, calls[0], grads


def _plain_and_accumulated(rt: Runtime) -> tuple:
    data = torch.randint(
        0,
        CFG.vocab_size,
        (STEPS, GLOBAL, CFG.max_seq_length + 1),
        generator=torch.Generator().manual_seed(1),
    )
    return _run(rt, 8, 1, data), _run(rt, 2, 4, data)


def _every_run(rt: Runtime, model_dir: str | None) -> dict:
    """The tests' runs, one after another on the same 2 ranks (each builds its own model): the plain
    and accumulated GPT, both evaluations, and (with transformers) the padded ChatML steps."""
    return {
        "gpt": _plain_and_accumulated(rt),
        "evaluate": _evaluate_on(rt),
        "token_weighted": _token_weighted_evaluate_on(rt),
        "chat": model_dir and _chat_on_two_ranks(rt, model_dir),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str | None, list[dict]]:
    """(the tiny Llama's folder, or None without transformers; each rank's results of _every_run)."""
    model_dir = None
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        from lockstep.tools.tiny import save_tiny_llama

        model_dir = str(save_tiny_llama(tmp_path_factory.mktemp("step") / "llama"))
    return model_dir, run_ranks(_every_run, model_dir)


def test_accumulation_one_allreduce_per_step_and_same_weights(two_ranks):
    (plain, plain_calls, _), (accum, accum_calls, grads) = two_ranks[1][0]["gpt"]
    # DDP's gradients: set to None before its buckets are rebuilt (its second forward), then views
    # of its one bucket zeroed in place, where the next step's no_sync micro-batches add (no
    # gradients of their own beside the bucket: lockstep.train.step._grads_in_buckets)
    assert grads == [[]] + [(1, True)] * (STEPS - 1), grads
    # the tiny model fits DDP's first bucket: one all-reduce per backward that syncs
    assert plain_calls == STEPS, plain_calls
    assert accum_calls == STEPS, (
        f"{accum_calls} all-reduces for {STEPS} steps of 4 micro-steps each"
    )
    for name, tensor in plain.items():
        torch.testing.assert_close(accum[name], tensor, rtol=1e-5, atol=2e-6, msg=name)
    # and the steps did change the weights (the comparison is not between two untouched models)
    torch.manual_seed(0)
    init = build_gpt(CFG).state_dict()["blocks.0.attn.qkv.weight"]
    assert (plain["blocks.0.attn.qkv.weight"] - init).abs().max() > 1e-3


# ---------------------------------------------------------------- per-token normalization (a token-weighted Loss)

# 8 padded conversations of very different lengths: with micro-batches of 2, each holds a different number of
# assistant tokens, so a mean of micro-batch means is not the mean over the global batch's tokens
REPLY = "the quick brown fox jumps over the lazy dog. "
REPEATS = (1, 9, 2, 1, 7, 8, 1, 3)


def _chat_micro_batches(model_dir: str, groups: list[list[int]]) -> list[dict]:
    """The padded ChatML micro-batches (pack=False: one conversation per row) holding `groups` of conversations."""
    from lockstep.config import ModelConfig
    from lockstep.data.chat_files import Conversation
    from lockstep.data.chatml import build_chat_datasets, collate_chat
    from lockstep.models.hf import load_hf_processor

    tok = load_hf_processor(ModelConfig(kind="hf", path=model_dir)).tokenizer
    conversations = [
        Conversation(
            [
                {"role": "user", "content": f"say it {k} times"},
                {"role": "assistant", "content": REPLY * k},
            ],
            f"test:{i}",
        )
        for i, k in enumerate(REPEATS)
    ]
    train, _ = build_chat_datasets(conversations, tok, 256, pack=False, eval_fraction=0.0)
    return [collate_chat(tok.pad_token_id)([train[i] for i in group]) for group in groups]


def _hf_step(
    rt: Runtime, model_dir: str, task: str, micro_batches: list, counted: bool, fsdp: bool = False
) -> tuple[float, dict]:
    """One train_step (DDP, or FSDP, over rt's ranks) of the model in model_dir: (its returned loss, the final
    gradients)."""
    from lockstep.config import ModelConfig
    from lockstep.models.hf import build_hf_model
    from lockstep.models.hf_loss import hf_loss

    model = build_hf_model(ModelConfig(kind="hf", path=model_dir, task=task))
    # as the trainer runs FSDP: train_step on the sharded model itself, its loss the workload's
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        from lockstep.parallel.fsdp import apply_fsdp

        apply_fsdp(model, init_device_mesh("cpu", (rt.world_size,)))
    loss = hf_loss(model, task, token_weighted=counted)
    wrapped = LossModule(model, loss) if fsdp else apply_ddp(model, rt, loss)
    grads: dict[str, torch.Tensor] = {}

    def keep_grads():  # after DDP's all-reduce / FSDP's reduce-scatter: what the optimizer steps with
        full = {
            n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
            for n, p in model.named_parameters()
        }
        grads.update({n: g.detach().clone() for n, g in full.items()})

    value, _ = train_step(
        wrapped,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        micro_batches,
        rt,
        grad_accum=len(micro_batches),
        loss=loss,
        after_backward=keep_grads,
    )
    assert "_loss_function" not in vars(model)  # the model's own loss function is never swapped
    return float(value), grads


def _chat_on_two_ranks(rt: Runtime, model_dir: str) -> tuple:
    # rank r: conversations 4r..4r+3 in 2 micro-batches of 2, so 2 ranks x 2 accumulation steps
    groups = [[4 * rt.rank, 4 * rt.rank + 1], [4 * rt.rank + 2, 4 * rt.rank + 3]]
    micro_batches = _chat_micro_batches(model_dir, groups)
    return [
        _hf_step(rt, model_dir, "causal-lm", micro_batches, counted, fsdp)
        for counted, fsdp in ((True, False), (False, False), (True, True))
    ]


def _max_relative_difference(a: dict, b: dict) -> float:
    """The largest |a - b| / |b| over the tensors (norms)."""
    return max(float((a[n] - b[n]).norm() / b[n].norm()) for n in b if b[n].norm() > 0)


def test_padded_chatml_on_two_ranks_with_accumulation_equals_one_batch(two_ranks):
    pytest.importorskip("transformers")
    model_dir, ranks = two_ranks
    # the reference: 1 process, the whole global batch of 8 in one micro-batch (its mean is the token mean)
    whole = _chat_micro_batches(model_dir, [list(range(8))])
    ref_loss, ref_grads = _hf_step(one_process(), model_dir, "causal-lm", whole, True)
    plain_loss, plain_grads = _hf_step(one_process(), model_dir, "causal-lm", whole, False)
    # one micro-batch on one process: the same objective
    assert abs(ref_loss - plain_loss) < 1e-6 * ref_loss
    counts = [
        [
            int((b["labels"][:, 1:] != -100).sum())
            for b in _chat_micro_batches(model_dir, [[0, 1], [2, 3]])
        ],
        [
            int((b["labels"][:, 1:] != -100).sum())
            for b in _chat_micro_batches(model_dir, [[4, 5], [6, 7]])
        ],
    ]
    # the micro-batches really differ in targets
    assert len({c for rank in counts for c in rank}) == 4, counts

    (counted_0, old_0, fsdp_0), (counted_1, old_1, fsdp_1) = (rank["chat"] for rank in ranks)
    # DDP, then FSDP
    for (loss_0, grads_0), (loss_1, grads_1) in ((counted_0, counted_1), (fsdp_0, fsdp_1)):
        # the loop logs the mean over ranks of what train_step returns: the single-process token mean
        assert abs((loss_0 + loss_1) / 2 - ref_loss) < 1e-5 * ref_loss, (loss_0, loss_1, ref_loss)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads_0[name], ref, rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(grads_1[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # without the normalization (a mean of micro-batch means) the same data trains on another objective
    old_loss = (old_0[0] + old_1[0]) / 2
    # (measured: loss 4.9e-4 relative, 50x the tolerance above; gradients up to 19% of a tensor's norm: a random
    # model's token losses are all near log(vocab), but which tokens weigh how much moves the gradient)
    assert abs(old_loss - ref_loss) > 1e-4 * ref_loss, (old_loss, ref_loss)
    assert _max_relative_difference(old_0[1], ref_grads) > 0.05


def _speech_micro_batches(groups: list[list[int]]) -> list[dict]:
    from lockstep.data.audio import collate_audio

    g = torch.Generator().manual_seed(0)
    lengths = (2, 30, 5, 19)  # transcript tokens: each micro-batch of 2 holds a different count
    samples = [
        {
            "input_features": torch.randn(16, 100, generator=g),
            "labels": torch.randint(5, 300, (n,), generator=g),
        }
        for n in lengths
    ]
    return [collate_audio()([samples[i] for i in group]) for group in groups]


def test_whisper_accumulation_is_per_token_as_one_batch(tmp_path):
    pytest.importorskip("transformers")
    from lockstep.tools.tiny import save_tiny_whisper

    # its loss is a plain mean: lockstep sums from logits
    model_dir = str(save_tiny_whisper(tmp_path / "whisper"))
    rt = one_process()
    ref_loss, ref_grads = _hf_step(
        rt, model_dir, "speech-seq2seq", _speech_micro_batches([[0, 1, 2, 3]]), True
    )
    split = _speech_micro_batches([[0, 1], [2, 3]])
    loss, grads = _hf_step(rt, model_dir, "speech-seq2seq", split, True)
    assert abs(loss - ref_loss) < 1e-5 * ref_loss, (loss, ref_loss)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # a mean of 2 micro-batch means
    old_loss, old_grads = _hf_step(rt, model_dir, "speech-seq2seq", split, False)
    # measured 3.9e-4; gradients 20%
    assert abs(old_loss - ref_loss) > 1e-4 * ref_loss, (old_loss, ref_loss)
    assert _max_relative_difference(old_grads, ref_grads) > 0.05


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
    mean = evaluate(model, iter(batches), rt, forward_loss, contextlib.nullcontext())
    return mean, seen, model.training


def test_evaluate_is_the_mean_over_every_ranks_batches(two_ranks):
    for mean, seen, training in (rank["evaluate"] for rank in two_ranks[1]):
        assert mean == 3.0  # (1 + 2 + 3 + 6) / 4, on both ranks
        assert seen == [(False, False), (False, False)]  # eval mode, no graph
        assert training  # the model is handed back in train mode
    model = Scale().eval()
    # no held-out batch: 0, not 0 / 0
    assert evaluate(model, iter([]), one_process(), lambda m, b: m.w) == 0.0
    assert not model.training  # and the mode it came in is kept


def _token_weighted_evaluate_on(rt) -> float:
    model = Scale()

    # per-token loss `v` on each of the batch's n targets, summed over divisor
    def forward_loss(m, batch, divisor):
        return batch["v"] * batch["n"] * m.w / divisor

    # rank 0: 1 target of loss 1, 3 of loss 2; rank 1: a batch without targets, 4 of loss 6
    pairs = ((1.0, 1), (2.0, 3)) if rt.rank == 0 else ((3.0, 0), (6.0, 4))
    batches = [{"v": torch.tensor(v), "n": n} for v, n in pairs]
    return evaluate(model, iter(batches), rt, Loss(forward_loss, lambda batch: batch["n"]))


def test_evaluate_with_a_token_weighted_loss_is_the_mean_over_every_ranks_tokens(two_ranks):
    for mean in (rank["token_weighted"] for rank in two_ranks[1]):
        # (1 + 6 + 0 + 24) / 8 targets; the empty batch adds nothing (not NaN)
        assert mean == 31 / 8


def test_autocast_runs_matmuls_in_the_chosen_dtype():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    assert isinstance(build_autocast("no", torch.device("cpu")), contextlib.nullcontext)
    with build_autocast("no", torch.device("cpu")):
        assert (a @ b).dtype == torch.float32
    with build_autocast("bf16", torch.device("cpu")):
        assert (a @ b).dtype == torch.bfloat16
        assert (
            torch.nn.functional.cross_entropy(a, torch.tensor([0, 1, 2, 3])).dtype == torch.float32
        )  # the loss
    assert (a @ b).dtype == torch.float32  # only inside


def test_only_fp16_on_cuda_scales_the_loss():
    # fp16 on a CPU is refused before (runtime.check_mixed_precision)
    for precision in ("no", "bf16", "fp16"):
        assert build_grad_scaler(precision, torch.device("cpu")) is None
    for precision in ("no", "bf16"):
        assert build_grad_scaler(precision, torch.device("cuda")) is None  # bf16 has fp32's range


def test_auto_mixed_precision_is_bf16_only_where_the_cpu_computes_it():
    from lockstep.train.step import resolve_mixed_precision

    cpu = torch.device("cpu")
    kernels = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    choice, why = resolve_mixed_precision("auto", cpu)
    assert choice == ("bf16" if kernels else "no")
    assert ("oneDNN's bf16 kernels" in why) if kernels else ("emulated, slower than fp32" in why)
    if torch.cpu._is_avx512_bf16_supported():
        assert "AVX512-BF16" in why
    for given in ("no", "bf16", "fp16"):  # what the user set is kept
        assert resolve_mixed_precision(given, cpu) == (given, "as set")


H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "bf16": True}
V100 = {"name": "Tesla V100-SXM2-32GB", "capability": "7.0", "bf16": False}


def test_auto_mixed_precision_on_a_gpu_follows_its_bf16_support():
    """The CUDA half of the choice, from the device's facts (lockstep.runtime.cuda.cuda_facts) as a GPU reports
    them; no device is touched."""
    from lockstep.train.step import resolve_mixed_precision

    cuda = torch.device("cuda", 0)
    assert resolve_mixed_precision("auto", cuda, H100) == (
        "bf16",
        "NVIDIA H100 80GB HBM3 (compute capability 9.0) computes bf16",
    )
    choice, why = resolve_mixed_precision("auto", cuda, V100)
    assert (
        choice == "no"
        and why == "Tesla V100-SXM2-32GB has no bf16 (fp16 needs train.mixed_precision=fp16)"
    )
    assert resolve_mixed_precision("fp16", cuda, V100) == ("fp16", "as set")


# torch's note on a CPU-only machine
@pytest.mark.filterwarnings("ignore:.*CUDA is not available:UserWarning")
def test_on_cuda_autocast_takes_the_dtype_asked_for_and_only_fp16_gets_a_scaler():
    cuda = torch.device("cuda", 0)  # the objects are built, never entered: no device is touched
    assert build_autocast("no", cuda).__class__.__name__ == "nullcontext"
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        autocast = build_autocast(precision, cuda)
        assert (autocast.device, autocast.fast_dtype) == ("cuda", dtype)
    scaler = build_grad_scaler("fp16", cuda)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler._device == "cuda"
