"""FSDP2 on a real 2-process gloo group: same losses and weights as one process, one reduce-scatter per step."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.distributed as dist
from conftest import start_ranks
from torch.distributed.device_mesh import init_device_mesh

from lockstep.config import ModelConfig, OptimConfig
from lockstep.models.gpt import build_gpt
from lockstep.optim import build_optimizer
from lockstep.parallel.fsdp import (
    apply_fsdp,
    clip_grad_norm,
    fsdp_units,
    no_sync,
    set_gradient_sync,
)
from lockstep.runtime import free_port, shutdown_runtime

CFG = ModelConfig(vocab_size=64, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16)
OPTIM = OptimConfig(weight_decay=0.1)
# global batch 8 = 2 ranks x 2 micro-batches x 2
STEPS, GLOBAL, ACCUM, LR, CLIP = (5, 8, 2, 1e-2, 1.0)
MICRO = GLOBAL // (2 * ACCUM)


def batches(steps: int) -> torch.Tensor:
    """(steps, GLOBAL, T + 1) learnable sequences: each row counts up mod V from a random start."""
    start = torch.randint(
        0, CFG.vocab_size, (steps, GLOBAL, 1), generator=torch.Generator().manual_seed(1)
    )
    return (start + torch.arange(CFG.max_seq_length + 1)) % CFG.vocab_size


def micro_batches(step_rows: torch.Tensor) -> list[torch.Tensor]:
    return [step_rows[i : i + MICRO] for i in range(0, len(step_rows), MICRO)]


def _train(
    model, optimizer, data: torch.Tensor, rank: int, world: int, clip, use_no_sync: bool = False
) -> tuple[list[float], list]:
    """Per step: this rank's share of the global batch in ACCUM micro-batches; loss is the all-ranks mean."""
    losses, norms = [], []
    share = GLOBAL // world
    for step in range(len(data)):
        mine = micro_batches(data[step, rank * share : (rank + 1) * share])
        loss_sum = torch.zeros(())
        for i, mb in enumerate(mine):
            last = i == len(mine) - 1  # only the last micro-batch reduce-scatters
            if not use_no_sync:
                set_gradient_sync(model, last)
            with no_sync(model) if use_no_sync and not last else contextlib.nullcontext():
                _, loss = model(mb[:, :-1], mb[:, 1:])
                (loss / len(mine)).backward()
            loss_sum += loss.detach()
        norms.append(clip(model.parameters(), CLIP))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_sum / len(mine)
        if world > 1:
            dist.all_reduce(loss)
        losses.append(float(loss) / world)
    return losses, norms


