"""The rank behind and its cause (lockstep/train/stragglers.py): its own time against the others' median,
the phase where it spends the most more, one WARNING after `patience` windows with the fix that fits."""

from __future__ import annotations

import logging

import pytest

from lockstep.train.links import SLOW_LINK_FIX
from lockstep.train.step_clock import PHASES, RankTimes
from lockstep.train.stragglers import SlowLink, StragglerWatch, behind, communication_bound


def _ranks(slow: int | None = None, phase: str = "data", extra: float = 0.0, n: int = 4) -> list:
    """n ranks on two hosts, 100 ms of compute a step each; rank `slow` spends `extra` s more in
    `phase`, and every other rank waits that long in the all-reduce."""
    out = []
    for r in range(n):
        phases = dict.fromkeys(PHASES, 0.0) | {"compute": 0.1, "data": 0.004}
        if r == slow:
            phases[phase] += extra
        else:
            phases["comm"] += extra
        out.append(RankTimes(r, f"node-{'ab'[r // 2]}", r % 2, phases, steps=10))
    return out


def test_the_rank_behind_is_named_with_its_cause():
    found = behind(_ranks(3, "data", 0.31), margin=0.15)
    assert found.times.rank == 3 and found.cause == "data"
    assert found.ratio == pytest.approx(0.414 / 0.104)
    assert found.describe() == (
        "rank 3 (node-b, local rank 1) is behind: 414 ms of its own per step against the others' "
        "104 ms (3.98x); data 314 ms per step (others: 4 ms)"
    )
    assert behind(_ranks(1, "checkpoint", 0.05), 0.15).cause == "checkpoint"
    assert behind(_ranks(0, "compute", 0.05), 0.15).cause == "compute"


def test_no_rank_is_behind_within_the_margin_or_alone():
    assert behind(_ranks(2, "compute", 0.014), margin=0.15) is None  # 13% more
    assert behind(_ranks(2, "compute", 0.02), margin=0.15) is not None  # 19% more
    assert behind(_ranks(), margin=0.15) is None
    assert behind(_ranks(0, "data", 1.0, n=1), margin=0.15) is None  # nobody to compare with

    # 1.9x, but 8 ms a step more: the noise a tiny model's step of 9 ms sees on a loaded machine
    def two(slow_compute: float) -> list:
        steps = [dict.fromkeys(PHASES, 0.0) | {"compute": c} for c in (0.009, slow_compute)]
        return [RankTimes(r, "h", r, phases, steps=10) for r, phases in enumerate(steps)]

    assert behind(two(0.017), margin=0.5) is None
    assert behind(two(0.021), margin=0.5).times.rank == 1  # 2.3x, 12 ms more


def test_a_warning_once_a_rank_stays_behind_then_again_only_after_it_caught_up(caplog):
    watch = StragglerWatch(0.15, 3, logging.getLogger("test.stragglers"))
    windows = [_ranks(1, "data", 0.3)] * 2 + [_ranks(1, "compute", 0.3)] * 3
    windows += [_ranks(1, "compute", 0.3)] * 2 + [_ranks()] + [_ranks(1, "compute", 0.3)] * 3
    with caplog.at_level(logging.WARNING, "test.stragglers"):
        for times in windows:
            watch.note(times)
    said = [r.getMessage() for r in caplog.records]
    # the cause changed after 2 windows: 3 more of the new one; caught up once; 3 more
    assert len(said) == 2 and said[0] == said[1]
    assert said[0] == (
        "straggler: rank 1 (node-a, local rank 1) is behind: 404 ms of its own per step against the "
        "others' 104 ms (3.88x); compute 400 ms per step (others: 100 ms), in the last 3 comparisons "
        "(each of 10 steps or more); the fix that fits: a throttled, busy or different device on "
        "node-a: `lockstep doctor` on each node compares them"
    )


def test_a_slow_link_is_probed_for_when_communication_is_most_of_the_step(caplog):
    link = SlowLink(1, 0, "rank 1 -> rank 0 (host b -> host a) took 42.0 ms for 524 kB")
    probed = []

    def probe(window):
        probed.append(len(window))
        return link

    watch = StragglerWatch(0.5, 3, logging.getLogger("test.stragglers.link"))
    # every rank waits 300 ms a step, 104 ms of its own: the links' turn
    bound = _ranks(n=2)
    for t in bound:
        t.phases["comm"] = 0.3
    assert communication_bound(bound) and not communication_bound(_ranks(n=2))
    with caplog.at_level(logging.INFO, "test.stragglers.link"):
        assert watch.note(_ranks(n=2), probe) is None and probed == []
        # named at the first comparison it is probed in, then probed again only 10 comparisons later
        found = [watch.note(bound, probe) for _ in range(12)]
    assert found == [link] + [None] * 10 + [link] and probed == [2, 2]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [  # once per link
        "straggler: communication is most of every rank's step, and the link rank 1 -> rank 0 "
        f"(host b -> host a) took 42.0 ms for 524 kB; the fix that fits: {SLOW_LINK_FIX}"
    ]
    # a rank behind is the others' wait: no probe; train.probe_links=false: never probed
    watch = StragglerWatch(0.5, 3, logging.getLogger("test.stragglers.link"))
    slow = _ranks(1, "data", 0.3, n=2)
    slow[1].phases["comm"] = slow[0].phases["comm"] = 0.5
    assert communication_bound(slow) and watch.note(slow, probe).cause == "data"
    quiet = StragglerWatch(0.5, 3, logging.getLogger("test.stragglers.link"), probe_links=False)
    assert [quiet.note(bound, probe) for _ in range(12)] == [None] * 12 and probed == [2, 2]


