"""The trained model behind a path a user gives `lockstep sample` / `lockstep evaluate`.

    RUN                     its newest checkpoint that verifies (RUN/final when it has no checkpoint)
    RUN/checkpoints/step_N  that checkpoint: its state.json 'config' says model.kind / path / task / LoRA
    a model directory       what lockstep wrote for from_pretrained (RUN/final, `lockstep export` of an hf
                            checkpoint): config.json, or lockstep.json + adapter_config.json for an adapter

`resolve_trained(path)` reads only small JSON files, so a caller can pick what to do with the model (generate,
transcribe, speak) before any weights load; `load_trained_hf(trained)` then loads the model with its adapters
merged in, in eval mode, and its processor.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from lockstep.checkpoint.manifest import MANIFEST, STATE
from lockstep.config import Config, ModelConfig, config_from_dict
from lockstep.errors import CheckpointError, ConfigError
from lockstep.tools.export import checkpoint_config, load_verified_checkpoint, resolve_checkpoint

HF_INFO = "lockstep.json"  # what lockstep.models.hf.save_hf_model writes beside the weights
TTS_TASK, TTS_MODEL_TYPES = "text-to-speech", ("higgs_audio_v2",)
_ACCEPTS = (
    "pass a run directory (RUN), one of its checkpoints (RUN/checkpoints/step_N), or a model directory "
    "lockstep wrote (RUN/final, or the output of `lockstep export`)"
)


@dataclass
class Trained:
    path: Path  # the checkpoint, or the model directory, that was chosen
    cfg: Config  # the run's config (a checkpoint's), or one describing a model directory (kind hf, path, task)
    model_type: str | None  # config.json's model_type (hf), None for gpt / custom
    run_dir: Path | None  # the run the path belongs to, None for a stand-alone model directory
    # a model directory's lockstep.json format (adapter | merged | full); None: a checkpoint
    hf_format: str | None = None

    @property
    def from_checkpoint(self) -> bool:
        return self.hf_format is None

    @property
    def task(self) -> str | None:
        """model.task for hf models ("text-to-speech" for the TTS model types), None for gpt / custom."""
        if self.cfg.model.kind != "hf":
            return None
        return TTS_TASK if self.model_type in TTS_MODEL_TYPES else self.cfg.model.task

    def describe(self) -> str:
        what = self.task or self.cfg.model.kind
        return f"{self.path} ({what}{f', {self.model_type}' if self.model_type else ''})"


def _is_model_dir(path: Path) -> bool:
    return (
        path.is_dir()
        and ((path / HF_INFO).is_file() or (path / "config.json").is_file())
        and not (path / MANIFEST).is_file()
    )


def resolve_trained(path: str | Path) -> Trained:
    """What `path` holds, from its JSON files alone; CheckpointError / FileNotFoundError when it is nothing usable."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; {_ACCEPTS}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a directory; {_ACCEPTS}")
    if _is_model_dir(path):
        run = path.parent if (path.parent / "checkpoints").is_dir() else None
        return _model_dir(path, run)
    run = path.parent if path.name == "checkpoints" else path
    final = run / "final"
    if _is_model_dir(final) and not any((run / "checkpoints").glob("step_*")):
        return _model_dir(final, run)  # a run whose checkpoints were removed by hand
    # or the error export and merge give for a directory without one
    ckpt = resolve_checkpoint(path)
    cfg = _checkpoint_config(ckpt)
    model_type = _model_type(cfg.model.path) if cfg.model.kind == "hf" and cfg.model.path else None
    return Trained(
        ckpt, cfg, model_type, ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    )


