"""What `lockstep sample` and `lockstep export` (and merge, which shares the lookup) are given instead of a good
checkpoint: each case gets its own message, and every fix names what these commands take, never train's --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_lockstep
from lockstep.errors import CheckpointError
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.config import Config, ModelConfig, config_to_dict
from lockstep.errors import ConfigError
from lockstep.tools.export import export_checkpoint, resolve_checkpoint
from lockstep.models.gpt import build_gpt
from lockstep.tools.sample import load_model_from_checkpoint

PASS = "pass a run directory that has checkpoints, or one of its checkpoints (RUN/checkpoints/step_N)"


def save_gpt(run: Path, step: int, **model) -> Path:
    cfg = Config(model=ModelConfig(**{"hidden_size": 32, "attention_heads": 2, "layers": 1, "max_seq_length": 16,
                                      **model}))
    torch.manual_seed(step)
    return save_checkpoint(run, step, build_gpt(cfg.model).state_dict(), None, None,
                           {"config": config_to_dict(cfg), "step": step})


def truncate(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def user_error(*args: str) -> str:
    proc = run_lockstep(*args, check=False, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])
    assert "--resume" not in proc.stderr and proc.stdout == "", proc.stderr
    return proc.stderr


@pytest.mark.parametrize("command", ["sample", "export"])
def test_directories_without_a_checkpoint(tmp_path, command):
    out = ["-o", str(tmp_path / "exported")] if command == "export" else []
    (tmp_path / "empty").mkdir()
    err = user_error(command, str(tmp_path / "empty"), *out)
    assert err.strip() == f"lockstep {command}: error: {tmp_path / 'empty'} is an empty directory; {PASS}"
    run = tmp_path / "run"  # a run that never reached a save: logs and an unfinished save only
    (run / "logs").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-step_00000002-999999").mkdir(parents=True)
    err = user_error(command, str(run), *out)
    assert f"run directory {run} holds no committed checkpoint yet" in err and PASS in err
    assert "damaged" not in err and "manifest.json" not in err
    assert not (tmp_path / "exported").exists()


def test_other_paths_that_hold_no_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'nope'} does not exist; pass a run directory"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"holds no checkpoint \(no manifest.json, model.safetensors or "
                                              r"checkpoints/ in it\); pass a run directory"):
        resolve_checkpoint(tmp_path / "data")
    with pytest.raises(CheckpointError, match=r"notes.txt is a file, not a checkpoint directory"):
        resolve_checkpoint(tmp_path / "data" / "notes.txt")


def test_run_dir_whose_checkpoints_all_fail_to_verify(tmp_path):
    run = tmp_path / "run"
    for step in (2, 4):
        truncate(save_gpt(run, step))
    proc = run_lockstep("sample", str(run), "--max-new-tokens", "2", check=False)
    assert proc.returncode == 1 and proc.stdout == "" and "--resume" not in proc.stderr, proc.stderr
    assert "checkpoint step_00000004 is damaged (model.safetensors" in proc.stderr  # what was passed over, and why
    assert proc.stderr.strip().splitlines()[-1] == (
        f"lockstep sample: error: no checkpoint of {run} verifies (the problems of each are above; `lockstep verify "
        f"{run}` lists them again); pass another run directory, or a checkpoint that verifies")


def test_damaged_checkpoint_named_directly(tmp_path):
    ckpt = save_gpt(tmp_path / "run", 2)
    truncate(ckpt)
    for load in (load_model_from_checkpoint, lambda p: export_checkpoint(p, tmp_path / "out")):
        with pytest.raises(CheckpointError) as e:
            load(ckpt)
        msg = str(e.value)
        assert msg.startswith(f"checkpoint {ckpt} is damaged (model.safetensors: ") and "--resume" not in msg
        assert msg.endswith("pass another checkpoint of its run, or the run directory for its newest one that "
                            "verifies (`lockstep verify RUN` checks each)")
    (ckpt / "manifest.json").unlink()  # a step dir without its manifest is a damaged checkpoint, not "no checkpoint"
    with pytest.raises(CheckpointError, match=r"is damaged \(manifest.json: missing"):
        load_model_from_checkpoint(ckpt)


def test_newest_damaged_falls_back_and_stdout_stays_the_text(tmp_path):
    run = tmp_path / "run"
    save_gpt(run, 2)
    truncate(save_gpt(run, 4))
    proc = run_lockstep("sample", str(run / "checkpoints"), "--max-new-tokens", "3", "--prompt", "ab")
    assert proc.stdout.startswith("ab") and "damaged" not in proc.stdout  # RUN/checkpoints stands for RUN
    assert "checkpoint step_00000004 is damaged" in proc.stderr and "falling back to step_00000002" in proc.stderr


def test_checkpoint_that_disagrees_with_itself(tmp_path):
    ckpt = save_gpt(tmp_path / "run", 2)
    state = json.loads((ckpt / "state.json").read_text())
    state["config"]["model"]["hidden_size"] = 64
    save_checkpoint(tmp_path / "edited", 2, build_gpt(Config(model=ModelConfig(
        hidden_size=32, attention_heads=2, layers=1, max_seq_length=16)).model).state_dict(), None, None, state)
    with pytest.raises(CheckpointError, match=r"tensor \S+ has shape \(\d+, 32\) but its config's model has "
                                              r"\(\d+, 64\), so its state.json 'config' does not describe its weights"):
        export_checkpoint(tmp_path / "edited", tmp_path / "out")
    save_checkpoint(tmp_path / "bare", 2, {"w": torch.zeros(2)}, None, None, {"step": 2})
    with pytest.raises(CheckpointError, match=r"has no 'config' in its state.json"):
        load_model_from_checkpoint(tmp_path / "bare")


def test_sample_refuses_models_it_cannot_generate_with(tmp_path):
    cfg = Config(model=ModelConfig(kind="custom", factory="mymodels:build"))
    save_checkpoint(tmp_path / "run", 1, {"w": torch.zeros(2)}, None, None, {"config": config_to_dict(cfg), "step": 1})
    with pytest.raises(ConfigError, match=r"generates with the built-in GPT, but .* holds model.kind = 'custom'; "
                                          r"write it out with `lockstep export"):
        load_model_from_checkpoint(tmp_path / "run")
