"""A sharded snapshot at a restart (lockstep/checkpoint/memory_parts.py): a node offers the files of its
parts that verify and skips those of another run or model; a step is whole only when the parts, under one
manifest, hold every file. Completing each node's copy on real ranks is tested with the writing side in
test_memory_shards.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lockstep.checkpoint.commit import seal_as, start_save
from lockstep.checkpoint.manifest import MANIFEST, SHARDED, SNAPSHOT_MARK, STATE, new_manifest
from lockstep.checkpoint.memory import NodeSnapshots
from lockstep.checkpoint.memory_parts import Part, parts_held, whole_step

SHARDS = {"__0_0.distcp": b"rank 0's shards", "__1_0.distcp": b"rank 1's shards"}


def _part(step: int, held: tuple[str, ...], manifest: str = "m1") -> Part:
    listed = (MANIFEST, STATE, ".metadata", *SHARDS)
    return Part(step, manifest, listed, (MANIFEST, STATE, ".metadata", *held))


def test_a_step_is_whole_when_the_survivors_parts_cover_its_manifest():
    a, b = _part(5, ("__0_0.distcp",)), _part(5, ("__1_0.distcp",))
    assert whole_step([[a], None, [b]]) == 5
    assert whole_step([[a], None, []]) is None  # rank 1's shards were on the node that was lost
    # the newest whole one, not the newest offered
    assert whole_step([[_part(7, ("__0_0.distcp",)), a], [b]]) == 5
    # parts of one step with two manifests (another timeline's) are not put together
    assert whole_step([[a], [_part(5, ("__1_0.distcp",), "m2")]]) is None


def _commit_part(node: NodeSnapshots, step: int, held: list[str], mark: dict) -> Path:
    """A node's part of a snapshot of `step`: the small files, the shards named in `held`, and the
    manifest of all, as lockstep.checkpoint.memory_shards commits one."""
    files = {
        ".metadata": b"index",
        STATE: json.dumps({"step": step, SNAPSHOT_MARK: mark}).encode(),
        **SHARDS,
    }
    tmp, final = start_save(node.root, step)
    entries = {}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
        entries[name] = {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        if name not in held and name.startswith("__"):
            (tmp / name).unlink()
    seal_as(tmp, final, new_manifest(step, entries, SHARDED))
    return final


def test_a_node_offers_the_files_that_verify_of_this_run_and_model(tmp_path):
    node = NodeSnapshots(tmp_path, "run1", "node-a")
    ours = node.mark("model1")
    _commit_part(node, 2, ["__0_0.distcp"], ours)
    damaged = _commit_part(node, 4, ["__0_0.distcp", "__1_0.distcp"], ours)
    (damaged / "__1_0.distcp").write_bytes(b"rank 1's shardZ")  # one flipped byte, same size
    _commit_part(node, 6, ["__0_0.distcp"], {**ours, "run_id": "run0"})
    _commit_part(node, 8, ["__0_0.distcp"], {**ours, "model": "model2"})
    parts, skipped = parts_held(node, "model1")
    assert [(p.step, p.held) for p in parts] == [
        (4, (MANIFEST, ".metadata", "__0_0.distcp", STATE)),
        (2, (MANIFEST, ".metadata", "__0_0.distcp", STATE)),
    ]
    assert parts[0].listed == (MANIFEST, ".metadata", "__0_0.distcp", "__1_0.distcp", STATE)
    assert parts[0].manifest != parts[1].manifest
    assert [line.split(": ", 1)[1] for line in skipped] == [
        "a model of another shape (fingerprint model2, this one model1)",
        "a snapshot of run 'run0', not of this run (run1)",
        "__1_0.distcp damaged (checksum)",
    ]
