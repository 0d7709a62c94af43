"""The global-cursor sampler (lockstep/data/sampler.py), in one process and in a real 2-process gloo group."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import start_ranks

from lockstep.data.sampler import (
    Cursor,
    GlobalCursorSampler,
    available_cores,
    bucketed_permutation,
    build_loader,
    cursor_after,
    epoch_permutation,
    eval_micro_batches,
    rank_micro_batches,
    resolve_num_workers,
    step_indices,
    steps_per_epoch,
)
from lockstep.errors import ConfigError, DataError
from lockstep.parallel.mesh import BatchPlan
from lockstep.runtime import shutdown_runtime

N, SEED, GLOBAL = 50, 7, 12  # 4 steps per epoch, 2 samples dropped each epoch


def plans(global_batch: int) -> list[BatchPlan]:
    """Every way to split the global batch over 1..4 ranks (micro x accum)."""
    out = []
    for world in (1, 2, 3, 4):
        per_rank = global_batch // world
        out += [
            BatchPlan(global_batch, world, per_rank // acc, acc)
            for acc in (1, 2)
            if per_rank % acc == 0
        ]
    return out


def consumed(plan: BatchPlan, start: Cursor, steps: int, n: int = N) -> list[list[list[int]]]:
    """[step][rank * accum + micro] -> indices, from one GlobalCursorSampler per rank."""
    per_rank = [
        list(GlobalCursorSampler(n, plan, r, SEED, start, steps)) for r in range(plan.world_size)
    ]
    acc = plan.grad_accum
    return [
        [per_rank[r][s * acc + m] for r in range(plan.world_size) for m in range(acc)]
        for s in range(steps)
    ]


def test_cursor_dict_round_trip():
    c = Cursor(epoch=3, offset=24)
    assert Cursor.from_dict(c.to_dict()) == c and c.to_dict() == {"epoch": 3, "offset": 24}


def test_permutations_depend_on_seed_and_epoch_only():
    p0 = epoch_permutation(N, SEED, 0)
    assert sorted(p0.tolist()) == list(range(N))
    assert np.array_equal(p0, epoch_permutation(N, SEED, 0))
    assert not np.array_equal(p0, epoch_permutation(N, SEED, 1))
    assert not np.array_equal(p0, epoch_permutation(N, SEED + 1, 0))


@pytest.mark.parametrize(
    "plan", plans(GLOBAL), ids=lambda p: f"w{p.world_size}mb{p.micro_batch}acc{p.grad_accum}"
)
def test_rank_shards_tile_each_step_and_epoch(plan):
    spe = steps_per_epoch(N, GLOBAL)
    steps = consumed(plan, Cursor(), 2 * spe)
    for epoch in range(2):
        perm = epoch_permutation(N, SEED, epoch)
        seen = []
        for s in range(epoch * spe, (epoch + 1) * spe):
            micro = steps[s]
            assert all(len(m) == plan.micro_batch for m in micro)
            flat = [i for m in micro for i in m]
            assert len(set(flat)) == GLOBAL  # ranks and micro-steps are disjoint within the step
            expected, _ = step_indices(N, SEED, cursor_after(N, SEED, Cursor(), GLOBAL, s), GLOBAL)
            # the step's set does not depend on the plan
            assert sorted(flat) == sorted(expected.tolist())
            seen += flat
        # the epoch minus the dropped tail
        assert sorted(seen) == sorted(perm[: spe * GLOBAL].tolist())


def test_step_set_same_for_world2_and_world1_with_accum():
    two = consumed(BatchPlan(8, 2, 4, 1), Cursor(), 10)
    one = consumed(BatchPlan(8, 1, 4, 2), Cursor(), 10)
    for a, b in zip(two, one):
        assert sorted(i for m in a for i in m) == sorted(i for m in b for i in m)
        assert a == b  # and even the same micro-batches, in the same order


def test_rank_micro_batches_layout():
    plan = BatchPlan(12, 2, 3, 2)
    idx = np.arange(100, 112)
    assert [m.tolist() for m in rank_micro_batches(idx, plan, 0)] == [
        [100, 101, 102],
        [106, 107, 108],
    ]
    assert [m.tolist() for m in rank_micro_batches(idx, plan, 1)] == [
        [103, 104, 105],
        [109, 110, 111],
    ]


def test_step_indices_drops_remainder_and_rolls_over():
    spe = steps_per_epoch(N, GLOBAL)
    cur = Cursor()
    for _ in range(spe - 1):
        _, cur = step_indices(N, SEED, cur, GLOBAL)
    last, cur = step_indices(N, SEED, cur, GLOBAL)
    assert np.array_equal(last, epoch_permutation(N, SEED, 0)[36:48])
    assert cur == Cursor(1, 0)  # 2 left < 12: the next step starts epoch 1
    first, cur = step_indices(N, SEED, cur, GLOBAL)
    assert np.array_equal(first, epoch_permutation(N, SEED, 1)[:12]) and cur == Cursor(1, 12)
    # a cursor left mid-tail (e.g. saved with another global batch) also rolls over
    idx, after = step_indices(N, SEED, Cursor(0, 45), GLOBAL)
    assert np.array_equal(idx, epoch_permutation(N, SEED, 1)[:12]) and after == Cursor(1, 12)


@pytest.mark.parametrize("start", [Cursor(), Cursor(0, 12), Cursor(2, 36), Cursor(0, 45)])
def test_cursor_after_matches_iteration(start):
    cur = start
    for k in range(15):
        assert cursor_after(N, SEED, start, GLOBAL, k) == cur
        _, cur = step_indices(N, SEED, cur, GLOBAL)
    assert cursor_after(N, SEED, Cursor(), GLOBAL, 10**9) == Cursor(10**9 // 4, 0)  # O(1)


@pytest.mark.parametrize("k", [0, 1, 3, 4, 6])
def test_resume_from_cursor_equals_uninterrupted(k):
    plan, steps = BatchPlan(12, 2, 3, 2), 9  # crosses two epoch boundaries
    for rank in range(2):
        full = list(GlobalCursorSampler(N, plan, rank, SEED, Cursor(), steps))
        resumed = list(
            GlobalCursorSampler(
                N, plan, rank, SEED, cursor_after(N, SEED, Cursor(), 12, k), steps - k
            )
        )
        assert resumed == full[k * plan.grad_accum :]
        assert len(resumed) == (steps - k) * plan.grad_accum


def test_resume_at_another_world_size_keeps_the_step_sets():
    k = 5
    before = consumed(BatchPlan(12, 4, 3, 1), Cursor(), 9)
    after = consumed(BatchPlan(12, 3, 2, 2), cursor_after(N, SEED, Cursor(), 12, k), 9 - k)
    for a, b in zip(before[k:], after):
        assert sorted(i for m in a for i in m) == sorted(i for m in b for i in m)


def test_errors_name_the_numbers():
    with pytest.raises(DataError, match="global batch 64 is larger than the 50 training samples"):
        GlobalCursorSampler(N, BatchPlan(64, 1, 64, 1), 0, SEED, Cursor(), 1)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        GlobalCursorSampler(N, BatchPlan(12, 2, 6, 1), 2, SEED, Cursor(), 1)
    with pytest.raises(DataError, match="3 windows, fewer than world_size\\(4\\)"):
        eval_micro_batches(3, 2, 0, 4, 8)


def test_eval_micro_batches_equal_counts_disjoint():
    for num_eval, mb, world, cap in [(23, 4, 3, 100), (23, 4, 3, 1), (10, 8, 4, 5), (7, 2, 1, 10)]:
        shards = [eval_micro_batches(num_eval, mb, r, world, cap) for r in range(world)]
        counts = {len(s) for s in shards}
        sizes = {len(b) for s in shards for b in s}
        assert len(counts) == 1 and len(sizes) == 1 and counts.pop() <= cap
        flat = [i for s in shards for b in s for i in b]
        assert len(flat) == len(set(flat)) and all(0 <= i < num_eval for i in flat)
        for r, s in enumerate(shards):
            assert all(i % world == r for b in s for i in b)
    # 7 per rank: one micro-batch, tail of 3 dropped
    assert eval_micro_batches(23, 4, 0, 3, 100) == [[0, 3, 6, 9]]
    assert eval_micro_batches(23, 4, 1, 2, 100) == [[1, 3, 5, 7], [9, 11, 13, 15]]  # 11 per rank
    assert eval_micro_batches(10, 8, 1, 4, 5) == [[1, 5]]  # 2 per rank: one micro-batch of 2


class Echo(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor(i), torch.full((3,), i, dtype=torch.long)


def test_sampler_in_dataloader_with_workers():
    plan = BatchPlan(12, 2, 3, 2)
    sampler = GlobalCursorSampler(N, plan, 1, SEED, Cursor(0, 24), 5)
    loader = build_loader(Echo(), sampler, num_workers=2, prefetch_factor=2, pin_memory=False)
    assert loader.persistent_workers and len(loader) == 10
    expected = list(sampler)
    for _ in range(2):  # persistent workers: a second pass yields the same batches
        got = [(i.tolist(), x) for i, x in loader]
        assert [g[0] for g in got] == expected
        for ids, x in got:
            assert (
                x.shape == (3, 3)
                and x.dtype == torch.long
                and torch.equal(x[:, 0], torch.tensor(ids))
            )
    plain = build_loader(Echo(), sampler, num_workers=0, prefetch_factor=2, pin_memory=False)
    assert [i.tolist() for i, _ in plain] == expected


@pytest.mark.parametrize(
    "cores, ranks, workers",
    [
        # this machine with 2 ranks: 1 core each, a worker would take the other rank's core
        (2, 2, 0),
        (16, 2, 1),  # 8 cores each
        (1, 1, 0),  # one core
        (2, 1, 1),  # one rank with both cores
        (3, 2, 0),  # 1 core each: the third core is no rank's own
        (4, 2, 1),  # 2 each
        (64, 8, 1),  # a GPU node: 8 each, still 1 (set a number for audio decoding)
    ],
)
def test_resolve_num_workers_auto(cores, ranks, workers):
    assert resolve_num_workers("auto", ranks, cores)[0] == workers


def test_resolve_num_workers_reason():
    assert resolve_num_workers("auto", 2, 2) == (
        0,
        "0 DataLoader workers per rank (data.num_workers auto: 2 core(s) for 2 rank(s) on this "
        "node, 1 each; a worker needs 2+ cores per rank)",
    )
    assert resolve_num_workers("auto", 2, 16) == (
        1,
        "1 DataLoader worker per rank (data.num_workers auto: 16 core(s) for 2 rank(s) on this "
        "node, 8 each; a worker needs 2+ cores per rank)",
    )
    assert resolve_num_workers("auto", 1, 0) == (  # os.cpu_count() did not know: one core
        0,
        "0 DataLoader workers per rank (data.num_workers auto: 1 core(s) for 1 rank(s) on this "
        "node, 1 each; a worker needs 2+ cores per rank)",
    )


@pytest.mark.parametrize("setting", [0, 1, 3, 11])
def test_resolve_num_workers_keeps_a_number(setting):
    """A number is the user's choice, on any machine: even 3 workers per rank on 1 core."""
    plural = "" if setting == 1 else "s"
    want = (setting, f"{setting} DataLoader worker{plural} per rank (data.num_workers)")
    assert resolve_num_workers(setting, 2, 1) == want == resolve_num_workers(setting, 1, 64)


