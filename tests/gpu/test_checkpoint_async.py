"""checkpoint.async_save on CUDA (issue 23, item 2e): the state is copied into pinned host memory,
the step path waits only for that copy (the stall, which lockstep logs), and what the background
thread commits equals a synchronous save of the same run, bit for bit.

The CPU twin: tests/unit/checkpoint/test_background.py.
"""

from __future__ import annotations

import torch

from lockstep.checkpoint.open import load_checkpoint
from lockstep.checkpoint.staging import copy_to_host

from .runs import (
    assert_same_state,
    assert_same_tensors,
    checkpoint_dir,
    logged_seconds,
    rank0_log,
    train,
)

# 25M parameters (12 x 8 x 512^2): weights and AdamW's two moments are ~300 MB of fp32 to copy per
# save, so the stall is tens of milliseconds (above the log's 10 ms resolution; 0.23-0.42 s for
# CPU clones on the CPU) while the run stays seconds long
MODEL = "--hidden-size 512 --attention-heads 8 --layers 8 --max-seq-length 64"
RUN = "--global-batch-size 8 --max-steps 20 --save-interval 10 --log-interval 5"
STALL = r"checkpoint of step (\d+): copied to host memory in ([0-9.]+) s, writing in the background"


def test_async_save_commits_what_a_synchronous_save_does_and_logs_its_stall(
    tmp_path, corpus, token_cache, record_property
):
    sync, background = tmp_path / "sync", tmp_path / "async"
    flags = [*MODEL.split(), *RUN.split()]
    train(sync, corpus, token_cache, *flags)
    train(background, corpus, token_cache, *flags, "--set", "checkpoint.async_save=true")

    stalls = logged_seconds(rank0_log(background), STALL)
    assert sorted(stalls) == [10, 20], stalls  # each save logged once, with its stall
    assert all(s > 0 for s in stalls.values()), stalls
    for step, seconds in stalls.items():
        record_property(f"async_save_stall_s_step{step}", seconds)
    # a synchronous run stalls for the whole save instead, and says nothing of a copy
    assert not logged_seconds(rank0_log(sync), STALL)

    for step in (10, 20):
        a = load_checkpoint(checkpoint_dir(sync, step))
        b = load_checkpoint(checkpoint_dir(background, step))
        assert_same_tensors(a.tensors, b.tensors, f"async vs sync save, step {step}")
        assert_same_state(a.optimizer_state, b.optimizer_state, f"optimizer, step {step}")
        assert a.state["step"] == b.state["step"] == step
        assert a.state["cursor"] == b.state["cursor"]
        assert "cuda" in a.rng_states[0] and "cuda" in b.rng_states[0]
        assert torch.equal(a.rng_states[0]["cuda"], b.rng_states[0]["cuda"])


def test_copy_to_host_stages_cuda_tensors_in_pinned_memory():
    weight = torch.randn(1024, 1024, device="cuda")
    model = {"w": weight, "tied": weight, "b": torch.arange(7, device="cuda")}
    optimizer = [{"step": torch.tensor(3.0), "exp_avg": torch.randn(5, device="cuda")}]
    state = {"model": model, "opt": optimizer, "lr": 0.1}
    host = copy_to_host(state)
    for name in ("w", "b"):
        assert host["model"][name].device.type == "cpu" and host["model"][name].is_pinned()
        assert torch.equal(host["model"][name], model[name].cpu())
    # views of one storage: one copy, as torch.save keeps them
    assert host["model"]["tied"] is host["model"]["w"]
    assert torch.equal(host["opt"][0]["exp_avg"], optimizer[0]["exp_avg"].cpu())
    assert host["opt"][0]["step"] == 3.0 and host["lr"] == 0.1
    weight.add_(1.0)  # training goes on: the copy must not follow
    assert not torch.equal(host["model"]["w"], weight.cpu())
