"""lockstep/tools/export.py: which checkpoint `lockstep sample`, `export` and `merge` take (a run's newest that
verifies, or the one named), what each gets instead of a good checkpoint (each case its own message, every fix
naming what these commands take, never train's --resume), a checkpoint whose config does not describe its
weights, and what an export writes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from conftest import run_main
from safetensors.torch import load_model

from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import Config, ModelConfig, config_from_dict, config_to_dict
from lockstep.errors import CheckpointError, ConfigError
from lockstep.models.gpt import build_gpt
from lockstep.tools.export import (
    check_weights_fit,
    checkpoint_config,
    export_checkpoint,
    load_verified_checkpoint,
    resolve_checkpoint,
)
from lockstep.tools.sample import load_model_from_checkpoint

from .saved import save_gpt, truncate

PASS = (
    "pass a run directory that has checkpoints, or one of its checkpoints (RUN/checkpoints/step_N)"
)


def user_error(capsys, *args: str) -> str:
    """`lockstep ARGS` in this process (main(), as the console script runs it): a user error."""
    code, out, err = run_main(capsys, *args)
    assert code == 1 and "Traceback" not in err, (code, err[-3000:])
    assert "--resume" not in err and out == "", err
    return err


@pytest.mark.parametrize("command", ["sample", "export"])
def test_directories_without_a_checkpoint(tmp_path, command, capsys):
    out = ["-o", str(tmp_path / "exported")] if command == "export" else []
    (tmp_path / "empty").mkdir()
    err = user_error(capsys, command, str(tmp_path / "empty"), *out)
    assert (
        err.strip()
        == f"lockstep {command}: error: {tmp_path / 'empty'} is an empty directory; {PASS}"
    )
    run = tmp_path / "run"  # a run that never reached a save: logs and an unfinished save only
    (run / "logs").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-step_00000002-999999").mkdir(parents=True)
    err = user_error(capsys, command, str(run), *out)
    assert f"run directory {run} holds no committed checkpoint yet" in err and PASS in err
    assert "damaged" not in err and "manifest.json" not in err
    assert not (tmp_path / "exported").exists()


def test_other_paths_that_hold_no_checkpoint(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=rf"{tmp_path / 'nope'} does not exist; pass a run directory"
    ):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(
        CheckpointError,
        match=r"holds no checkpoint \(no manifest.json, model.safetensors or "
        r"checkpoints/ in it\); pass a run directory",
    ):
        resolve_checkpoint(tmp_path / "data")
    with pytest.raises(CheckpointError, match=r"notes.txt is a file, not a checkpoint directory"):
        resolve_checkpoint(tmp_path / "data" / "notes.txt")


def test_run_dir_whose_checkpoints_all_fail_to_verify(tmp_path, capsys):
    run = tmp_path / "run"
    for step in (2, 4):
        truncate(save_gpt(run, step))
    code, out, err = run_main(capsys, "sample", str(run), "--max-new-tokens", "2")
    assert code == 1 and out == "" and "--resume" not in err, err
    # what was passed over, and why
    assert "checkpoint step_00000004 is damaged (model.safetensors" in err
    assert err.strip().splitlines()[-1] == (
        f"lockstep sample: error: no checkpoint of {run} verifies (the problems of each are above; `lockstep verify "
        f"{run}` lists them again); pass another run directory, or a checkpoint that verifies"
    )


def test_damaged_checkpoint_named_directly(tmp_path):
    ckpt = save_gpt(tmp_path / "run", 2)
    truncate(ckpt)
    for load in (load_model_from_checkpoint, lambda p: export_checkpoint(p, tmp_path / "out")):
        with pytest.raises(CheckpointError) as e:
            load(ckpt)
        msg = str(e.value)
        assert (
            msg.startswith(f"checkpoint {ckpt} is damaged (model.safetensors: ")
            and "--resume" not in msg
        )
        assert msg.endswith(
            "pass another checkpoint of its run, or the run directory for its newest one that "
            "verifies (`lockstep verify RUN` checks each)"
        )
    (
        ckpt / "manifest.json"
    ).unlink()  # a step dir without its manifest is a damaged checkpoint, not "no checkpoint"
    with pytest.raises(CheckpointError, match=r"is damaged \(manifest.json: missing"):
        load_model_from_checkpoint(ckpt)


def test_checkpoint_that_disagrees_with_itself(tmp_path):
    ckpt = save_gpt(tmp_path / "run", 2)
    state = json.loads((ckpt / "state.json").read_text())
    state["config"]["model"]["hidden_size"] = 64
    save_checkpoint(
        tmp_path / "edited",
        2,
        build_gpt(
            Config(
                model=ModelConfig(hidden_size=32, attention_heads=2, layers=1, max_seq_length=16)
            ).model
        ).state_dict(),
        None,
        None,
        state,
    )
    with pytest.raises(
        CheckpointError,
        match=r"tensor \S+ has shape \(\d+, 32\) but its config's model has "
        r"\(\d+, 64\), so its state.json 'config' does not describe its weights",
    ):
        export_checkpoint(tmp_path / "edited", tmp_path / "out")
    save_checkpoint(tmp_path / "bare", 2, {"w": torch.zeros(2)}, None, None, {"step": 2})
    with pytest.raises(CheckpointError, match=r"has no 'config' in its state.json"):
        load_model_from_checkpoint(tmp_path / "bare")


def test_resolve_checkpoint_takes_a_runs_newest_that_verifies(tmp_path):
    run = tmp_path / "run"
    old, new = save_gpt(run, 2), save_gpt(run, 4)
    assert resolve_checkpoint(run, log=pytest.fail) == new
    # RUN/checkpoints stands for RUN
    assert resolve_checkpoint(run / "checkpoints", log=pytest.fail) == new
    assert resolve_checkpoint(old, log=pytest.fail) == old  # a checkpoint as given
    truncate(new)
    heard = []
    assert resolve_checkpoint(run, log=heard.append) == old
    assert len(heard) == 1 and heard[0].startswith(
        "checkpoint step_00000004 is damaged (model.safetensors: "
    )
    # named: load_verified_checkpoint says it is damaged
    assert resolve_checkpoint(new, log=pytest.fail) == new


def test_export_writes_weights_config_and_extra_files(tmp_path):
    cfg = Config(model=ModelConfig(hidden_size=32, attention_heads=2, layers=1, max_seq_length=16))
    torch.manual_seed(0)
    model = build_gpt(cfg.model)
    save_checkpoint(
        tmp_path / "run",
        3,
        model.state_dict(),
        None,
        None,
        {"config": config_to_dict(cfg), "step": 3},
        extra={"tokenizer.json": b'{"v": 1}'},
    )
    out = export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert out == tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        "model.safetensors",
        "tokenizer.json",
    ]
    exported = config_from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    assert exported.model == cfg.model
    fresh = build_gpt(exported.model)
    load_model(fresh, out / "model.safetensors")  # the tied head is stored once and re-tied
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    assert (out / "tokenizer.json").read_bytes() == b'{"v": 1}'
    with pytest.raises(
        ConfigError,
        match=r"--merge-lora needs a LoRA checkpoint; .* was trained with model.kind = "
        r"'gpt', use_lora = False: drop --merge-lora",
    ):
        export_checkpoint(tmp_path / "run", tmp_path / "merged", merge_lora=True)
    assert not (tmp_path / "merged").exists()


def test_weights_that_their_config_does_not_describe_are_named(tmp_path):
    ckpt = load_verified_checkpoint(save_gpt(tmp_path / "run", 2))
    model_state = build_gpt(checkpoint_config(ckpt).model).state_dict()
    check_weights_fit(ckpt, model_state)  # as saved: fits
    fewer = dataclasses.replace(
        ckpt, tensors={k: v for k, v in ckpt.tensors.items() if k != "pos_emb.weight"}
    )
    with pytest.raises(
        CheckpointError,
        match=r"it lacks 1 tensor\(s\) its config's model has, e.g. pos_emb.weight, "
        r"so its state.json 'config' does not describe its weights",
    ):
        check_weights_fit(fewer, model_state)
    more = dataclasses.replace(ckpt, tensors={**ckpt.tensors, "extra.bias": torch.zeros(2)})
    with pytest.raises(
        CheckpointError, match=r"it holds 1 tensor\(s\) its config's model lacks, e.g. extra.bias"
    ):
        check_weights_fit(more, model_state)


# peft reads transformers' deprecated is_gradient_checkpointing
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_a_qlora_checkpoint_exports_without_a_gpu_or_bitsandbytes(tmp_path, tiny_llama):
    """A QLoRA run's checkpoint holds its adapters, its state.json model.load_in_4bit: export puts
    them on the base reloaded in full precision, and --merge-lora merges them into it (not into
    4-bit weights: lockstep.models.quantize says why); lockstep.json says what they were trained
    on."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .hf_saved import lora_llama, save_hf_checkpoint

    base = tiny_llama
    # the adapters' names and shapes are those of a 4-bit run (tests/unit/models/test_quantize.py)
    model, cfg = lora_llama(base)
    cfg.model.load_in_4bit = True
    save_hf_checkpoint(tmp_path / "run", model, cfg)
    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        out = export_checkpoint(tmp_path / "run", tmp_path / "adapter")
        info = json.loads((out / "lockstep.json").read_text())
        assert info["format"] == "adapter" and info["base_model"] == str(base.resolve())
        assert info["base_quantization"] == "bitsandbytes nf4, double quantization (QLoRA)"
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out).eval()
        torch.testing.assert_close(adapter(input_ids=ids).logits, want, atol=1e-5, rtol=0)

        out = export_checkpoint(tmp_path / "run", tmp_path / "merged", merge_lora=True)
        info = json.loads((out / "lockstep.json").read_text())
        assert info["format"] == "merged" and "reloaded in full precision" in info["note"]
        merged = AutoModelForCausalLM.from_pretrained(out).eval()
        weights = merged.state_dict()
        assert not any("lora" in k for k in weights)
        assert {v.dtype for v in weights.values()} == {torch.float32}  # model.dtype, nothing 4-bit
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-4, rtol=0)