def _checkpoint_config(ckpt: Path) -> Config:
    """state.json's 'config', read without loading the tensors; a damaged checkpoint says how it is damaged."""
    try:
        tree = json.loads((ckpt / STATE).read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        tree = None
    if not isinstance(tree, dict):
        return checkpoint_config(load_verified_checkpoint(ckpt))  # raises, naming what is wrong
    return config_from_dict(tree, source=str(ckpt / STATE))


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read as JSON ({e}); {_ACCEPTS}") from None
    return data if isinstance(data, dict) else {}


def _model_type(model_path: str) -> str | None:
    """config.json's model_type at model.path (a directory, or a hub id in the local cache); None where there is
    none: loading the model then says what is wrong."""
    config = Path(model_path).expanduser() / "config.json"
    if not config.is_file():
        from lockstep.models.hf import resolve_hf_path

        try:
            config = Path(resolve_hf_path(model_path)[0]) / "config.json"
        except ConfigError:
            return None
    return _read_json(config).get("model_type") if config.is_file() else None


def _model_dir(path: Path, run: Path | None) -> Trained:
    info = _read_json(path / HF_INFO) if (path / HF_INFO).is_file() else {}
    fmt = info.get("format", "full")
    if fmt == "adapter":
        base = info.get("base_model") or _read_json(path / "adapter_config.json").get(
            "base_model_name_or_path"
        )
        if not base:
            raise CheckpointError(
                f"{path} holds a LoRA adapter whose base model is not recorded (no base_model in "
                f"{HF_INFO} or adapter_config.json); {_ACCEPTS}"
            )
        config_dir = Path(base).expanduser()
    else:
        base, config_dir = str(path), path
    if not (config_dir / "config.json").is_file():
        from lockstep.models.hf import resolve_hf_path

        config_dir = Path(resolve_hf_path(base)[0])  # a hub id in the local cache, or a clear error
    config = _read_json(config_dir / "config.json")
    model_type = config.get("model_type")
    task = TTS_TASK if model_type in TTS_MODEL_TYPES else infer_task(config, path)
    model = ModelConfig(kind="hf", path=str(base), task=task, use_lora=fmt == "adapter")
    return Trained(path, Config(model=model), model_type, run, fmt)


def infer_task(config: dict, where: Path) -> str:
    """The lockstep model.task of an HF config.json: from its architectures, else from its model_type."""
    from transformers.models.auto import modeling_auto as auto

    mappings = {
        "speech-seq2seq": auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
        "ctc": auto.MODEL_FOR_CTC_MAPPING_NAMES,
        "causal-lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "seq2seq-lm": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        "sequence-classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    }
    for arch in config.get("architectures") or []:
        for task, names in mappings.items():
            if arch in names.values():
                return task
    for task, names in mappings.items():
        if config.get("model_type") in names:
            return task
    raise ConfigError(
        f"{where}: config.json describes a {config.get('model_type')!r} model "
        f"({', '.join(config.get('architectures') or ['no architectures'])}), which no lockstep task "
        f"({', '.join(mappings)}) loads; sample it with its own code"
    )


def load_trained_hf(trained: Trained, device: str = "cpu", build=None) -> tuple[nn.Module, Any]:
    """(the model in eval mode with any LoRA adapters merged in, its HFProcessor), on `device`.

    `build(ModelConfig) -> nn.Module` loads model.path (default: lockstep.models.hf.build_hf_model; the Higgs
    text-to-speech model has its own, lockstep.models.higgs.build_higgs_model).
    """
    from lockstep.models.hf import (
        INSTALL_HINT,
        build_hf_model,
        load_hf_processor,
        load_trainable_state_dict,
    )
    from lockstep.models.quantize import full_precision_config

    build_hf_model = build or build_hf_model
    # a QLoRA run's adapters on its base in model.dtype
    m = full_precision_config(trained.cfg.model)
    if trained.from_checkpoint:
        ckpt = load_verified_checkpoint(trained.path)
        model = build_hf_model(m)  # model.path's weights, wrapped with LoRA as the run was
        # full weights: no LoRA, or a sharded (fsdp) checkpoint
        if set(model.state_dict()) <= set(ckpt.tensors):
            model.load_state_dict(ckpt.tensors)
        else:  # a LoRA checkpoint holds the adapters alone
            load_trainable_state_dict(model, ckpt.tensors)
        processor = load_hf_processor(m)
    elif trained.hf_format == "adapter":
        try:
            from peft import PeftModel
        except ImportError as e:
            raise ConfigError(
                f"{trained.path} holds a LoRA adapter, which needs peft ({e}); install it: "
                f"{INSTALL_HINT}"
            ) from None
        base = build_hf_model(ModelConfig(kind="hf", path=m.path, task=m.task, dtype=m.dtype))
        # peft reads model.is_gradient_checkpointing, which transformers 5 deprecated
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
            )
            model = PeftModel.from_pretrained(base, str(trained.path))
        has_tokenizer = (trained.path / "tokenizer_config.json").is_file()
        processor = load_hf_processor(
            ModelConfig(kind="hf", path=str(trained.path) if has_tokenizer else m.path, task=m.task)
        )
    else:
        model, processor = build_hf_model(m), load_hf_processor(m)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()  # one plain model: generate() is the base class's own
    return model.to(device).eval(), processor