def _full_weights(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    result = {}
    calls = [0]
    real = dist.reduce_scatter_single

    def counting(*args, **kwargs):  # FSDP's reduce-scatter, counted
        calls[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counting
    data = batches(STEPS)

    # fp32: compared to one process below
    torch.manual_seed(0)
    model = build_gpt(CFG)
    apply_fsdp(model, mesh, param_dtype=None, reshard_after_forward=True)
    result["tied"] = model.head.weight is model.tok_emb.weight
    optimizer = build_optimizer(model, OPTIM, LR, "cpu")  # fused AdamW over DTensor parameters
    result["fused"] = optimizer.param_groups[0]["fused"]
    result["losses"], norms = _train(model, optimizer, data, rank, 2, clip_grad_norm)
    result["norms"] = [float(n) for n in norms]
    result["norm_types"] = sorted({type(n).__name__ for n in norms})
    result["reduce_scatters"] = calls[0]
    result["weights"] = _full_weights(model)
    result["local_numel"] = sum(p.to_local().numel() for p in model.parameters())

    # fp32 again, every micro-batch reduce-scattering (parallel.fsdp_reduce_every_micro_batch), with
    # no_sync as the trainer calls it: no_sync then leaves the sync on
    torch.manual_seed(0)
    model = build_gpt(CFG)
    apply_fsdp(model, mesh, reshard_after_forward=True, reduce_every_micro_batch=True)
    optimizer = build_optimizer(model, OPTIM, LR, "cpu")
    calls[0] = 0
    result["every_losses"], _ = _train(
        model, optimizer, data, rank, 2, clip_grad_norm, use_no_sync=True
    )
    result["every_reduce_scatters"] = calls[0]
    result["every_weights"] = _full_weights(model)

    # bf16 compute (mixed precision policy), no resharding after forward, accumulation with no_sync (as the
    # trainer's train_step does it): trains longer on the same data
    torch.manual_seed(0)
    model = build_gpt(CFG)
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reshard_after_forward=False)
    optimizer = build_optimizer(model, OPTIM, LR, "cpu")
    calls[0] = 0
    result["bf16_losses"], _ = _train(
        model, optimizer, batches(3 * STEPS), rank, 2, clip_grad_norm, use_no_sync=True
    )
    result["bf16_reduce_scatters"] = calls[0]
    result["bf16_param_dtype"] = str(next(model.parameters()).dtype)  # the sharded master copy
    result["hf"] = _train_lora_llama(mesh, rank)
    if rank == 0:
        torch.save(result, out)
    # drop everything that holds the group's tensors first: a gloo thread left at exit can abort the process
    del model, optimizer, result
    gc.collect()
    shutdown_runtime()  # collects the DDP/FSDP garbage first: see its docstring


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=32,
        )
    )