def _run_with_slow_loader(rt, base: str, corpus: str, token_cache: str, delay: float) -> dict:
    """A real 2-rank run whose rank 1 reads each sample `delay` seconds late (its loader slowed, as
    a slow disk would); what rank 0 logged and its metrics.jsonl."""
    import time

    from lockstep.data.text import TokenWindows

    if rt.rank == 1:
        read = TokenWindows.__getitem__
        TokenWindows.__getitem__ = lambda self, i: (time.sleep(delay), read(self, i))[1]
    return _run(rt, base, corpus, token_cache)


def _run_with_slow_fsync(rt, base: str, corpus: str, token_cache: str, delay: float) -> dict:
    """The same run, a checkpoint every step, whose rank 0 (it writes them) waits `delay` seconds
    longer for each fsync (a slow disk on its node)."""
    import os
    import time

    if rt.rank == 0:
        sync = os.fsync
        os.fsync = lambda fd: (time.sleep(delay), sync(fd))[1]
    sets = {"checkpoint.save_interval": 1, "checkpoint.keep_last": 1}
    return _run(rt, base, corpus, token_cache, **sets)


def _run_throttled(rt, base: str, corpus: str, token_cache: str, group: str) -> dict:
    """The same run, rank 1 in a cgroup whose CPU quota is a tenth of one CPU (tests/throttle.py):
    the kernel throttles it, as a container's CPU limit would."""
    from throttle import join

    if rt.rank == 1:
        join(group)
    return _run(rt, base, corpus, token_cache)


def _run_with_slow_forward(rt, base: str, corpus: str, token_cache: str, delay: float) -> dict:
    """The same run under FSDP, rank 1's forward `delay` seconds slower (a slow device): its peer
    waits inside FSDP's own collectives."""
    import time

    from lockstep.models.gpt import GPT

    if rt.rank == 1:
        forward = GPT.forward
        GPT.forward = lambda self, *a, **k: (time.sleep(delay), forward(self, *a, **k))[1]
    return _run(rt, base, corpus, token_cache, **{"parallel.data_parallel": "fsdp"})


