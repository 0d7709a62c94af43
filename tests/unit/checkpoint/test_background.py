"""Checkpoints committed in the background (lockstep/checkpoint/background.py) on real files and real gloo groups:
the same checkpoint as a synchronous save although training changes the state while it is written, at most one
save in flight, a failed write reported by wait() on every rank with the last checkpoint untouched, a process
killed mid-write leaving `latest` on the previous checkpoint (the copy to host memory: test_staging.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import one_process, run_ranks
from procs import wait_for
from tmpfs import read_only, tmpfs

import lockstep.checkpoint.background as background
from lockstep.checkpoint.background import (
    BackgroundWriter,
    start_plain_save,
    start_sharded_save,
)
from lockstep.checkpoint.commit import list_checkpoints
from lockstep.checkpoint.open import load_checkpoint, verify_checkpoint
from lockstep.checkpoint.plain import save_checkpoint
from lockstep.checkpoint.resume import resolve_resume
from lockstep.checkpoint.sharded import save_sharded_checkpoint
from lockstep.checkpoint.sharded_load import load_sharded_checkpoint
from lockstep.config import ModelConfig, OptimConfig
from lockstep.errors import CheckpointError
from lockstep.models.gpt import build_gpt
from lockstep.optim import build_optimizer

from .on_disk import assert_unchanged, latest_name, snapshot

CFG = ModelConfig(vocab_size=64, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16)
READ_ONLY_FIX = (
    "its filesystem is mounted read-only: remount it read-write, or pass another --output-dir "
    "(checkpoint.output_dir); then run again to resume"
)


def _train(model, optimizer, rank: int = 0, world: int = 1, seed: int = 1) -> None:
    """One AdamW step on this rank's share of 8 random sequences."""
    data = torch.randint(
        0,
        CFG.vocab_size,
        (8, CFG.max_seq_length + 1),
        generator=torch.Generator().manual_seed(seed),
    )
    mine = data[rank * 8 // world : (rank + 1) * 8 // world]
    model(mine[:, :-1], mine[:, 1:])[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _trained_gpt():
    torch.manual_seed(0)
    model = build_gpt(CFG)  # its head is tied to the token embedding: one storage under two names
    optimizer = build_optimizer(model, OptimConfig(), 1e-2, "cpu")
    _train(model, optimizer)
    return model, optimizer


def _state(step: int) -> dict:
    return {
        "step": step,
        "cursor": {"epoch": 0, "offset": 8 * step},
        "scheduler": {"base_lrs": [0.01]},
    }


def _files(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())["files"]


@pytest.fixture
def gate(monkeypatch):
    """An event the background writes wait for before they start writing: the test decides when they run."""
    event = threading.Event()
    real = background.save_checkpoint

    def held(*args, **kwargs):
        assert event.wait(30), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(background, "save_checkpoint", held)
    return event


def test_the_background_writes_what_a_synchronous_save_writes(tmp_path, gate):
    model, optimizer = _trained_gpt()
    state, extra, rng = (
        _state(3),
        {"tokenizer.json": b'{"v": 1}'},
        [torch.get_rng_state(), torch.get_rng_state()],
    )
    sync = save_checkpoint(
        tmp_path / "sync", 3, model.state_dict(), optimizer.state_dict(), rng, state, extra
    )
    rt = one_process()
    with BackgroundWriter(rt) as writer:
        start_plain_save(
            writer,
            tmp_path / "async",
            3,
            model.state_dict(),
            optimizer.state_dict(),
            rng,
            state,
            extra,
            keep_last=3,
        )
        # training goes on while the save waits to be written: it changes weights, moments and the schedule
        _train(model, optimizer, seed=2)
        state["scheduler"]["base_lrs"][0] = 0.5
        assert not writer.failed() and not (tmp_path / "async" / "checkpoints" / "latest").exists()
        gate.set()
        path = writer.wait(rt)
    assert (
        path == tmp_path / "async" / "checkpoints" / "step_00000003"
        and latest_name(tmp_path / "async") == path.name
    )
    # every file, byte for byte (sha256), as the synchronous save wrote it
    assert _files(path) == _files(sync)
    assert verify_checkpoint(path) == [] and json.loads(
        (path / "state.json").read_text()
    ) == _state(3)
    assert writer.wait(rt) is None  # nothing in flight any more


def test_at_most_one_save_in_flight_the_next_waits(tmp_path, gate):
    rt = one_process()
    weights = {"w": torch.ones(4)}
    with BackgroundWriter(rt) as writer:
        start_plain_save(writer, tmp_path, 1, weights, None, None, {"step": 1}, {}, keep_last=3)
        with pytest.raises(AssertionError, match="the save of step 1 is still in flight: wait"):
            start_plain_save(writer, tmp_path, 2, weights, None, None, {"step": 2}, {}, keep_last=3)
        waited: list = []
        waiter = threading.Thread(target=lambda: waited.append(writer.wait(rt)))
        waiter.start()
        waiter.join(0.5)
        # still waiting, nothing committed
        assert waiter.is_alive() and waited == [] and list_checkpoints(tmp_path) == []
        gate.set()
        waiter.join(30)
        assert waited == [tmp_path / "checkpoints" / "step_00000001"]
        # now it may start
        start_plain_save(writer, tmp_path, 2, weights, None, None, {"step": 2}, {}, keep_last=3)
        assert writer.wait(rt) == tmp_path / "checkpoints" / "step_00000002"


@pytest.fixture
def mount(tmp_path):
    with tmpfs(tmp_path / "mnt") as mnt:
        yield mnt


def test_a_failed_background_write_keeps_the_last_checkpoint(mount):
    run, rt = mount / "run", one_process()
    with BackgroundWriter(rt) as writer:
        start_plain_save(
            writer, run, 1, {"w": torch.ones(4)}, None, None, {"step": 1}, {}, keep_last=3
        )
        first = writer.wait(rt)
        before = snapshot(first)
        read_only(mount)
        start_plain_save(
            writer, run, 2, {"w": torch.zeros(4)}, None, None, {"step": 2}, {}, keep_last=3
        )
        writer.join()
        # known on this rank without a collective: the loop all-reduces it each step
        assert writer.failed()
        with pytest.raises(CheckpointError) as e:
            writer.wait(rt)
        assert writer.wait(rt) is None and not writer.failed()  # reported once
    assert str(e.value).startswith(
        f"saving the checkpoint of step 2 failed on rank 0 (CheckpointError: cannot write "
        f"the checkpoint of step 2 under {run / 'checkpoints'} (Read-only file system: "
    )
    assert READ_ONLY_FIX in str(e.value) and str(e.value).endswith(
        "the previous checkpoint is untouched"
    )
    assert_unchanged(run, before, "step_00000001")


# ---- 2 ranks: plain and sharded (FSDP) saves in the background, each with its outcome on every rank ----------


def _error_of(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "no CheckpointError"


def _in_background(rt, run: str, read_only_run: str) -> dict:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    from lockstep.parallel.fsdp import apply_fsdp

    group = dist.new_group(backend="gloo")  # the background's own, as lockstep.train.setup makes it
    out: dict = {}
    # plain: rank 0 alone writes, every rank learns the outcome
    with BackgroundWriter(rt, group) as writer:
        if rt.is_main:
            start_plain_save(
                writer, f"{run}/plain", 1, {"w": torch.ones(4)}, None, None, {"step": 1}, {}, 3
            )
        out["plain"] = str(writer.wait(rt))
        if rt.is_main:
            start_plain_save(
                writer, read_only_run, 2, {"w": torch.ones(4)}, None, None, {"step": 2}, {}, 3
            )
        out["plain_error"] = _error_of(lambda: writer.wait(rt))

    torch.manual_seed(0)
    model = build_gpt(CFG)
    apply_fsdp(model, init_device_mesh("cpu", (2,)))
    optimizer = build_optimizer(model, OptimConfig(), 1e-2, "cpu")
    _train(model, optimizer, rt.rank, 2)
    rng, extra = [f"rng{r}" for r in range(2)], {"tokenizer.json": b'{"v": 1}'}
    save_sharded_checkpoint(
        rt, f"{run}/sync", 1, model, optimizer, rng, _state(1), extra, keep_last=3
    )
    with BackgroundWriter(rt, group) as writer:
        start_sharded_save(
            writer, rt, f"{run}/async", 1, model, optimizer, rng, _state(1), extra, 3
        )
        # FSDP's collectives on the training thread meanwhile
        _train(model, optimizer, rt.rank, 2, seed=2)
        out["async"] = str(writer.wait(rt))
        if rt.rank == 1:  # rank 1 cannot write its shards

            def disk_full(self, plan, planner):
                raise OSError("disk full")

            FileSystemWriter.write_data = disk_full
        start_sharded_save(
            writer, rt, f"{run}/async", 2, model, optimizer, rng, _state(2), extra, 3
        )
        out["sharded_error"] = _error_of(lambda: writer.wait(rt))
    return out


def _assert_same_content(sync: Path, path: Path) -> None:
    """The same weights, optimizer state, state.json, RNG states and extra files; DCP's own files may differ in the
    temporary path they were written under."""
    assert sorted(_files(path)) == sorted(_files(sync))
    for name in ("state.json", "rng.pt", "tokenizer.json"):
        assert _files(path)[name] == _files(sync)[name], name
    got, want = load_checkpoint(path), load_checkpoint(sync)
    assert (
        all(torch.equal(got.tensors[k], v) for k, v in want.tensors.items())
        and got.tensors.keys() == want.tensors.keys()
    )
    optimizers = []
    for ckpt in (sync, path):
        model = build_gpt(CFG)
        optimizer = build_optimizer(model, OptimConfig(), 1e-3, "cpu")
        load_sharded_checkpoint(ckpt, model, optimizer)
        optimizers.append(optimizer.state_dict())
    for i, slots in optimizers[0]["state"].items():
        assert all(torch.equal(optimizers[1]["state"][i][k], v) for k, v in slots.items()), i


def test_two_ranks_save_in_the_background_and_share_the_outcome(tmp_path, mount):
    read_only_run = mount / "run"
    first = save_checkpoint(read_only_run, 1, {"w": torch.ones(4)}, None, None, {"step": 1})
    before = snapshot(first)
    read_only(mount)
    rank0, rank1 = run_ranks(_in_background, str(tmp_path), str(read_only_run))

    assert (
        rank0["plain"]
        == rank1["plain"]
        == str(tmp_path / "plain" / "checkpoints" / "step_00000001")
    )
    # rank 0's failure, word for word on rank 1 too
    assert rank0["plain_error"] == rank1["plain_error"]
    assert rank0["plain_error"].startswith(
        "saving the checkpoint of step 2 failed on rank 0 (CheckpointError: "
        "cannot write the checkpoint of step 2 under "
    )
    assert "Read-only file system" in rank0["plain_error"] and READ_ONLY_FIX in rank0["plain_error"]
    assert_unchanged(read_only_run, before, "step_00000001")

    path = tmp_path / "async" / "checkpoints" / "step_00000001"
    assert rank0["async"] == rank1["async"] == str(path) and verify_checkpoint(path) == []
    _assert_same_content(tmp_path / "sync" / "checkpoints" / "step_00000001", path)
    # rank 1's shards failed: one message, the same on both ranks; step 1 stays the one `latest` names
    error = rank0["sharded_error"]
    assert rank1["sharded_error"] == error and error.count("saving the sharded checkpoint") == 1, (
        error
    )
    assert error.startswith(
        "saving the sharded checkpoint of step 2 failed while writing the shards (rank 0: "
    )
    assert (
        "rank 1: " in error
        and "disk full" in error
        and error.endswith("the previous checkpoint is untouched")
    )
    assert latest_name(tmp_path / "async") == "step_00000001" and list_checkpoints(
        tmp_path / "async"
    ) == [path]
    assert not [
        p for p in (tmp_path / "async" / "checkpoints").iterdir() if p.name.startswith(".tmp")
    ]


# ---- a process killed while its background write runs ------------------------------------------------------

KILLED_MID_WRITE = """
    import sys, time
    from pathlib import Path
    import torch
    import lockstep.checkpoint.plain as plain
    from lockstep.checkpoint.background import BackgroundWriter, start_plain_save
    from lockstep.runtime import Runtime

    run = Path(sys.argv[1])
    rt = Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "h")
    real = plain.write_meta_files

    def stalled(tmp, *args):  # the weights are written; the state, the manifest, the rename and `latest` are not
        real(tmp, *args)
        (run / "writing").write_text(tmp.name)
        time.sleep(600)

    with BackgroundWriter(rt) as writer:
        start_plain_save(writer, run, 1, {"w": torch.ones(1000)}, None, None, {"step": 1}, {}, 3)
        writer.wait(rt)
        plain.write_meta_files = stalled
        start_plain_save(writer, run, 2, {"w": torch.zeros(1000)}, None, None, {"step": 2}, {}, 3)
        while True:  # the training thread goes on meanwhile
            time.sleep(0.05)
"""


def test_a_process_killed_mid_write_leaves_latest_on_the_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_MID_WRITE), str(run)])
    try:
        wait_for(lambda: (run / "writing").exists(), 60, "the background write of step 2", proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    root = run / "checkpoints"
    unfinished = root / (run / "writing").read_text()
    assert (
        unfinished.name == f".tmp-step_00000002-{proc.pid}"
        and (unfinished / "model.safetensors").is_file()
    )
    assert latest_name(run) == "step_00000001" and list_checkpoints(run) == [root / "step_00000001"]
    assert verify_checkpoint(root / "step_00000001") == []
    assert resolve_resume(run, "auto", log=pytest.fail) == root / "step_00000001"
    assert torch.equal(load_checkpoint(root / "step_00000001").tensors["w"], torch.ones(1000))


def test_the_writer_waits_for_its_thread_on_the_way_out(tmp_path, gate):
    """Leaving the block (here by an exception) waits for the save in flight: nothing writes once it is left."""
    rt = one_process()
    opened = threading.Timer(0.3, gate.set)
    opened.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="training failed"):
        with BackgroundWriter(rt) as writer:
            start_plain_save(
                writer, tmp_path, 1, {"w": torch.ones(4)}, None, None, {"step": 1}, {}, keep_last=3
            )
            raise RuntimeError("training failed")
    assert time.monotonic() - start >= 0.25 and latest_name(tmp_path) == "step_00000001"
