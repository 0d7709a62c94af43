"""What a committed checkpoint dir holds: the format version, its file names, the manifest that lists them.

A step dir RUN/checkpoints/step_NNNNNNNN holds model.safetensors (or DCP's .metadata and shards when its
manifest says "layout": "sharded"), optimizer.pt, rng.pt, state.json, extra files (tokenizer.json) and
manifest.json: the size and sha256 of every other file, and the sha256 of its own canonical JSON.

Reads the files of one checkpoint dir, writes nothing; imports nothing else of lockstep.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

# 1: the built-in GPT's attn.qkv held [q | k | v] (converted on load by the model's upgrade); 2: head-major
# qkv rows; 3: the manifest holds the sha256 of its own canonical JSON (MANIFEST_SHA256). Older lockstep
# versions refuse format 3 rather than skip that check; format-2 manifests have no such field and still load.
FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
MODEL, OPTIMIZER, RNG, STATE, MANIFEST = (
    "model.safetensors",
    "optimizer.pt",
    "rng.pt",
    "state.json",
    "manifest.json",
)
COMPRESSION = "grad_compression.pt"  # parallel.grad_compression's state between steps (PowerSGD), every rank's
# manifest "layout" of lockstep.checkpoint.sharded; DCP's index
SHARDED, DCP_METADATA = ("sharded", ".metadata")
MANIFEST_SHA256 = "manifest_sha256"
# state.json key of an in-memory snapshot (lockstep.checkpoint.memory), never a committed checkpoint
SNAPSHOT_MARK = "memory_snapshot"
RESERVED = {
    MODEL,
    OPTIMIZER,
    RNG,
    STATE,
    MANIFEST,
    COMPRESSION,
}  # not allowed as names of extra files
STEP_DIR = re.compile(r"^step_(\d{8,})$")
_CHUNK = 1 << 20


def step_of(path: Path) -> int:
    """The step of a step_NNNNNNNN dir."""
    return int(STEP_DIR.match(path.name)[1])


def is_extra(name: str) -> bool:
    """Whether a listed file is one of the caller's extra files (tokenizer.json), not lockstep's or DCP's own."""
    # DCP's .metadata and __R_N.distcp shards
    return name not in RESERVED and not name.startswith((".", "__"))


def is_sharded(ckpt_dir) -> bool:
    """Whether a checkpoint dir was written by every rank (its manifest, or DCP's index when that is gone)."""
    path = Path(ckpt_dir)
    manifest, _ = read_manifest(path)
    if manifest is not None:
        return manifest.get("layout") == SHARDED
    return (path / DCP_METADATA).is_file() and not (path / MODEL).is_file()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> dict:
    """A manifest entry: size and sha256 (ranks hash their own shards and send these to rank 0)."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def new_manifest(step: int, files: dict[str, dict], layout: str | None = None) -> dict:
    """A manifest of `files` (name -> file_entry), its own checksum last."""
    manifest = {"format": FORMAT, "step": step, "files": files}
    if layout is not None:
        manifest["layout"] = layout
    manifest[MANIFEST_SHA256] = manifest_digest(manifest)
    return manifest


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no spaces), its own checksum field left out."""
    rest = {k: v for k, v in manifest.items() if k != MANIFEST_SHA256}
    return hashlib.sha256(
        json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """(the manifest of a checkpoint dir, None) or (None, what is wrong with it)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None, f"{MANIFEST}: missing (the save never finished)"
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST}: unreadable ({e})"
    if not isinstance(manifest, dict):
        return None, f"{MANIFEST}: holds a {type(manifest).__name__}, not a manifest"
    # its own checksum first: a flipped bit in a recorded size or sha256 must not be blamed on that file
    recorded = manifest.get(MANIFEST_SHA256)
    if recorded is not None and recorded != manifest_digest(manifest):
        return None, (
            f"{MANIFEST} damaged: its contents no longer match its own checksum ({MANIFEST_SHA256}), "
            "so the files it lists cannot be checked against it"
        )
    files = manifest.get("files")
    if (
        not isinstance(files, dict)
        or manifest.get("format") not in READABLE_FORMATS
        or not all(isinstance(entry, dict) for entry in files.values())
    ):
        return None, f"{MANIFEST}: not a format-{'/'.join(map(str, READABLE_FORMATS))} manifest"
    if recorded is None and manifest["format"] >= 3:
        return (
            None,
            f"{MANIFEST} damaged: a format-{manifest['format']} manifest without its {MANIFEST_SHA256}",
        )
    return manifest, None