def _run(rt, base: str, corpus: str, token_cache: str, **sets) -> dict:
    """A 40-step run of the tiny GPT on 2 ranks, a log line every 5 steps; what rank 0 logged and
    its metrics.jsonl."""
    import json
    from pathlib import Path

    from lockstep.train.loop import StopRequest
    from lockstep.train.run import _train

    from .tiny import tiny_config

    cfg = tiny_config(
        Path(base) / "run",
        Path(corpus),
        Path(token_cache),
        **{"train.max_steps": 40, "train.log_interval": 5, "train.eval_interval": 0, **sets},
    )
    (Path(base) / "run").mkdir(exist_ok=True)
    log = logging.getLogger(f"test.stragglers.run.{rt.rank}")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append((record.levelname, record.getMessage()))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    with StopRequest() as stop:
        _train(cfg, rt, log, stop)
    rows = [
        json.loads(line) for line in (Path(base) / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    return {"said": said, "rows": rows}


def _faulty_run(fault, tmp_path, corpus, token_cache, arg=0.01) -> tuple[dict, list[str]]:
    """`fault` (a rank function above) on 2 real ranks, given `arg` (a delay: 10 ms): (what rank 0
    returned, the straggler WARNINGs it logged)."""
    from conftest import run_ranks

    out = run_ranks(fault, str(tmp_path), str(corpus), str(token_cache), arg)[0]
    return out, [m for level, m in out["said"] if level == "WARNING" and m.startswith("straggler")]


def test_a_rank_with_a_slow_loader_is_named_with_cause_data_in_a_real_run(
    tmp_path, corpus, token_cache
):
    out, warnings = _faulty_run(_run_with_slow_loader, tmp_path, corpus, token_cache)
    # 4 samples a step on rank 1: 40 ms a step of data wait; named at the 3rd comparison (step 30)
    assert len(warnings) == 1, out["said"]
    assert warnings[0].startswith("straggler: rank 1 (") and "; data " in warnings[0]
    assert "more loader workers (data.num_workers)" in warnings[0]
    train = [r for r in out["rows"] if r["split"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30, 35, 40]
    for record in train:  # every rank's step time by phase, in every record
        assert [row["rank"] for row in record["ranks"]] == [0, 1]
        fast, slow = record["ranks"]
        assert slow["data_ms"] >= 40 and slow["data_ms"] > fast["data_ms"] + 30
        assert set(fast) == {"rank", "host", "local_rank", "steps"} | {f"{p}_ms" for p in PHASES}
        assert fast["steps"] == slow["steps"] == 5
    for record in train[1:]:  # past the first steps' warm-up, rank 0 waits for rank 1's data
        fast, slow = record["ranks"]
        assert fast["comm_ms"] > slow["comm_ms"] + 30


def test_a_slow_rank_under_fsdp_is_named_and_the_other_waits_in_comm(tmp_path, corpus, token_cache):
    """FSDP2's collectives wait in torch's Work.wait; TP's in the functional collectives'
    wait_tensor, timed the same way by the same clock (tests/unit/train/test_collective_waits.py, a
    TP layer pair)."""
    out, warnings = _faulty_run(_run_with_slow_forward, tmp_path, corpus, token_cache, 0.06)
    assert len(warnings) == 1, out["said"]
    assert warnings[0].startswith("straggler: rank 1 (") and "; compute " in warnings[0]
    train = [r for r in out["rows"] if r["split"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30, 35, 40]

    # past the first window's warm-up rank 0 waits ~60 ms a step in the all-gathers / all-reduces
    # (means over the windows: on a loaded machine one window's waits move by 20 ms either way)
    def mean(rank: int, phase: str) -> float:
        return sum(r["ranks"][rank][f"{phase}_ms"] for r in train[1:]) / len(train[1:])

    assert mean(0, "comm") > mean(1, "comm") + 30, [r["ranks"] for r in train]
    assert mean(1, "compute") > mean(0, "compute") + 30, [r["ranks"] for r in train]


def test_short_windows_are_pooled_until_a_comparison_covers_ten_steps(caplog):
    watch = StragglerWatch(0.15, 1, logging.getLogger("test.stragglers.pool"))
    one_step = [
        RankTimes(t.rank, t.host, t.local_rank, t.phases, steps=1) for t in _ranks(1, "data", 0.3)
    ]
    with caplog.at_level(logging.INFO, "test.stragglers.pool"):
        found = [watch.note(one_step) for _ in range(20)]
    # compared at the 10th and the 20th window only, on their pooled means
    assert [i for i, f in enumerate(found, 1) if f is not None] == [10, 20]
    assert found[9].times.steps == 10 and found[9].cause_s == pytest.approx(0.304)
    # a window of another world (an elastic job re-formed) starts the pool anew
    watch.note(one_step)
    two = [RankTimes(t.rank, t.host, t.local_rank, t.phases, steps=1) for t in _ranks(n=2)]
    assert watch.note(two) is None and [(t.rank, t.steps) for t in watch.pool] == [(0, 1), (1, 1)]


def test_a_rank_with_slow_checkpoint_writes_is_named_with_cause_checkpoint(
    tmp_path, corpus, token_cache
):
    out, warnings = _faulty_run(_run_with_slow_fsync, tmp_path, corpus, token_cache)
    assert len(warnings) == 1, out["said"]
    assert warnings[0].startswith("straggler: rank 0 (") and "; checkpoint " in warnings[0]
    assert "checkpoint.async_save" in warnings[0]


def test_a_rank_throttled_by_a_cpu_quota_is_named_with_cause_compute(tmp_path, corpus, token_cache):
    from throttle import Unavailable, cpu_quota

    try:
        with cpu_quota(0.1) as group:
            out, warnings = _faulty_run(_run_throttled, tmp_path, corpus, token_cache, str(group))
    except Unavailable as e:
        pytest.skip(str(e))
    # named by the 4th comparison (step 40) at the latest, the first one's steps being warm-up
    assert warnings, out["said"]
    assert warnings[0].startswith("straggler: rank 1 (") and "; compute " in warnings[0]
    assert "a throttled, busy or different device" in warnings[0]
    train = [r for r in out["rows"] if r["split"] == "train"]
    fast, slow = (sum(r["ranks"][k]["compute_ms"] for r in train) for k in (0, 1))
    assert slow > 2 * fast, [r["ranks"] for r in train]


def _run_fault_free(rt, base: str, corpus: str, token_cache: str, arg: tuple) -> dict:
    """The same run with no fault, `steps` long, each rank in a favoured cgroup (`group`; None
    where this machine has none): ahead of the test workers beside it, whose load is no fault of
    the run's (CI's 2 busy cores once put rank 0 2.3x behind)."""
    from throttle import join

    steps, group = arg
    if group is not None:
        join(group)
    return _run(rt, base, corpus, token_cache, **{"train.max_steps": steps})


def test_a_fault_free_run_of_500_steps_raises_no_warning(tmp_path, corpus, token_cache):
    from throttle import Unavailable, cpu_favoured

    try:
        with cpu_favoured() as group:
            out, warnings = _faulty_run(
                _run_fault_free, tmp_path, corpus, token_cache, (500, str(group))
            )
    except Unavailable:  # no cgroup to favour the ranks in: as they are
        out, warnings = _faulty_run(_run_fault_free, tmp_path, corpus, token_cache, (500, None))
    assert warnings == [], out["said"]
    train = [r for r in out["rows"] if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(5, 501, 5))
    # not even a rank "behind" at INFO: on a tiny model the scheduler's noise is a few ms a step
    assert not [m for level, m in out["said"] if "is behind" in m], out["said"]
