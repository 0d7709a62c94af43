"""Any model under 2-process DDP, end to end through `lockstep train`: a LoRA Llama on ChatML, a Whisper on
parquet audio manifests, and a custom model with dataclass batches and conditionally unused parameters.

Each test builds its tiny model and data with the matching example's prepare step (no downloads).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import run_lockstep

from lockstep.checkpoint import list_checkpoints, load_checkpoint

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str, module: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}_{module}", EXAMPLES / name / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("split", "train") == "train" and "loss" in r]


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft 0.21 on transformers 5
def test_lora_llama_on_chatml_trains_only_adapters_and_exports(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _example("tts_lora_chatml", "prepare").main(tmp_path)
    base_dir, run = tmp_path / "tiny-llama", tmp_path / "run"
    run_lockstep("train", "--config", str(EXAMPLES / "tts_lora_chatml" / "config.yaml"), "--world-size", "2",
                 "--model", str(base_dir), "--data", str(tmp_path / "data" / "train.jsonl"), "--output-dir", str(run),
                 "--learning-rate", "3e-3", "--warmup-steps", "10", "--log-interval", "10", "--epochs", "1",
                 timeout=400)
    losses = _losses(run)
    assert losses[-1] < losses[0] - 0.3, losses
    # a second epoch resumes from the adapters-only checkpoint and keeps learning
    run_lockstep("train", "--config", str(EXAMPLES / "tts_lora_chatml" / "config.yaml"), "--world-size", "2",
                 "--model", str(base_dir), "--data", str(tmp_path / "data" / "train.jsonl"), "--output-dir", str(run),
                 "--learning-rate", "3e-3", "--warmup-steps", "10", "--log-interval", "10", "--epochs", "2",
                 timeout=400)
    assert "resumed from" in (run / "logs" / "rank1.log").read_text()
    more = _losses(run)[len(losses):]
    assert more and max(more) < losses[0] - 0.3 and min(more) < losses[-1], (losses, more)

    # the checkpoint holds the adapters alone, and the optimizer only knows those tensors
    ckpt = load_checkpoint(list_checkpoints(run)[0])
    assert ckpt.tensors and all("lora_" in k for k in ckpt.tensors), sorted(ckpt.tensors)[:5]
    assert len(ckpt.optimizer_state["state"]) == len(ckpt.tensors)

    # the adapter directory and the merged export load with from_pretrained and agree
    assert (run / "final" / "adapter_config.json").is_file()
    run_lockstep("export", str(run), "-o", str(tmp_path / "merged"), "--merge-lora")
    ids = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), run / "final").eval()
        adapted_logits = adapted(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        merged_logits = merged(ids).logits
    assert torch.allclose(adapted_logits, merged_logits, atol=1e-4)
    assert (adapted_logits - base_logits).abs().max() > 1e-3  # training changed the outputs
    # only the LoRA-targeted linear layers moved: embeddings, norms and the head are the base's, bit for bit
    base_sd, merged_sd = base.state_dict(), merged.state_dict()
    for name, tensor in base_sd.items():
        targeted = any(t in name for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
        assert torch.equal(tensor, merged_sd[name]) != targeted, name


def test_whisper_on_parquet_reads_each_audio_file_once_per_epoch(tmp_path):
    _example("asr_parquet", "prepare").main(tmp_path, utterances=64, parts=4)
    run = tmp_path / "run"
    # 3 of 4 manifests = 48 utterances = 6 steps of 8 per epoch: no dropped tail, so every file is read each epoch
    run_lockstep("train", "--config", str(EXAMPLES / "asr_parquet" / "config.yaml"), "--world-size", "2",
                 "--model", str(tmp_path / "tiny-whisper"), "--data", str(tmp_path / "manifests"),
                 "--output-dir", str(run), "--set", "data.eval_fraction=0", "--set", "data.log_reads=true",
                 "--epochs", "2", timeout=400)
    losses = _losses(run)
    assert losses[-1] < losses[0] - 0.5, losses
    reads: dict[str, int] = {}
    for log in (run / "reads").glob("rank*.txt"):
        for line in log.read_text().splitlines():
            reads[Path(line).name] = reads.get(Path(line).name, 0) + 1
    used = {f"utt{i:04d}.wav" for i in range(48)}  # the first three parquet files
    assert set(reads) == used  # the fourth manifest (data.max_files: 3) is never touched
    assert set(reads.values()) == {2}, {k: v for k, v in reads.items() if v != 2}
    assert len(list((run / "reads").glob("rank*.txt"))) == 2  # both ranks decoded their share


def _custom_env() -> dict:
    return {"PYTHONPATH": f"{EXAMPLES / 'custom_conditioning'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_custom_dataclass_model_with_unused_parameters_trains_with_identical_gradients(tmp_path):
    config = str(EXAMPLES / "custom_conditioning" / "config.yaml")
    run = tmp_path / "run"
    out = run_lockstep("train", "--config", config, "--world-size", "2", "--output-dir", str(run),
                       "--max-steps", "40", env=_custom_env(), timeout=300)
    log = (run / "logs" / "rank0.log").read_text()
    assert "find_unused_parameters=True" in log  # chosen by the check, not by the config
    assert "emotion_proj.weight" in log
    assert "gradients were identical on all 2 ranks after each of 40 steps" in log, out.stdout[-2000:]
    losses = _losses(run)
    assert losses[-1] < losses[0] - 0.5, losses

    # export: one safetensors file with the checkpoint's tensors
    from safetensors.torch import load_file

    run_lockstep("export", str(run), "-o", str(tmp_path / "export"), env=_custom_env())
    exported = load_file(tmp_path / "export" / "model.safetensors")
    ckpt = load_checkpoint(list_checkpoints(run)[0])
    assert exported.keys() == ckpt.tensors.keys()
    assert all(torch.equal(exported[k], ckpt.tensors[k]) for k in exported)

    # `lockstep check` names the conditionally used parameters and verifies the choice under DDP
    check = run_lockstep("check", config, "--world-size", "2", "--output-dir", str(tmp_path / "chk"),
                         env=_custom_env(), timeout=300)
    report = json.loads((tmp_path / "chk" / "ddp_check.json").read_text())
    assert report["agreed"] and report["choice"]["find_unused_parameters"], report
    unused = {n for rank in report["report"]["unused"] for step in rank for n in step}
    assert unused == {"emotion.weight", "emotion_proj.weight", "emotion_proj.bias"}
    assert "identical gradients" in check.stdout


def test_check_grads_stops_at_the_first_divergence_naming_the_parameter(tmp_path):
    # forcing static_graph on a model whose unused parameters differ between ranks: DDP then hands the ranks
    # different gradients without any error (seen here with torch 2.13); --check-grads stops at step 1
    proc = run_lockstep("train", "--config", str(EXAMPLES / "custom_conditioning" / "config.yaml"), "--world-size",
                        "2", "--output-dir", str(tmp_path / "run"), "--max-steps", "20", "--set",
                        "parallel.static_graph=true", "--set", "parallel.find_unused_parameters=false",
                        env=_custom_env(), timeout=300, check=False)
    assert proc.returncode != 0
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "step 1: the gradient of 'embed.weight' differs between ranks" in log, log[-3000:]
    assert "set in the config: find_unused_parameters=False, static_graph=True" in log
    assert not list_checkpoints(tmp_path / "run")  # nothing was committed from diverged replicas


def test_factory_that_does_not_import_is_a_config_error(tmp_path):
    proc = run_lockstep("train", "--model-kind", "custom", "--set", "model.factory=no_such_module:build",
                        "--set", "data.kind=custom", "--set", "data.factory=no_such_module:data",
                        "--output-dir", str(tmp_path / "run"), check=False)
    assert proc.returncode == 2
    assert "no_such_module" in proc.stderr and "PYTHONPATH" in proc.stderr, proc.stderr


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_llama_under_fsdp_trains_and_writes_the_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _example("tts_lora_chatml", "prepare").main(tmp_path)
    run = tmp_path / "run"
    run_lockstep("train", "--config", str(EXAMPLES / "tts_lora_chatml" / "config.yaml"), "--world-size", "2",
                 "--model", str(tmp_path / "tiny-llama"), "--data", str(tmp_path / "data" / "train.jsonl"),
                 "--output-dir", str(run), "--learning-rate", "3e-3", "--warmup-steps", "10", "--log-interval", "10",
                 "--max-steps", "40", "--set", "train.epochs=null", "--set", "parallel.data_parallel=fsdp",
                 timeout=400)
    losses = _losses(run)
    assert losses[-1] < losses[0] - 0.2, losses
    from lockstep.checkpoint_sharded import is_sharded

    assert is_sharded(list_checkpoints(run)[0])
    # the adapter directory is built from the sharded checkpoint after the group is gone
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama"), run / "final")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama")
    ids = torch.randint(0, 250, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - base(ids).logits).abs().max() > 1e-3


def test_bad_chatml_line_stops_every_rank_with_file_and_line(tmp_path):
    # rank 0 tokenizes for everyone: its error must reach the other rank instead of leaving it waiting
    _example("tts_lora_chatml", "prepare").main(tmp_path)
    data = tmp_path / "bad.jsonl"
    good = (tmp_path / "data" / "train.jsonl").read_text().splitlines()[0]
    data.write_text(good + "\n{\"messages\": [oops\n")
    proc = run_lockstep("train", "--config", str(EXAMPLES / "tts_lora_chatml" / "config.yaml"), "--world-size", "2",
                        "--model", str(tmp_path / "tiny-llama"), "--data", str(data), "--output-dir",
                        str(tmp_path / "run"), timeout=300, check=False)
    assert proc.returncode != 0
    for rank in (0, 1):
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert f"{data}:2" in log, log[-2000:]