def _train_lora_llama(mesh, rank: int) -> dict:
    """A peft LoRA Llama under FSDP: the decoder layers are the units; frozen base weights stay put."""
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(
        _tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    apply_fsdp(model, mesh, param_dtype=None, reshard_after_forward=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = batches(4)[:, :, : CFG.max_seq_length]
    losses = []
    for step in range(len(ids)):
        mine = ids[step, rank * 4 : (rank + 1) * 4]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    full = _full_weights(model)
    return {
        "units": len(fsdp_units(model)),
        "losses": losses,
        "frozen_kept": all(torch.equal(full[k], v) for k, v in frozen.items()),
        "lora_moved": any(
            not torch.equal(v, torch.zeros_like(v)) for k, v in full.items() if "lora_B" in k
        ),
    }


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "result.pt"
    start_ranks(_worker, free_port(), str(out), nprocs=2)
    return torch.load(out, weights_only=True)


def _reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, the same global batches and micro-batches (in rank order), plain AdamW and clipping."""
    torch.manual_seed(0)
    model = build_gpt(CFG)
    optimizer = build_optimizer(model, OPTIM, LR, "cpu")
    data = batches(STEPS)
    losses, norms = [], []
    for step in range(STEPS):
        mbs = micro_batches(data[step])
        loss_sum = 0.0
        for mb in mbs:
            _, loss = model(mb[:, :-1], mb[:, 1:])
            (loss / len(mbs)).backward()
            loss_sum += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum / len(mbs))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fsdp_matches_one_process(fsdp_run):
    losses, norms, weights = _reference()
    # fp32 throughout; only the order of the sums differs (reduce-scatter vs one process)
    torch.testing.assert_close(fsdp_run["losses"], losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(fsdp_run["norms"], norms, rtol=1e-5, atol=0)
    assert norms[0] > CLIP, "clipping must be active for the comparison to cover it"
    assert sorted(fsdp_run["weights"]) == sorted(weights)
    for name, tensor in weights.items():
        # Measured: every tensor within 1.4e-7. Attention biases are the exception: some entries get a
        # gradient of ~0 (the key bias's exact gradient is 0), and AdamW's g / (sqrt(v) + eps) turns the
        # rounding noise there into steps of up to lr = 1e-2; measured 3.5e-5 after 5 steps.
        atol = 1e-4 if name.endswith("attn.qkv.bias") else 1e-6
        torch.testing.assert_close(
            fsdp_run["weights"][name], tensor, rtol=1e-5, atol=atol, msg=name
        )
    torch.manual_seed(0)
    init = build_gpt(CFG).state_dict()
    assert (
        fsdp_run["weights"]["blocks.0.attn.qkv.weight"] - init["blocks.0.attn.qkv.weight"]
    ).abs().max() > 1e-3


def test_tied_weights_and_sharding(fsdp_run):
    assert fsdp_run["tied"]
    # fused AdamW takes DTensor parameters on CPU (and matched one process above)
    assert fsdp_run["fused"]
    total = sum(p.numel() for p in build_gpt(CFG).parameters())
    assert fsdp_run["local_numel"] <= total // 2 + 64  # each rank holds half (dim-0 padding aside)


def test_one_reduce_scatter_per_unit_per_step(fsdp_run):
    # 2 blocks + the root = 3 FSDP units; with 2 micro-batches per step only the last one reduce-scatters
    assert fsdp_run["reduce_scatters"] == STEPS * 3, fsdp_run["reduce_scatters"]
    # no_sync likewise
    assert fsdp_run["bf16_reduce_scatters"] == 3 * STEPS * 3, fsdp_run["bf16_reduce_scatters"]


def test_reducing_every_micro_batch_trains_the_same_with_twice_the_reduce_scatters(fsdp_run):
    # each of the 2 micro-batches reduce-scatters its gradients into the shards, where they add up
    assert fsdp_run["every_reduce_scatters"] == STEPS * 3 * 2, fsdp_run["every_reduce_scatters"]
    assert fsdp_run["every_losses"] == pytest.approx(fsdp_run["losses"], rel=1e-5)
    for name, weight in fsdp_run["weights"].items():
        # as against one process (above): the attention biases' ~0 gradients turn rounding noise
        # into AdamW steps
        atol = 1e-4 if name.endswith("attn.qkv.bias") else 1e-6
        torch.testing.assert_close(
            fsdp_run["every_weights"][name], weight, rtol=1e-5, atol=atol, msg=name
        )


def test_clip_returns_plain_tensor(fsdp_run):
    assert fsdp_run["norm_types"] == ["Tensor"]


def test_bf16_mixed_precision_trains(fsdp_run):
    losses = fsdp_run["bf16_losses"]
    assert fsdp_run["bf16_param_dtype"] == "torch.float32"
    assert losses[-1] < 0.7 * losses[0], losses


def test_lora_llama_units_and_training(fsdp_run):
    hf = fsdp_run["hf"]
    assert hf["units"] == 2  # the two LlamaDecoderLayer
    assert hf["frozen_kept"] and hf["lora_moved"]
    assert hf["losses"][-1] < hf["losses"][0], hf["losses"]


def test_units_by_model_kind():
    pytest.importorskip("peft")
    import peft

    gpt = build_gpt(CFG)
    assert fsdp_units(gpt) == list(gpt.blocks)
    llama = _tiny_llama()
    assert [type(m).__name__ for m in fsdp_units(llama)] == ["LlamaDecoderLayer"] * 2
    wrapped = peft.get_peft_model(llama, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert [type(m).__name__ for m in fsdp_units(wrapped)] == ["LlamaDecoderLayer"] * 2
    assert fsdp_units(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def test_helpers_on_a_model_without_fsdp():
    """One process: gradient sync is a no-op and the norm is torch's, so the trainer needs no branch."""
    torch.manual_seed(0)
    models = [build_gpt(CFG), build_gpt(CFG)]
    models[1].load_state_dict(models[0].state_dict())
    mb = batches(1)[0]
    for m in models:
        set_gradient_sync(m, False)
        with no_sync(m):
            m(mb[:, :-1], mb[:, 1:])[1].backward()
    ours = clip_grad_norm(models[0].parameters(), 0.5)
    torch.testing.assert_close(
        ours, torch.nn.utils.clip_grad_norm_(models[1].parameters(), 0.5), rtol=0, atol=0
    )
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert float(clip_grad_norm(build_gpt(CFG).parameters(), 1.0)) == 0.0  # no gradients yet
