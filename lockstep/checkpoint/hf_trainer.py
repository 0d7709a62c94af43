"""Hugging Face Trainer checkpoints (`checkpoint-500/`) recognized and their weights read, for `--resume`.

What a Trainer checkpoint holds, and what lockstep reads of it:

    model.safetensors | model.safetensors.index.json + shards | pytorch_model.bin (+ .index.json)   read (weights)
    adapter_model.safetensors | adapter_model.bin, adapter_config.json (PEFT / LoRA)               read (adapters)
    trainer_state.json                                                                             read (its step)
    optimizer.pt, scheduler.pt, rng_state*.pth, training_args.bin, scaler.pt                       never opened

The files left alone are pickles of HF Trainer's own objects: unpickling them could run code, and their
formats (HF's optimizer grouping, LR scheduler, sampler state) are not lockstep's. `.bin` weights are read
with torch.load(weights_only=True). A lockstep checkpoint (manifest.json / state.json beside its
model.safetensors) is never taken for one, so a damaged lockstep checkpoint is still reported as damaged.
A file that is read and cannot be (truncated by an interrupted copy, say) is refused in one line
that names it, says what is wrong with it, and names the checkpoint-N to resume from instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lockstep.checkpoint.manifest import MANIFEST, STATE
from lockstep.checkpoint.plain import load_pickled_weights_only
from lockstep.errors import CheckpointError

FULL = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
ADAPTER = ("adapter_model.safetensors", "adapter_model.bin")
NOT_READ = re.compile(
    r"^(optimizer\.pt|scheduler\.pt|scaler\.pt|rng_state.*\.pth|training_args\.bin)$"
)
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class HFTrainerCheckpoint:
    path: Path
    weights: Path  # the weights file, or the index of a sharded one
    # PEFT's adapter_config.json: the checkpoint holds LoRA adapters, not a model
    adapter_config: dict | None
    # trainer_state.json's global_step (None: no trainer_state.json, a save_pretrained dir)
    global_step: int | None
    not_read: list[str] = field(default_factory=list)  # the Trainer's files lockstep leaves alone

    @property
    def is_adapter(self) -> bool:
        return self.adapter_config is not None

    def describe(self) -> str:
        at = f", saved at HF global_step {self.global_step}" if self.global_step is not None else ""
        return f"{self.path.name} ({self.weights.name}{at})"


def find_hf_trainer_checkpoint(path: Path) -> HFTrainerCheckpoint | None:
    """The HF Trainer (or save_pretrained) checkpoint at `path`; for an HF Trainer output_dir holding
    checkpoint-N dirs, the one with the highest N; None when `path` is neither."""
    path = Path(path)
    if not path.is_dir():
        return None
    found = _read_dir(path)
    if found is not None:
        return found
    numbered = sorted(
        (int(m.group(1)), p) for p in path.iterdir() if (m := CHECKPOINT_DIR.match(p.name))
    )
    for _, candidate in reversed(numbered):
        found = _read_dir(candidate)
        if found is not None:
            return found
    return None


def _read_dir(path: Path) -> HFTrainerCheckpoint | None:
    if (path / MANIFEST).exists() or (
        path / STATE
    ).exists():  # lockstep's own (maybe damaged): not HF's
        return None
    adapter = next((path / n for n in ADAPTER if (path / n).is_file()), None)
    weights = adapter or next((path / n for n in FULL if (path / n).is_file()), None)
    if weights is None:
        return None
    adapter_config = None
    if adapter is not None:
        adapter_config = _read_json(
            path / "adapter_config.json", "PEFT writes it beside adapter_model.*"
        )
    step = None
    if (path / "trainer_state.json").is_file():
        step = _read_json(
            path / "trainer_state.json", "HF Trainer writes it with every checkpoint"
        ).get("global_step")
    not_read = sorted(p.name for p in path.iterdir() if NOT_READ.match(p.name))
    return HFTrainerCheckpoint(path, weights, adapter_config, step, not_read)


def _read_json(file: Path, what: str) -> dict:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{file.parent} has no {file.name} ({what}); copy the complete checkpoint directory"
        ) from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError too: truncated, or not what HF wrote
        raise damaged(file, f"cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise damaged(file, f"holds a JSON {type(data).__name__}, not an object")
    return data


def damaged(file: Path, what: str) -> CheckpointError:
    """One line: the file of an HF checkpoint, what is wrong with it, and what to do instead."""
    ckpt = file.parent
    m = CHECKPOINT_DIR.match(ckpt.name)
    step = int(m.group(1)) if m else -1
    earlier = sorted(
        (int(n.group(1)), p)
        for p in ckpt.parent.iterdir()
        if (n := CHECKPOINT_DIR.match(p.name)) and int(n.group(1)) < step
    )
    instead = (
        f"resume from an earlier checkpoint (--resume {earlier[-1][1]})"
        if earlier
        else "resume from an earlier checkpoint-N if there is one"
    )
    return CheckpointError(
        f"{file} {what}; {instead}, or save this checkpoint again "
        "(or copy it again, if it was copied)"
    )


def load_hf_trainer_tensors(ckpt: HFTrainerCheckpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's weights (or adapters) on the CPU, keyed as HF saved them; shards joined."""
    if ckpt.weights.name.endswith(".index.json"):
        index = _read_json(ckpt.weights, "the index of a sharded checkpoint")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            what = f"has weight_map {str(weight_map)[:60]}, not a map of tensor names to files"
            raise damaged(ckpt.weights, what)
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted(set(map(str, weight_map.values()))):
            tensors.update(_load_file(ckpt.path / name))
        return tensors
    return _load_file(ckpt.weights)


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(
            f"{file} is missing (named by the checkpoint's index); copy every shard of the checkpoint"
        )
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(file, device="cpu")
        except Exception as e:  # safetensors' SafetensorError, OSError, ...
            raise damaged(file, safetensors_problem(file, e)) from None
    state = load_pickled_weights_only(file, "cpu")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"{file} does not hold a name -> tensor mapping; pass a checkpoint saved by HF Trainer"
        )
    return state


def safetensors_problem(file: Path, error: Exception) -> str:
    """What is wrong with a safetensors file that does not load: its size against what its header
    describes (an 8-byte length, the JSON header, then every tensor's bytes), or safetensors' own
    words."""
    size, length = file.stat().st_size, 0
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length)) if 8 + length <= size else None
        ends = [v["data_offsets"][1] for k, v in (header or {}).items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        header, ends = None, []
    truncated = "truncated (an interrupted save or copy?)"
    if size < 8:
        return f"is {size} bytes, shorter than safetensors' 8-byte header length: {truncated}"
    if header is None and 8 + length > size and length < 100 << 20:  # a plausible header, cut short
        return f"is {size} bytes, shorter than its own {8 + length}-byte header: {truncated}"
    if header is not None and size < 8 + length + max(ends, default=0):
        return f"is {size} bytes, its header describes {8 + length + max(ends)}: {truncated}"
    return f"cannot be read as safetensors ({type(error).__name__}: {error})"
