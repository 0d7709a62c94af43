"""`--resume` of a real HF Trainer checkpoint (lockstep/train/hf_resume.py, lockstep/train/state.py): a
transformers.Trainer run of one step writes checkpoint-1 (full, and LoRA through peft), lockstep trains from its
weights with a note saying what was and was not loaded, and what cannot be loaded is refused with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
# peft reads the old name
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

from safetensors.torch import load_file  # noqa: E402

from lockstep.checkpoint.hf_trainer import find_hf_trainer_checkpoint  # noqa: E402
from lockstep.config import load_config  # noqa: E402
from lockstep.errors import CheckpointError  # noqa: E402
from lockstep.train.hf_resume import load_hf_trainer_weights  # noqa: E402

from .tiny import train  # noqa: E402


def hf_trainer_checkpoint(base: Path, out: Path, lora: bool) -> Path:
    """One step of transformers.Trainer on the tiny Llama: its real checkpoint-1 (weights moved off the base)."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(base)
    if lora:
        import peft

        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=4,
                lora_alpha=8,
                target_modules="all-linear",
                task_type="CAUSAL_LM",
                init_lora_weights=False,
            ),
        )
    samples = [
        {"input_ids": torch.arange(16) + i, "labels": torch.arange(16) + i} for i in range(4)
    ]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=samples).train()
    return out / "checkpoint-1"


@pytest.fixture(scope="module")
def hf(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("hf_trainer")
    base = shutil.copytree(tiny_llama, root / "base")  # beside the Trainer's outputs below
    chats = root / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"hello {i}"},
                        {"role": "assistant", "content": "fine, thank you"},
                    ]
                }
            )
            + "\n"
            for i in range(16)
        )
    )
    return {
        "base": base,
        "chats": chats,
        "full": hf_trainer_checkpoint(base, root / "out", lora=False),
        "lora": hf_trainer_checkpoint(base, root / "out_lora", lora=True),
    }


def hf_config(hf, run: Path, resume: Path, **overrides):
    return load_config(
        None,
        {
            "model.kind": "hf",
            "model.path": str(hf["base"]),
            "data.kind": "chatml",
            "data.path": str(hf["chats"]),
            "data.num_workers": 0,
            "data.eval_fraction": 0,
            "data.pack": False,
            "train.batch_size": 4,
            "train.max_steps": 1,
            "train.eval_interval": 0,
            "train.peak_flops": 1e12,
            "train.mixed_precision": "no",
            "train.report_to": "none",
            "optim.learning_rate": 1e-12,
            "optim.warmup_steps": 0,
            "distributed.device": "cpu",
            "checkpoint.output_dir": str(run),
            "checkpoint.resume": str(resume),
            **overrides,
        },
    )


def test_a_trainer_checkpoint_is_recognized_with_what_is_left_alone(hf):
    ckpt = find_hf_trainer_checkpoint(hf["full"])
    assert (ckpt.weights.name, ckpt.global_step, ckpt.is_adapter) == ("model.safetensors", 1, False)
    assert ckpt.not_read == ["optimizer.pt", "rng_state.pth", "scheduler.pt", "training_args.bin"]
    # the Trainer's output_dir: its newest checkpoint-N
    lora = find_hf_trainer_checkpoint(hf["lora"].parent)
    assert lora.path == hf["lora"] and lora.weights.name == "adapter_model.safetensors"
    assert lora.adapter_config["r"] == 4
    # neither a checkpoint nor an output_dir
    assert find_hf_trainer_checkpoint(hf["base"].parent) is None


