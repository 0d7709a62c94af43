"""QLoRA on CUDA (issue 23, item 2i): a tiny Llama's base loaded in 4-bit NF4 by bitsandbytes,
LoRA trained on it in bf16, its adapter saved and loaded back; DDP over a 4-bit base; and `lockstep
train --load-in-4bit` end to end: loss falling, checkpoints holding the adapters alone, a resume,
the final adapter, and an export merged into the full-precision base.

The CPU twins: tests/unit/models/test_quantize.py (the refusals; the same loader on bitsandbytes'
CPU backend where it is installed), tests/unit/tools/test_export.py and test_final.py (what a QLoRA
run exports and leaves). Needs bitsandbytes (`pip install 'lockstep[qlora]'`; bench/gpu/run.sh
installs it from its wheel folder).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from lockstep.checkpoint.open import load_checkpoint
from lockstep.config import ModelConfig

from .runs import DEVICE, checkpoint_dir, latest_step, losses, rank0_log, run_lockstep, run_on_gpu

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
pytestmark = [
    # collected everywhere (`pytest -m gpu --collect-only` lists them), skipped without the library
    pytest.mark.skipif(
        importlib.util.find_spec("bitsandbytes") is None,
        reason="QLoRA needs bitsandbytes: pip install 'lockstep[qlora]'",
    ),
    # peft reads transformers' deprecated is_gradient_checkpointing
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from lockstep.tools.tiny import save_tiny_llama

    # hidden 64, intermediate 128, 2 blocks: every linear weight a whole number of 64-weight blocks
    return save_tiny_llama(tmp_path_factory.mktemp("llama") / "model")


def qlora_cfg(path: Path, **overrides) -> ModelConfig:
    return ModelConfig(
        kind="hf",
        path=str(path),
        use_lora=True,
        load_in_4bit=True,
        lora_rank=8,
        lora_alpha=16.0,
        lora_dropout=0.0,
        **overrides,
    )


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 300, (4, 32), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return {"input_ids": ids, "labels": ids.clone()}


def four_bit_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from bitsandbytes.nn import Linear4bit

    return {n: m for n, m in model.named_modules() if isinstance(m, Linear4bit)}


def test_the_base_loads_in_4bit_nf4_on_this_gpu(llama_dir):
    from lockstep.models.hf import build_hf_model

    model = build_hf_model(qlora_cfg(llama_dir))  # no device: the GPU this process is bound to
    layers = four_bit_layers(model)
    assert sorted({n.rsplit(".", 1)[-1] for n in layers}) == ["base_layer"]  # LoRA wraps each one
    assert sorted({n.rsplit(".", 2)[-2] for n in layers}) == sorted(BLOCK_LINEARS)
    assert len(layers) == 2 * len(BLOCK_LINEARS)
    head = model.get_base_model().lm_head
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32  # kept, in fp32
    for name, layer in layers.items():
        w = layer.weight
        assert type(w).__name__ == "Params4bit" and w.dtype == torch.uint8, name
        assert w.device == torch.device(DEVICE, 0) and not w.requires_grad, name
        # NF4 codes, their scales quantized again (double quantization)
        assert w.quant_state.quant_type == "nf4" and w.quant_state.nested, name
        assert layer.compute_dtype == torch.bfloat16, name  # an H100 / H200 has native bf16
    # what lockstep.train.setup does to every model: .to(its device). A 4-bit base is already there,
    # and the move keeps its packed weights and their quantization state as they were
    before = {n: (id(m.weight), m.weight.data_ptr()) for n, m in layers.items()}
    model.eval()
    with torch.no_grad():
        want = model(input_ids=batch()["input_ids"]).logits
        assert model.to(torch.device(DEVICE, 0)) is model
        after = four_bit_layers(model)
        assert {n: (id(m.weight), m.weight.data_ptr()) for n, m in after.items()} == before
        assert torch.equal(model(input_ids=batch()["input_ids"]).logits, want)


def test_lora_trains_on_the_4bit_base_in_bf16_and_the_final_adapter_loads(llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lockstep.config import Config
    from lockstep.models.hf import build_hf_model, save_hf_model, trainable_state_dict
    from lockstep.models.hf_loss import hf_forward_loss
    from lockstep.models.quantize import build_bnb_config
    from lockstep.tools.final import write_final_outputs
    from lockstep.train.loop import TrainResult
    from lockstep.train.workload import Workload

    cfg = qlora_cfg(llama_dir, gradient_checkpointing=True)
    model = build_hf_model(cfg)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())  # fp32 adapters, bf16 compute
    opt = torch.optim.AdamW(trainable.values(), lr=1e-2, weight_decay=0.0)
    model.train()
    seen = []
    for step in range(30):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = hf_forward_loss(model, batch())  # the same batch: the loss must fall
        loss.backward()
        if step == 0:  # only the adapters get gradients: the 4-bit base and the rest are frozen
            with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
            assert with_grad == set(trainable)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen.append(loss.item())
    assert seen[-1] < seen[0] - 1.0, seen

    state = trainable_state_dict(model)  # what a checkpoint holds: the adapters, not the base
    assert sorted(state) == sorted(trainable)
    assert all(t.dtype == torch.float32 for t in state.values())

    # what `lockstep train` leaves: the final adapter, written from the model where it trained
    wl = Workload(
        model=model,
        train_ds=[],
        eval_ds=None,
        loss=None,
        finalize=lambda trained, out: save_hf_model(trained, out),
    )
    write_final_outputs(Config(model=cfg), TrainResult(tmp_path / "run", 30, None, workload=wl))
    final = tmp_path / "run" / "final"
    assert (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()  # the 4-bit base is not written
    assert all(layer.weight.device.type == DEVICE for layer in four_bit_layers(model).values())
    info = json.loads((final / "lockstep.json").read_text())
    assert info["format"] == "adapter" and info["base_quantization"].startswith("bitsandbytes nf4")

    # the adapter on a fresh 4-bit base, as the note says to load it: the trained model's outputs
    base = AutoModelForCausalLM.from_pretrained(
        llama_dir,
        quantization_config=build_bnb_config(True),
        device_map={"": 0},
        dtype=torch.float32,
    )
    reloaded = PeftModel.from_pretrained(base, final).eval()
    model.eval()
    with torch.no_grad():
        ids = batch(seed=1)["input_ids"]
        torch.testing.assert_close(
            reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-3, rtol=0
        )


def _ddp_steps(rt, llama_dir: str) -> dict:
    """DDP over a QLoRA model on a 1-rank NCCL group, built as lockstep.parallel.ddp.apply_ddp
    builds it for a Hugging Face model (find_unused_parameters: lockstep's choice for them)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lockstep.models.hf import build_hf_model
    from lockstep.models.hf_loss import hf_forward_loss
    from lockstep.parallel.ddp import LossModule

    model = build_hf_model(qlora_cfg(Path(llama_dir)), rt.device)
    ddp = DDP(
        LossModule(model, hf_forward_loss),
        device_ids=[rt.device.index],
        find_unused_parameters=True,
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ddp(batch())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    kinds = {type(m.weight).__name__ for m in four_bit_layers(model).values()}
    return {"losses": out, "weights": kinds}


def test_ddp_wraps_a_4bit_base(llama_dir):
    result = run_on_gpu(_ddp_steps, str(llama_dir))
    assert result["weights"] == {"Params4bit"}  # DDP's broadcast from rank 0 kept them packed
    assert result["losses"][-1] < result["losses"][0], result["losses"]


def _example(name: str, module: str):
    spec = importlib.util.spec_from_file_location(
        f"example_{name}_{module}", EXAMPLES / name / f"{module}.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lockstep_train_load_in_4bit_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM

    _example("chatml_lora", "prepare").main(tmp_path)
    run = tmp_path / "run"

    flags = {
        "--config": EXAMPLES / "chatml_lora" / "config.yaml",
        "--model": tmp_path / "tiny-llama",
        "--data": tmp_path / "data" / "train.jsonl",
        "--output-dir": run,
        "--device": DEVICE,
        "--learning-rate": "3e-3",
        "--warmup-steps": "10",
        "--log-interval": "10",
        "--save-interval": "30",
    }
    args = [str(x) for pair in flags.items() for x in pair]
    sets = ["--set", "train.epochs=null", "--set", "data.num_workers=0"]

    def train(max_steps: int):
        return run_lockstep(
            "train", *args, *sets, "--load-in-4bit", "--max-steps", str(max_steps), timeout=400
        )

    train(60)
    log = rank0_log(run)
    assert "device cuda:0" in log and "mixed precision bf16 (as set)" in log
    rows = losses(run)
    assert len(rows) == 6 and rows[-1] < rows[0] - 0.3, rows
    # the adapters alone: the 4-bit base is never written
    ckpt = load_checkpoint(checkpoint_dir(run))
    assert ckpt.tensors and all("lora_" in k for k in ckpt.tensors), sorted(ckpt.tensors)[:5]
    assert all(t.dtype == torch.float32 for t in ckpt.tensors.values())
    info = json.loads((run / "final" / "lockstep.json").read_text())
    assert info["format"] == "adapter" and info["base_quantization"].startswith("bitsandbytes nf4")

    train(90)  # the same command, further: it resumes from step 60
    assert "resumed from" in rank0_log(run) and latest_step(run) == 90
    assert len(losses(run)) == 9

    exported = tmp_path / "merged"
    run_lockstep("export", run, "-o", exported, "--merge-lora", timeout=300)
    merged = AutoModelForCausalLM.from_pretrained(exported)
    weights = merged.state_dict()
    assert not any("lora" in k for k in weights) and {t.dtype for t in weights.values()} == {
        torch.float32
    }
    assert (
        "reloaded in full precision" in json.loads((exported / "lockstep.json").read_text())["note"]
    )
