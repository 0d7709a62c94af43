"""lockstep.models.quantize: QLoRA's refusals (off CUDA, FSDP, bitsandbytes missing or old) as one
line with the fix, made before any worker starts (`lockstep train`) and again in the worker, before
a weight is read; the BitsAndBytesConfig built; the version floor kept with pyproject's qlora extra.

Loading, training and saving a 4-bit base runs on a GPU (tests/gpu/test_qlora.py). Where
bitsandbytes is installed (the qlora extra), the last test here also loads a 4-bit base on the CPU,
through bitsandbytes' CPU backend: lockstep refuses it for training, but it runs the same code.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from conftest import run_main

from lockstep.config import ModelConfig
from lockstep.errors import ConfigError
from lockstep.models.quantize import (
    MIN_BITSANDBYTES,
    QLORA_HINT,
    build_bnb_config,
    check_4bit_training,
    full_precision_config,
    logical_numel,
    quantized_device,
)

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[3]
CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # a device object: no GPU is touched
OFF_CUDA = (
    "model.load_in_4bit needs a CUDA device: a 4-bit base is there to save GPU memory, and "
    "lockstep runs bitsandbytes' 4-bit layers on NVIDIA GPUs only, but this process trains on cpu"
)
FIX = "drop --load-in-4bit (LoRA on the full-precision base: --use-lora) or run on a GPU node"


def qlora_cfg(path, **overrides) -> ModelConfig:
    return ModelConfig(
        kind="hf",
        path=str(path),
        use_lora=True,
        load_in_4bit=True,
        lora_rank=4,
        lora_alpha=8.0,
        lora_dropout=0.0,
        **overrides,
    )


@pytest.fixture(scope="module")
def llama_dir(tiny_llama):
    return tiny_llama  # the session's (tests/unit/conftest.py)


def fake_bitsandbytes(root: Path, version: str, monkeypatch) -> None:
    """An installed distribution's metadata (what pip writes) for bitsandbytes `version`, first on
    sys.path: what require_bitsandbytes reads."""
    info = root / f"bitsandbytes-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: bitsandbytes\nVersion: {version}\n"
    )
    monkeypatch.syspath_prepend(str(root))


def test_bnb_config_is_qlora_nf4_with_double_quantization():
    cfg = build_bnb_config(native_bf16=True)
    assert (cfg.load_in_4bit, cfg.load_in_8bit) == (True, False)
    assert cfg.bnb_4bit_quant_type == "nf4" and cfg.bnb_4bit_use_double_quant is True
    assert cfg.bnb_4bit_compute_dtype == torch.bfloat16
    assert cfg.to_dict()["quant_method"] == "bitsandbytes"
    # a GPU without native bf16 (before compute capability 8.0: V100, T4) computes in fp16
    assert build_bnb_config(native_bf16=False).bnb_4bit_compute_dtype == torch.float16


def test_off_cuda_the_refusal_is_one_line_with_the_fix(tmp_path):
    with pytest.raises(ConfigError) as e:
        check_4bit_training(qlora_cfg(tmp_path), "ddp", CPU)
    message = str(e.value)
    assert message.startswith(OFF_CUDA) and message.endswith(FIX) and "\n" not in message
    if not torch.cuda.is_available():
        assert "; this machine has no GPU (torch.cuda.is_available() is False); " in message
    # the device is checked before the layout
    with pytest.raises(ConfigError, match="trains on cpu"):
        check_4bit_training(qlora_cfg(tmp_path), "fsdp", CPU)
    for data_parallel in ("ddp", "fsdp"):  # a model without load_in_4bit is none of its business
        check_4bit_training(ModelConfig(kind="hf", use_lora=True), data_parallel, CPU)


def test_fsdp_is_refused_with_the_reason_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as e:
        check_4bit_training(qlora_cfg(tmp_path), "fsdp", GPU)
    assert str(e.value).startswith(
        "model.load_in_4bit with parallel.data_parallel = 'fsdp': lockstep "
        "does not shard a 4-bit base ("
    )
    assert "sharded checkpoints save every parameter" in str(e.value)
    assert str(e.value).endswith(
        "set parallel.data_parallel: ddp (each GPU holds the whole 4-bit base, "
        "which QLoRA makes small) or train on one GPU"
    )


def test_bitsandbytes_missing_or_too_old_names_the_extra(tmp_path, monkeypatch):
    import importlib.metadata

    try:
        importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        with pytest.raises(ConfigError) as e:
            check_4bit_training(qlora_cfg(tmp_path), "ddp", GPU)
        assert str(e.value) == (
            f"model.load_in_4bit needs bitsandbytes >= {MIN_BITSANDBYTES} (transformers loads "
            f"4-bit weights through it): bitsandbytes is not installed; install it: {QLORA_HINT}"
        )
    fake_bitsandbytes(tmp_path / "old", "0.45.5", monkeypatch)
    with pytest.raises(
        ConfigError,
        match=r"bitsandbytes 0\.45\.5 is installed, older than 0\.46\.1; "
        r"install it: pip install 'lockstep\[qlora\]'",
    ):
        check_4bit_training(qlora_cfg(tmp_path), "ddp", GPU)
    monkeypatch.undo()
    fake_bitsandbytes(tmp_path / "new", "0.50.2.dev0", monkeypatch)
    check_4bit_training(qlora_cfg(tmp_path), "ddp", GPU)  # CUDA, DDP, bitsandbytes new enough: fine


def test_the_version_floor_is_pyprojects_and_at_least_transformers():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from transformers.utils import import_utils

    from lockstep.models.quantize import _release

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["qlora"] == [f"bitsandbytes>={MIN_BITSANDBYTES}"]
    # the qlora extra is asked for by name, never pulled in by another (CI's test extra among them)
    assert [
        name
        for name, reqs in extras.items()
        if any("bitsandbytes" in r or "qlora" in r for r in reqs)
    ] == ["qlora"]
    assert _release(MIN_BITSANDBYTES) >= _release(import_utils.BITSANDBYTES_MIN_VERSION)


def test_quantized_device_is_cuda_or_the_refusal():
    assert quantized_device(GPU) == GPU
    with pytest.raises(ConfigError, match=OFF_CUDA):
        quantized_device(CPU)
    # None: the GPU this process is bound to, and here there is none
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="this machine has no GPU"):
            quantized_device(None)


def test_the_worker_refuses_before_reading_a_weight(tmp_path):
    # model.path does not exist: the refusal comes before lockstep looks at it
    with pytest.raises(ConfigError, match=OFF_CUDA):
        from lockstep.models.hf import build_hf_model

        build_hf_model(qlora_cfg(tmp_path / "nope"), CPU)


def test_full_precision_config_and_logical_numel(tmp_path):
    cfg = qlora_cfg(tmp_path, dtype="bfloat16", lora_target_modules="q_proj,v_proj")
    full = full_precision_config(cfg)
    assert not full.load_in_4bit and full.use_lora and full.dtype == "bfloat16"
    assert full.lora_target_modules == "q_proj,v_proj" and cfg.load_in_4bit  # a copy: cfg is kept
    assert logical_numel(torch.zeros(3, 4)) == 12


# ---------------------------------------------------------- through `lockstep train`


def chat_file(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            }
        )
        + "\n"
    )
    return path


def train_argv(llama_dir, tmp_path, *extra) -> list:
    return [
        "train",
        "--model-kind",
        "hf",
        "--model",
        llama_dir,
        "--use-lora",
        "--load-in-4bit",
        "--data-kind",
        "chatml",
        "--data",
        chat_file(tmp_path),
        "--output-dir",
        tmp_path / "run",
        "--device",
        "cpu",
        *extra,
    ]


def test_lockstep_train_refuses_before_any_worker_starts(llama_dir, tmp_path, capsys):
    for extra in ([], ["--world-size", "2"], ["--set", "parallel.data_parallel=fsdp"]):
        code, out, err = run_main(capsys, *train_argv(llama_dir, tmp_path, *extra))
        assert (code, out) == (2, "") and err.startswith(f"lockstep train: error: {OFF_CUDA}"), err
        assert err.endswith(f"{FIX}\n") and err.count("\n") == 1, err
        assert not (tmp_path / "run").exists()  # no worker started: nothing was written


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU host the worker loads on its bound GPU "
    "until lockstep.train.setup passes rt.device (--device cpu is then not seen)",
)
def test_a_worker_refuses_in_process(llama_dir, tmp_path, capsys):
    # --rank: this process is a worker of a (1-rank) job, as under torchrun or srun: no pre-launch
    # check runs
    from ..train.tiny import drop_log_handlers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        code, out, err = run_main(
            capsys,
            *train_argv(
                llama_dir,
                tmp_path,
                "--rank",
                "0",
                "--world-size",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ),
        )
    finally:
        drop_log_handlers()
    assert (code, out) == (2, "") and f"{OFF_CUDA}; this machine has no GPU" in err, err
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "ERROR rank 0 (" in log and FIX in log
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------- with bitsandbytes (the qlora extra)


def load_on_cpu(llama_dir, **overrides):
    """The tiny Llama as build_hf_model builds it with load_in_4bit, but on the CPU (bitsandbytes'
    CPU backend): the loader and the training options, without the device check."""
    from lockstep.models.hf import apply_training_options, auto_class, load_hf_config
    from lockstep.models.quantize import load_4bit_model

    path = str(llama_dir)
    base = load_4bit_model(
        auto_class("causal-lm"), path, load_hf_config(path, path), torch.float32, CPU
    )
    return apply_training_options(base, qlora_cfg(llama_dir, **overrides))


def test_with_bitsandbytes_the_base_loads_in_4bit_and_only_adapters_train(llama_dir, tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    from lockstep.models.hf import (
        build_hf_model,
        hf_flops_per_token,
        save_hf_model,
        trainable_state_dict,
    )
    from lockstep.models.hf_loss import hf_forward_loss
    from lockstep.models.quantize import is_4bit

    model = load_on_cpu(llama_dir, gradient_checkpointing=True)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 2 * 7 and is_4bit(model)  # q k v o gate up down, 2 blocks; the head stays
    assert {type(m.weight).__name__ for m in layers.values()} == {"Params4bit"}
    assert {m.weight.dtype for m in layers.values()} == {torch.uint8}
    full = build_hf_model(full_precision_config(qlora_cfg(llama_dir)))
    assert hf_flops_per_token(model) == hf_flops_per_token(full)  # the packed weights count in full
    state = trainable_state_dict(model)
    assert sorted(state) == sorted(trainable_state_dict(full))  # export puts them on the full base
    assert all("lora_" in k and v.dtype == torch.float32 for k, v in state.items())
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    hf_forward_loss(model.train(), {"input_ids": ids, "labels": ids}).backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())
    out = save_hf_model(model, tmp_path / "adapter")
    info = json.loads((out / "lockstep.json").read_text())
    assert info["format"] == "adapter" and info["base_quantization"].startswith("bitsandbytes nf4")
    with pytest.raises(
        ConfigError, match=r"merging LoRA adapters into a 4-bit base .*--merge-lora"
    ):
        save_hf_model(model, tmp_path / "merged", merge_lora=True)
    assert not (tmp_path / "merged").exists()  # refused before anything is written