def test_training_starts_from_the_trainer_checkpoints_weights(hf, tmp_path):
    train(hf_config(hf, tmp_path / "run", hf["full"]))
    saved = load_file(hf["full"] / "model.safetensors")
    trained = load_file(tmp_path / "run" / "checkpoints" / "step_00000001" / "model.safetensors")
    base = load_file(hf["base"] / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert (saved[key] - base[key]).abs().max() > 1e-4  # the Trainer's step moved it off the base
    for (
        name,
        tensor,
    ) in saved.items():  # lr 1e-12: one lockstep step leaves the loaded weights where they were
        torch.testing.assert_close(trained[name], tensor, atol=1e-6, rtol=0)
    text = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert (
        f"resuming from an HF Trainer checkpoint: weights ({len(saved)} tensors) loaded from {hf['full']}; its "
        "optimizer, scheduler, RNG and data position are not loaded (optimizer.pt, rng_state.pth, scheduler.pt, "
        "training_args.bin: HF Trainer's pickled formats, never unpickled), so training starts at step 0 of "
        "lockstep's schedule with a fresh optimizer, warmup and data order; HF's global_step 1 is not carried "
        "over"
    ) in text
    assert "damaged" not in text
    assert (
        "batch plan: global batch 4 (command line) = 1 rank (world size, one process) x micro-batch 4"
        in text
    )


def test_lora_adapters_load_into_a_lora_run(hf):
    from lockstep.models.hf import build_hf_model

    cfg = hf_config(
        hf,
        Path("unused"),
        hf["lora"],
        **{"model.use_lora": True, "model.lora_rank": 4, "model.lora_alpha": 8},
    )
    model = build_hf_model(cfg.model)
    note = load_hf_trainer_weights(find_hf_trainer_checkpoint(hf["lora"]), model, sharded=False)
    saved = load_file(hf["lora"] / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    for name, tensor in saved.items():
        ours = name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        torch.testing.assert_close(params[ours].detach(), tensor, atol=0, rtol=0)
    assert note.startswith(
        "resuming from an HF Trainer checkpoint: LoRA adapters (r=4, alpha 8, 28 tensors; the "
        f"frozen base from model.path) loaded from {hf['lora']}"
    )


def refusal(hf, resume: Path, **overrides) -> str:
    from lockstep.models.hf import build_hf_model

    cfg = hf_config(hf, Path("unused"), resume, **overrides)
    with pytest.raises(CheckpointError) as e:
        load_hf_trainer_weights(
            find_hf_trainer_checkpoint(resume), build_hf_model(cfg.model), sharded=False
        )
    return str(e.value)


def test_what_cannot_be_loaded_is_refused_with_the_reason(hf, tmp_path):
    assert (
        "it holds LoRA adapters (r=4), and this run trains without LoRA; pass --use-lora --lora-rank 4"
        in refusal(hf, hf["lora"])
    )
    assert "it holds a whole model, and this run trains LoRA adapters" in refusal(
        hf, hf["full"], **{"model.use_lora": True}
    )
    assert "its adapter_config.json has r = 4, this run 8; pass --lora-rank 4" in refusal(
        hf, hf["lora"], **{"model.use_lora": True, "model.lora_alpha": 8}
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    from lockstep.tools.tiny import save_tiny_llama

    wider = tmp_path / "wider"
    save_tiny_llama(wider)
    LlamaForCausalLM(
        LlamaConfig(**{**json.loads((wider / "config.json").read_text()), "intermediate_size": 96})
    ).save_pretrained(wider)
    assert (
        "the HF Trainer checkpoint does not fit LlamaForCausalLM built from model.path: "
        "model.layers.0.mlp.down_proj.weight has shape (64, 128) in the checkpoint, (64, 96) in the model"
    ) in refusal(hf, hf["full"], **{"model.path": str(wider)})


def test_a_gpt_run_or_a_sharded_layout_is_told_why_not(hf):
    from lockstep.models.gpt import build_gpt
    from lockstep.models.hf import build_hf_model

    gpt = build_gpt(load_config(None, {"model.hidden_size": 32, "model.attention_heads": 2}).model)
    with pytest.raises(
        CheckpointError,
        match=r"this run trains GPT, not a Hugging Face model \(model.kind gpt or "
        r"custom\); to fine-tune it pass --model-kind hf",
    ):
        load_hf_trainer_weights(find_hf_trainer_checkpoint(hf["full"]), gpt, sharded=False)
    model = build_hf_model(hf_config(hf, Path("unused"), hf["full"]).model)
    with pytest.raises(
        CheckpointError,
        match=f"not supported yet; use it as the base instead: --model {hf['full']}",
    ):
        load_hf_trainer_weights(find_hf_trainer_checkpoint(hf["full"]), model, sharded=True)


def test_a_truncated_weights_file_is_named_in_one_line(hf, tmp_path):
    """model.safetensors cut short (an interrupted copy) in the newest checkpoint-N of an
    output_dir: the run stops with one line naming the file, what is wrong with it and the
    checkpoint-N before it; no traceback."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(hf["full"], out / "checkpoint-1")
    newest = shutil.copytree(hf["full"], out / "checkpoint-2")
    weights = newest / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    with pytest.raises(CheckpointError) as e:
        train(hf_config(hf, tmp_path / "run", out))  # the output_dir: its newest checkpoint-N
    want = (
        f"{weights} is {size // 2} bytes, its header describes {size}: truncated (an "
        f"interrupted save or copy?); resume from an earlier checkpoint (--resume "
        f"{out / 'checkpoint-1'}), or save this checkpoint again (or copy it again, if it was "
        "copied)"
    )
    assert str(e.value) == want
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "ERROR rank 0 (" in log and log.rstrip().endswith(want), log
    assert "Traceback" not in log, log


def test_the_other_files_a_resume_reads_are_named_when_damaged(hf, tmp_path):
    import shutil

    from lockstep.models.hf import build_hf_model

    lora = shutil.copytree(hf["lora"], tmp_path / "checkpoint-1")
    cfg = hf_config(
        hf,
        Path("unused"),
        lora,
        **{"model.use_lora": True, "model.lora_rank": 4, "model.lora_alpha": 8},
    )
    model = build_hf_model(cfg.model)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):  # HF's pickles: never opened
        (lora / name).write_bytes((lora / name).read_bytes()[:10])
    load_hf_trainer_weights(find_hf_trainer_checkpoint(lora), model, sharded=False)

    fix = (
        "resume from an earlier checkpoint-N if there is one, or save this checkpoint again "
        "(or copy it again, if it was copied)"
    )
    adapters = lora / "adapter_model.safetensors"
    adapters.write_bytes(adapters.read_bytes()[:4])
    with pytest.raises(CheckpointError) as e:
        load_hf_trainer_weights(find_hf_trainer_checkpoint(lora), model, sharded=False)
    assert str(e.value) == (
        f"{adapters} is 4 bytes, shorter than safetensors' 8-byte header "
        f"length: truncated (an interrupted save or copy?); {fix}"
    )
    adapters.write_bytes(b"\x00\x01" + b"\xff" * 98)  # not safetensors at all: its words, one line
    with pytest.raises(
        CheckpointError,
        match=r"adapter_model.safetensors cannot be read as "
        r"safetensors \(SafetensorError: Error while "
        r"deserializing header: [^\n]*\); resume",
    ):
        load_hf_trainer_weights(find_hf_trainer_checkpoint(lora), model, sharded=False)

    state = lora / "trainer_state.json"
    state.write_text(state.read_text()[:20])
    with pytest.raises(CheckpointError) as e:
        find_hf_trainer_checkpoint(lora)  # read when --resume picks the checkpoint
    said = str(e.value)
    assert said.startswith(f"{state} cannot be read as JSON (") and said.endswith(fix)
    assert "\n" not in said
