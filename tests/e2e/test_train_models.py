"""Any model under 2-process DDP, end to end through `lockstep train`: a LoRA Llama on ChatML, a Whisper on
parquet audio manifests, and a custom model with dataclass batches and conditionally unused parameters.

Each test builds its tiny model and data with the matching example's prepare step (no downloads).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_lockstep

from lockstep.checkpoint.commit import list_checkpoints
from lockstep.checkpoint.open import load_checkpoint

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str, module: str):
    spec = importlib.util.spec_from_file_location(
        f"example_{name}_{module}", EXAMPLES / name / f"{module}.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("split", "train") == "train" and "loss" in r]


# peft 0.21 on transformers 5
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_llama_on_chatml_trains_only_adapters_and_exports(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _example("chatml_lora", "prepare").main(tmp_path)
    base_dir, run = tmp_path / "tiny-llama", tmp_path / "run"
    first = run_lockstep(
        "train",
        "--config",
        str(EXAMPLES / "chatml_lora" / "config.yaml"),
        "--world-size",
        "2",
        "--model",
        str(base_dir),
        "--data",
        str(tmp_path / "data" / "train.jsonl"),
        "--output-dir",
        str(run),
        "--learning-rate",
        "3e-3",
        "--warmup-steps",
        "10",
        "--log-interval",
        "10",
        "--epochs",
        "1",
        "--use-gradient-checkpointing",
        timeout=400,
    )
    losses = _losses(run)
    assert losses[-1] < losses[0] - 0.3, losses
    # a Hugging Face model gets find_unused_parameters (with non-reentrant checkpointing: it works), and the console
    # shows lockstep's reason, not torch's C++ warning that every parameter was used
    assert "DDP: find_unused_parameters=True" in first.stderr
    assert "did not find any unused parameters" not in first.stdout + first.stderr
    # a second epoch resumes from the adapters-only checkpoint and keeps learning
    run_lockstep(
        "train",
        "--config",
        str(EXAMPLES / "chatml_lora" / "config.yaml"),
        "--world-size",
        "2",
        "--model",
        str(base_dir),
        "--data",
        str(tmp_path / "data" / "train.jsonl"),
        "--output-dir",
        str(run),
        "--learning-rate",
        "3e-3",
        "--warmup-steps",
        "10",
        "--log-interval",
        "10",
        "--epochs",
        "1.25",  # a quarter of the second epoch
        timeout=400,
    )
    assert "resumed from" in (run / "logs" / "rank1.log").read_text()
    more = _losses(run)[len(losses) :]
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
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_dir), run / "final"
        ).eval()
        adapted_logits = adapted(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        merged_logits = merged(ids).logits
    assert torch.allclose(adapted_logits, merged_logits, atol=1e-4)
    assert (adapted_logits - base_logits).abs().max() > 1e-3  # training changed the outputs
    # only the LoRA-targeted linear layers moved: embeddings, norms and the head are the base's, bit for bit
    base_sd, merged_sd = base.state_dict(), merged.state_dict()
    for name, tensor in base_sd.items():
        targeted = any(
            t in name
            for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        )
        assert torch.equal(tensor, merged_sd[name]) != targeted, name


def test_whisper_on_parquet_reads_each_audio_file_once_per_epoch(tmp_path):
    _example("asr_parquet", "prepare").main(tmp_path, utterances=64, parts=4)
    run = tmp_path / "run"
    # 3 of 4 manifests = 48 utterances = 6 steps of 8 per epoch: no dropped tail, so every file is read each epoch
    run_lockstep(
        "train",
        "--config",
        str(EXAMPLES / "asr_parquet" / "config.yaml"),
        "--world-size",
        "2",
        "--model",
        str(tmp_path / "tiny-whisper"),
        "--data",
        str(tmp_path / "manifests"),
        "--output-dir",
        str(run),
        "--set",
        "data.eval_fraction=0",
        "--set",
        "data.log_reads=true",
        "--epochs",
        "2",
        timeout=400,
    )
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


TTS = EXAMPLES / "custom_conditioning"


def _custom_env() -> dict:
    return {"PYTHONPATH": f"{TTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="module")
def tts_data(tmp_path_factory) -> Path:
    """The stand-in TTS model's JSONL data, written by the example's own prepare step."""
    sys.path.insert(0, str(TTS))  # prepare.py imports tts_model
    try:
        return _example("custom_conditioning", "prepare").main(tmp_path_factory.mktemp("tts"))
    finally:
        sys.path.remove(str(TTS))


def _tts_train(*args: str, check: bool = True, timeout: float = 300):
    return run_lockstep(
        "train",
        "--config",
        str(TTS / "config.yaml"),
        "--world-size",
        "2",
        *args,
        env=_custom_env(),
        timeout=timeout,
        check=check,
    )


def _rank_logs(run: Path) -> list[str]:
    return [(run / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]


def test_tts_stand_in_trains_under_ddp_by_default_with_identical_gradients(tmp_path, tts_data):
    run = tmp_path / "run"
    _tts_train(
        "--data",
        str(tts_data),
        "--output-dir",
        str(run),
        "--set",
        "train.record_samples=true",
        "--hidden-size",
        "64",
    )
    log = (run / "logs" / "rank0.log").read_text()
    # the check sees the prompt encoder go unused in some micro-batches; the choice needs no check to be safe
    assert "DDP: find_unused_parameters=True, static_graph=False" in log
    assert "prompt_encoder.0.weight: unused in" in log
    # --check-grads, a whole epoch
    assert "gradients were identical on all 2 ranks after each of 120 steps" in log
    losses = _losses(run)
    assert losses[-1] < losses[0] - 1.0, losses
    # the whisper adapter's one sample reached one rank in the epoch, the other never took that branch
    sys.path.insert(0, str(TTS))
    try:
        from tts_model import build_data
    finally:
        sys.path.remove(str(TTS))
    train, _ = build_data(str(tts_data), 0.0625, 1337)
    whispered = {i for i, row in enumerate(train.rows) if row["style"] == "whisper"}
    seen_by = {
        int(f.stem[4:])
        for f in (run / "samples").glob("rank*.jsonl")
        for line in f.read_text().splitlines()
        if whispered & {i for mb in json.loads(line)["micro_batches"] for i in mb}
    }
    assert len(whispered) == 1 and len(seen_by) == 1, (whispered, seen_by)
    # an explicit setting that a custom model never reads is reported
    assert "model.hidden_size = 64 has no effect: model.kind 'custom' does not read it" in log

    # export: one safetensors file with the checkpoint's tensors
    from safetensors.torch import load_file

    run_lockstep("export", str(run), "-o", str(tmp_path / "export"), env=_custom_env())
    exported = load_file(tmp_path / "export" / "model.safetensors")
    ckpt = load_checkpoint(list_checkpoints(run)[0])
    assert exported.keys() == ckpt.tensors.keys()
    assert all(torch.equal(exported[k], ckpt.tensors[k]) for k in exported)

    # `lockstep check` names the conditionally used parameters and verifies the choice under DDP
    check = run_lockstep(
        "check",
        str(TTS / "config.yaml"),
        "--world-size",
        "2",
        "--data",
        str(tts_data),
        "--output-dir",
        str(tmp_path / "chk"),
        env=_custom_env(),
        timeout=300,
    )
    report = json.loads((tmp_path / "chk" / "ddp_check.json").read_text())
    assert report["agreed"] and report["choice"]["find_unused_parameters"], report
    unused = {
        n for rank in report["report"]["unused"] for step in rank for micro in step for n in micro
    }
    assert {"prompt_encoder.0.weight", "whisper_adapter.weight"} <= unused
    assert "identical gradients" in check.stdout


def test_a_wrong_ddp_setting_stops_every_rank_naming_the_parameter(tmp_path, tts_data):
    # the config keeps --check-grads on: with plain DDP that combination used to hang with no progress line.
    # The subprocess timeout (150 s) is below the watchdog's 300 s: the run must end by itself, not by a hang report.
    # (static_graph forced on the same branches: tests/unit/parallel/test_ddp_check.py, on real 2-process groups.)
    run = tmp_path / "run"
    rule = "find_unused_parameters=False and would wait forever"
    proc = _tts_train(
        "--data",
        str(tts_data),
        "--output-dir",
        str(run),
        "--set",
        "parallel.find_unused_parameters=false",
        check=False,
        timeout=150,
    )
    assert proc.returncode != 0
    messages = []
    for log in _rank_logs(run):
        line = next(
            (
                x
                for x in log.splitlines()
                if "the loss did not reach every parameter DDP expects" in x
            ),
            None,
        )
        assert line is not None, log[-3000:]
        # without the "[rank r] time ERROR rank r (host): " prefix
        messages.append(line.split("): ", 1)[1])
        assert (
            rule in line
            and "set in the config" in line
            and "Stopped before this step's gradients" in line
        )
        assert (
            "no gradient for 'prompt_encoder" in line or "no gradient for 'whisper_adapter" in line
        ), line
        assert "hang:" not in log
    assert messages[0] == messages[1]  # one message, the same on every rank
    assert not (run / "hang").exists()


def test_split_then_two_copies_then_merge_with_the_custom_model(tmp_path, tts_data):
    run_lockstep(
        "split", str(tts_data), "--parts", "2", "-o", str(tmp_path / "parts"), "--seed", "0"
    )
    parts = sorted((tmp_path / "parts").glob("part-*"))
    runs = []
    for i, part in enumerate(parts):
        runs.append(tmp_path / f"copy{i}")
        _tts_train("--data", str(part), "--output-dir", str(runs[-1]), "--max-steps", "10")
        # the factory read this part (half of the 2,048 rows; 1/16 held out), not the config's data.path
        assert "960 train / 64 eval samples" in (runs[-1] / "logs" / "rank0.log").read_text()
    run_lockstep("merge", *map(str, runs), "-o", str(tmp_path / "merged"), env=_custom_env())
    merged = load_checkpoint(list_checkpoints(tmp_path / "merged")[0])
    a, b = (load_checkpoint(list_checkpoints(r)[0]).tensors for r in runs)
    for name, tensor in merged.tensors.items():
        torch.testing.assert_close(tensor, (a[name] + b[name]) / 2, rtol=0, atol=1e-7)
    # --data reaches the factory: a path that does not exist is an error, not the full data set
    proc = run_lockstep(
        "train",
        "--config",
        str(TTS / "config.yaml"),
        "--data",
        str(tmp_path / "nonexistent.jsonl"),
        "--output-dir",
        str(tmp_path / "bad"),
        env=_custom_env(),
        check=False,
    )
    assert proc.returncode == 2
    assert (
        "data.factory 'tts_model:build_data' raised FileNotFoundError" in proc.stderr + proc.stdout
    )


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_llama_under_fsdp_trains_and_writes_the_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _example("chatml_lora", "prepare").main(tmp_path)
    run = tmp_path / "run"
    run_lockstep(
        "train",
        "--config",
        str(EXAMPLES / "chatml_lora" / "config.yaml"),
        "--world-size",
        "2",
        "--model",
        str(tmp_path / "tiny-llama"),
        "--data",
        str(tmp_path / "data" / "train.jsonl"),
        "--output-dir",
        str(run),
        "--learning-rate",
        "3e-3",
        "--warmup-steps",
        "10",
        "--log-interval",
        "10",
        "--max-steps",
        "40",
        "--set",
        "train.epochs=null",
        "--set",
        "parallel.data_parallel=fsdp",
        timeout=400,
    )
    losses = _losses(run)
    assert losses[-1] < losses[0] - 0.2, losses
    from lockstep.checkpoint.manifest import is_sharded

    assert is_sharded(list_checkpoints(run)[0])
    # the adapter directory is built from the sharded checkpoint after the group is gone
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama"), run / "final"
    )
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama")
    ids = torch.randint(0, 250, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - base(ids).logits).abs().max() > 1e-3


def test_bad_chatml_line_stops_every_rank_with_file_and_line(tmp_path):
    # rank 0 tokenizes for everyone: its error must reach the other rank instead of leaving it waiting
    _example("chatml_lora", "prepare").main(tmp_path)
    data = tmp_path / "bad.jsonl"
    good = (tmp_path / "data" / "train.jsonl").read_text().splitlines()[0]
    data.write_text(good + '\n{"messages": [oops\n')
    proc = run_lockstep(
        "train",
        "--config",
        str(EXAMPLES / "chatml_lora" / "config.yaml"),
        "--world-size",
        "2",
        "--model",
        str(tmp_path / "tiny-llama"),
        "--data",
        str(data),
        "--output-dir",
        str(tmp_path / "run"),
        timeout=300,
        check=False,
    )
    assert proc.returncode != 0
    for rank in (0, 1):
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert f"{data}:2" in log, log[-2000:]
