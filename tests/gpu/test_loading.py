"""Loading on a GPU machine (issue 23, item 2k): a cuda run's DataLoader hands out pinned batches,
move_to_device copies them without blocking the host and they arrive intact, and the time the loop
waits for data is reported and small for the default GPT.

The CPU twins: tests/unit/data/test_sampler.py (build_loader), tests/unit/data/test_batch.py
(move_to_device).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from lockstep.data.batch import move_to_device
from lockstep.data.sampler import build_loader

from .runs import metrics


class Rows(Dataset):
    """Sample i: a dict of tensors whose values say which sample they are."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((16,), float(i)), "ids": torch.arange(8) + i}


def test_the_loader_of_a_cuda_run_pins_its_batches_and_they_arrive_intact():
    # as lockstep.train.setup.build_batches builds it on cuda: pin_memory=True, one worker
    batches = [[i, i + 1, i + 2, i + 3] for i in range(0, 64, 4)]
    loader = build_loader(Rows(), batches, num_workers=1, prefetch_factor=2, pin_memory=True)
    seen = 0
    for indices, batch in zip(batches, loader):
        assert batch["x"].is_pinned() and batch["ids"].is_pinned()
        moved = move_to_device(batch, "cuda")
        assert moved["x"].is_cuda and moved["ids"].is_cuda
        torch.cuda.synchronize()
        assert moved["x"][:, 0].tolist() == [float(i) for i in indices]
        assert torch.equal(moved["ids"].cpu(), batch["ids"])
        seen += 1
    assert seen == 16


def test_move_to_device_does_not_wait_for_the_copy():
    """A copy from pinned memory is queued on the stream and the host goes on: 256 MB take 5-10 ms
    over PCIe, so right after move_to_device returns, the stream is still busy with it; a blocking
    copy would have drained it."""
    big = torch.empty(64 * 2**20, dtype=torch.float32, pin_memory=True).uniform_()
    batch = {"x": big, "n": 3}
    torch.cuda.synchronize()
    moved = move_to_device(batch, torch.device("cuda"))
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "the copy had finished when move_to_device returned: it blocked the host"
    assert moved["n"] == 3 and torch.equal(moved["x"].cpu(), big)


def test_data_wait_is_reported_and_small_for_the_default_gpt(default_run, record_property):
    run, _ = default_run
    rows = metrics(run)
    assert rows and all("data_wait_ms" in r and r["data_wait_ms"] >= 0 for r in rows), rows[0]
    # the first window holds the loader worker's start; after it, one worker prefetching 4 batches
    # of windows read from a memory map keeps ahead of the GPU: the loop waits for under 10% of a
    # step (batch / samples_per_s). (On 2 CPU cores, where a step takes 1.7 s: 3-6 ms.)
    for r in rows[1:]:
        step_ms = 1000 * 32 / r["samples_per_s"]  # train.batch_size 32 by default
        assert r["data_wait_ms"] < 0.1 * step_ms, (r["step"], r["data_wait_ms"], step_ms)
        fraction = round(r["data_wait_ms"] / step_ms, 4)
        record_property(f"data_wait_fraction_step{r['step']}", fraction)
