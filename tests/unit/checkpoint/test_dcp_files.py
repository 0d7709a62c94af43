"""lockstep/checkpoint/dcp_files.py on a DCP checkpoint written by one process: its index read through the
allowlist (a payload that would run code refused, a pickle that is not DCP's index named), the resume's reader
loading it as DCP's own would, and the content check's findings."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from lockstep.checkpoint.dcp_files import (
    SafeLoadPlanner,
    SafeReader,
    read_dcp_metadata,
    sharded_problems,
)
from lockstep.errors import CheckpointError


def _touch(path):
    open(path, "w").write("executed")


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


@pytest.fixture
def saved(tmp_path):
    """A DCP checkpoint of a weight and an optimizer hyperparameter (a non-tensor value), one process."""
    state = {"w": torch.arange(6.0), "optimizer": {"param_groups": [{"lr": 0.25}]}}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    return tmp_path / "ckpt"


def test_the_index_reads_through_the_allowlist_and_loads_as_dcps_own(saved):
    meta = read_dcp_metadata(saved)
    assert "w" in meta.state_dict_metadata and tuple(meta.state_dict_metadata["w"].size) == (6,)
    target = {"w": torch.zeros(6), "optimizer": {"param_groups": [{"lr": 0.0}]}}
    dcp.load(target, storage_reader=SafeReader(saved), planner=SafeLoadPlanner(), no_dist=True)
    assert (
        torch.equal(target["w"], torch.arange(6.0))
        and target["optimizer"]["param_groups"][0]["lr"] == 0.25
    )
    shards = sorted(p.name for p in saved.iterdir() if p.suffix == ".distcp")
    # every shard listed, every value loads
    assert sharded_problems(saved, {name: {} for name in shards}) == []
    assert sharded_problems(saved, {}) == [
        f"{name}: holds shards (says .metadata) but is not in manifest.json" for name in shards
    ]


def test_an_index_that_would_run_code_or_is_not_dcps_is_refused(saved, tmp_path):
    class System:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    (saved / ".metadata").write_bytes(pickle.dumps(System()))
    with pytest.raises(
        CheckpointError, match=r"posix.system is not allowed in a checkpoint's .metadata"
    ):
        read_dcp_metadata(saved)
    assert sharded_problems(saved, {})[0].startswith(".metadata: unreadable (")
    (saved / ".metadata").write_bytes(pickle.dumps({"not": "an index"}))
    with pytest.raises(CheckpointError, match=r"\.metadata holds a dict, not DCP metadata"):
        read_dcp_metadata(saved)
    assert not (tmp_path / "owned").exists()


def test_a_value_the_weights_only_loader_refuses_is_named_with_its_shard(saved, tmp_path):
    meta = read_dcp_metadata(saved)
    index = next(i for i in meta.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    shard = saved / meta.storage_data[index].relative_path
    payload = io.BytesIO()
    torch.save(Evil(str(tmp_path / "pwned")), payload)
    offset = shard.stat().st_size
    # the value now lives at the end of the shard, and the index says so
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    meta.storage_data[index] = _StorageInfo(shard.name, offset, len(payload.getvalue()))
    (saved / ".metadata").write_bytes(pickle.dumps(meta))
    problems = sharded_problems(saved, {shard.name: {}})
    assert len(problems) == 1 and problems[0].startswith(
        f"{shard.name}: value optimizer.param_groups.0.lr is refused by torch.load(weights_only=True) "
        "(UnpicklingError: global"
    ), problems
    target = {"w": torch.zeros(6), "optimizer": {"param_groups": [{"lr": 0.0}]}}
    with pytest.raises(CheckpointException, match="Weights only load failed"):
        dcp.load(target, storage_reader=SafeReader(saved), planner=SafeLoadPlanner(), no_dist=True)
    assert not (tmp_path / "pwned").exists()
