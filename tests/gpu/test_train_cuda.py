"""`lockstep train` on one GPU (issue 23, items 2a and 2b): cuda, bf16 and nccl chosen by
themselves, the loss falling, the logged peak memory equal to torch's own count, an exact resume
after SIGKILL, a real NCCL group, and bf16 autocast against fp32.

The CPU twins: tests/e2e/test_train_dist.py (loss, kill + resume), tests/unit/train/test_run.py
(run_training in this process), tests/unit/train/test_step.py (autocast).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from unit.train.tiny import tiny_config
from unit.train.tiny import train as train_here

from lockstep.config import DistributedConfig
from lockstep.runtime import pick_backend

from .runs import (
    assert_same_tensors,
    checkpoint_dir,
    kill_after_checkpoint,
    losses,
    metrics,
    rank0_log,
    run_on_gpu,
    train,
    train_args,
)


def test_defaults_pick_cuda_and_bf16_and_the_loss_falls(default_run):
    run, proc = default_run
    # the rank's first line: "rank 0/1 on HOST (pid N), device cuda:0 (NAME, ...), backend -, ...;
    # mixed precision bf16 (WHY)"
    line = next(x for x in rank0_log(run).splitlines() if "rank 0/1 on " in x)
    assert "device cuda:0" in line and "mixed precision bf16 (" in line, line
    assert "backend -" in line  # one GPU: world size 1, no process group is formed
    rows = metrics(run)
    assert [r["step"] for r in rows] == [10, 20, 30, 40, 50]  # train.log_interval 10 by default
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert first > 3.0 and last < first - 0.5, (first, last)  # ~5.5 (ln 256) untrained
    assert all(r["peak_mem_mb"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert "sample from the trained model" in proc.stderr  # generated on the GPU at the end


def test_auto_backend_on_cuda_is_nccl():
    assert pick_backend(DistributedConfig(), torch.device("cuda")) == "nccl"
    assert pick_backend(DistributedConfig(no_nccl=True), torch.device("cuda")) == "gloo"


def _collectives(rt) -> dict:
    import torch.distributed as dist

    from lockstep.collectives import all_reduce_max, all_reduce_sum

    x = torch.arange(6, dtype=torch.float32, device=rt.device) + 0.5
    summed = x.clone()
    dist.all_reduce(summed)  # a real NCCL kernel on the GPU, even with one rank
    gathered = torch.empty(6, device=rt.device)
    dist.all_gather_into_tensor(gathered, x)
    scattered = torch.empty(6, device=rt.device)
    dist.reduce_scatter_tensor(scattered, x * 2)
    dist.broadcast(x, src=0)
    torch.cuda.synchronize()
    return {
        "backend": dist.get_backend(),
        "control": dist.get_backend(rt.control_group),
        "sum": summed.cpu(),
        "gathered": gathered.cpu(),
        "scattered": scattered.cpu(),
        "x": x.cpu(),
        "lockstep_sum": all_reduce_sum(rt, [1.5, 2.0]),
        "lockstep_max": all_reduce_max(rt, 3.25),
        "nccl": torch.cuda.nccl.version(),
    }


def test_a_one_rank_nccl_group_runs_its_collectives():
    out = run_on_gpu(_collectives)
    expected = torch.arange(6, dtype=torch.float32) + 0.5
    assert (out["backend"], out["control"]) == ("nccl", "gloo")
    assert torch.equal(out["sum"], expected) and torch.equal(out["gathered"], expected)
    assert torch.equal(out["scattered"], 2 * expected) and torch.equal(out["x"], expected)
    assert out["lockstep_sum"].tolist() == [1.5, 2.0] and out["lockstep_max"] == 3.25
    assert isinstance(out["nccl"], tuple) and out["nccl"] >= (2, 0, 0), out["nccl"]


def test_logged_peak_memory_is_torch_cuda_max_memory_allocated(tmp_path, corpus, token_cache):
    """run_training in this process: the last train line's peak_mem_mb against torch's counter read
    after the run. Evaluation, the end sample and intermediate saves are off: nothing after the last
    log allocates more (the final save copies to the CPU)."""
    run = tmp_path / "run"
    overrides = {"model.hidden_size": 256, "model.attention_heads": 4, "model.layers": 4}
    overrides |= {"model.max_seq_length": 128, "train.batch_size": 16, "train.max_steps": 12}
    overrides |= {"train.log_interval": 4, "optim.warmup_steps": 2, "data.eval_fraction": 0}
    overrides |= {"distributed.device": "cuda", "train.mixed_precision": "auto"}
    overrides |= {"checkpoint.save_interval": 0}
    cfg = tiny_config(run, corpus, token_cache, **overrides)
    environ = dict(os.environ)
    torch.cuda.reset_peak_memory_stats()
    try:
        result = train_here(cfg)
        after = torch.cuda.max_memory_allocated() / 2**20
    finally:  # run_training set the allocator and NCCL variables here, as in a worker: drop them
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
    assert result.step == 12 and result.checkpoint == checkpoint_dir(run, 12)
    logged = metrics(run)[-1]["peak_mem_mb"]
    # the state alone (weights, grads, AdamW moments: 16 bytes a parameter) is ~50 MB
    assert logged > 40, logged
    assert abs(logged - after) <= 0.1, (logged, after)


def test_sigkill_and_resume_equal_an_uninterrupted_run(tmp_path, corpus, token_cache):
    # bf16 by default on a GPU; a checkpoint every 10 of 300 steps: the kill lands before the end
    flags = "--hidden-size 64 --max-seq-length 64 --global-batch-size 16 --max-steps 300"
    flags = [*flags.split(), *"--save-interval 10 --log-interval 10".split()]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    train(straight, corpus, token_cache, *flags)
    killed_at = kill_after_checkpoint(train_args(broken, corpus, token_cache, *flags), broken, 30)
    assert 30 <= killed_at < 300, f"the run was not killed mid-way (last commit: step {killed_at})"
    resumed = train(broken, corpus, token_cache, *flags)
    assert f"resumed from {checkpoint_dir(broken, killed_at)}" in resumed.stderr
    a = load_file(checkpoint_dir(straight, 300) / "model.safetensors")
    b = load_file(checkpoint_dir(broken, 300) / "model.safetensors")
    assert_same_tensors(a, b, f"killed after step {killed_at} and resumed on cuda")


def test_bf16_autocast_ends_within_2_percent_of_fp32(tmp_path, corpus, token_cache):
    flags = "--hidden-size 64 --max-seq-length 64 --global-batch-size 16 --max-steps 100"
    flags = [*flags.split(), *"--log-interval 10 --learning-rate 3e-3 --warmup-steps 10".split()]
    ends = {}
    for precision in ("no", "bf16"):
        run = tmp_path / precision
        train(run, corpus, token_cache, *flags, "--mixed-precision", precision)
        assert f"mixed precision {precision} (as set)" in rank0_log(run)
        ends[precision] = losses(run)[-1]  # the mean over steps 91-100
    assert ends["no"] < 4.0, ends  # both learned (ln 256 = 5.5 untrained)
    # measured on the CPU with the same runs: 2.440 (fp32) and 2.426 (bf16), 0.6% apart
    assert abs(ends["bf16"] - ends["no"]) <= 0.02 * ends["no"], ends


def test_bf16_autocast_on_cuda_runs_matmuls_in_bf16_and_the_loss_in_fp32():
    from lockstep.train.step import build_autocast, build_grad_scaler, resolve_mixed_precision

    cuda = torch.device("cuda")
    choice, why = resolve_mixed_precision("auto", cuda)
    name = torch.cuda.get_device_name(cuda)
    assert choice == "bf16" and why.startswith(name) and why.endswith("computes bf16"), why
    a, b = torch.randn(4, 4, device=cuda), torch.randn(4, 4, device=cuda)
    targets = torch.tensor([0, 1, 2, 3], device=cuda)
    with build_autocast("bf16", cuda):
        assert (a @ b).dtype == torch.bfloat16
        assert torch.nn.functional.cross_entropy(a, targets).dtype == torch.float32
    assert (a @ b).dtype == torch.float32
    assert build_grad_scaler("bf16", cuda) is None  # bf16 has fp32's range: no loss scaling