@pytest.mark.parametrize("setting", ["two", "Auto", -1, True, 1.5, None])
def test_resolve_num_workers_refuses(setting):
    want = (
        rf"data.num_workers = {setting!r} is not a number of DataLoader workers; "
        r"set it to an int >= 0 .* or to auto"
    )
    with pytest.raises(ConfigError, match=want):
        resolve_num_workers(setting, 1, 2)
    with pytest.raises(ValueError, match="local_world_size = 0 must be >= 1"):
        resolve_num_workers("auto", 0, 2)


def test_build_loader_auto_on_this_machine():
    """ "auto" in build_loader: this process's cores (its affinity) shared by the ranks on the
    node, as the rule says; the batches are the same with and without a worker."""
    cores = len(os.sched_getaffinity(0))
    assert available_cores() == cores
    sampler = GlobalCursorSampler(N, BatchPlan(12, 2, 3, 2), 0, SEED, Cursor(), 3)
    expected = list(sampler)
    for ranks in (1, 2):
        loader = build_loader(Echo(), sampler, "auto", 2, False, local_world_size=ranks)
        assert loader.num_workers == (1 if cores // ranks >= 2 else 0)
        assert [i.tolist() for i, _ in loader] == expected
    if cores == 2:  # this machine (2 cores): 1 rank gets a worker, 2 ranks get none
        assert [
            build_loader(Echo(), sampler, "auto", 2, False, local_world_size=r).num_workers
            for r in (1, 2)
        ] == [1, 0]


def test_build_loader_auto_reads_the_affinity():
    """A process pinned to one core (as Slurm or taskset pins it) gets no worker, even alone on a
    bigger machine."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from lockstep.data.sampler import available_cores, resolve_num_workers; "
        "print(available_cores(), resolve_num_workers('auto', 1, available_cores())[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["1", "0"]


# ---------------------------------------------------------------- real process group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        plan = BatchPlan(12, world, 3, 2)
        spe = steps_per_epoch(N, plan.global_batch)
        mine = [
            i for b in GlobalCursorSampler(N, plan, dist.get_rank(), SEED, Cursor(), spe) for i in b
        ]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        flat = [i for g in gathered for i in g]
        assert len(flat) == len(set(flat)), "ranks read overlapping samples"
        assert sorted(flat) == sorted(epoch_permutation(N, SEED, 0)[: spe * 12].tolist())

        shard = eval_micro_batches(23, 4, dist.get_rank(), world, 8)
        shards: list = [None] * world
        dist.all_gather_object(shards, shard)
        assert len({len(s) for s in shards}) == 1, "ranks got different numbers of eval batches"
        eval_flat = [i for s in shards for b in s for i in b]
        assert len(eval_flat) == len(set(eval_flat)) and len(eval_flat) == 2 * (23 // 2 // 4) * 4
    finally:
        shutdown_runtime()  # collects the DDP/FSDP garbage first: see its docstring


def test_two_processes_gloo_cover_the_epoch():
    start_ranks(_worker, 2, _free_port(), nprocs=2)


# ---------------------------------------------------------------- duration buckets


def _durations(n: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 20.0, n)


def test_bucketed_order_covers_each_sample_once_and_groups_lengths():
    lengths, gb = _durations(1000), 16
    for epoch in range(3):
        order = bucketed_permutation(lengths, seed=7, epoch=epoch, global_batch=gb)
        assert sorted(order.tolist()) == list(range(1000))
        # the tail (1000 % 16 = 8) is at the end; every full batch comes from one sorted pool
        batches = order[: len(order) - 1000 % gb].reshape(-1, gb)
        spread = np.mean([np.ptp(lengths[b]) for b in batches])
        plain = np.random.default_rng(0).permutation(1000)[:992].reshape(-1, gb)
        assert spread < 0.25 * np.mean([np.ptp(lengths[b]) for b in plain])
    # a function of (lengths, seed, epoch, global batch): the same call, the same order; epochs differ
    assert np.array_equal(
        bucketed_permutation(lengths, 7, 1, gb), bucketed_permutation(lengths, 7, 1, gb)
    )
    assert not np.array_equal(
        bucketed_permutation(lengths, 7, 1, gb), bucketed_permutation(lengths, 7, 2, gb)
    )


def test_bucketed_cursor_resume_continues_at_the_exact_sample():
    lengths, n = _durations(203), 203
    plan = BatchPlan(global_batch=8, world_size=2, micro_batch=2, grad_accum=2)
    full = list(GlobalCursorSampler(n, plan, 1, 5, Cursor(), 60, lengths))
    # resume after 37 steps at world size 1 (same global batch): rank 1's slices are in the union
    cursor = cursor_after(n, 5, Cursor(), 8, 37)
    again = list(GlobalCursorSampler(n, plan, 1, 5, cursor, 23, lengths))
    assert again == full[37 * 2 :]
    idx, _ = step_indices(n, 5, cursor, 8, lengths)
    one = BatchPlan(global_batch=8, world_size=1, micro_batch=4, grad_accum=2)
    assert sorted(sum(GlobalCursorSampler(n, one, 0, 5, cursor, 1, lengths), [])) == sorted(
        idx.tolist()
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_starting_a_loader_leaves_the_training_rng_alone(workers):
    # a resumed run starts its loader at the restart, where the uninterrupted run did not: a draw would shift dropout
    data = list(range(8))
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    loader = build_loader(data, [[0, 1], [2, 3]], workers, 2, False)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert torch.equal(torch.rand(4), expected)
