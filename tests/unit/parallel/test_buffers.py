"""Buffers under DDP: the DDP check leaves no trace; ranks' buffers compared; SyncBatchNorm.

The models here are ones the rest of the suite has not seen: BatchNorm statistics, a forward counter
(a plain int that picks a branch, and a buffer), and an EMA updated in forward.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_ranks
from torch import nn

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.parallel.buffers import (
    buffer_digests,
    check_sync_batchnorm,
    convert_sync_batchnorm,
    differing_buffers,
    explain_buffers,
    no_trace,
)

WATCHED = """
    import torch
    from torch import nn

    class Watched(nn.Module):
        '''BatchNorm statistics, a forward counter that picks a branch, and an EMA of the inputs.'''

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 8)
            self.bn = nn.BatchNorm1d(8)
            self.head = nn.Linear(8, 1)
            self.calls = 0  # a plain int: no state_dict sees it
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x, y):
            if self.training:
                self.calls += 1
                self.seen += 1
                with torch.no_grad():
                    self.ema.mul_(0.9).add_(0.1 * x.mean(0))
            scale = 2.0 if self.calls % 3 == 0 else 1.0  # a branch on the count
            return ((self.head(self.bn(self.lin(x))).squeeze(-1) * scale - y) ** 2).mean()

    def build_model():
        return Watched()

    def build_data():
        g = torch.Generator().manual_seed(0)
        return [{"x": torch.randn(4, generator=g) * 3 + 1, "y": torch.randn((), generator=g)}
                for _ in range(64)]
"""


class Counter(nn.Module):
    """Everything a forward may change besides parameters, in every form no_trace must undo."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("total", torch.zeros(3))
        self.calls, self.history, self.meta = 0, [], {"last": None}
        self.plain = torch.zeros(2)  # a tensor attribute that is not a buffer

    def forward(self, x):
        self.calls += 1
        self.history.append(self.calls)
        self.meta["last"] = self.calls
        self.plain += 1
        self.total = self.total + x.sum(0)  # rebinds the buffer to a new tensor
        self.extra = "added by forward"
        return self.bn(x).sum()


def test_no_trace_restores_buffers_attributes_and_objects():
    torch.manual_seed(0)
    model = Counter().train()
    model(torch.randn(5, 3))  # some state before, so restoring is not resetting
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objects = (model.total, model.history, model.meta, model.plain, model.bn.running_mean)
    calls, history, plain = model.calls, list(model.history), model.plain.clone()
    delattr(model, "extra")
    with no_trace(model):
        for _ in range(4):
            model(torch.randn(5, 3) + 2)
        # it did change
        assert model.calls == calls + 4 and model.bn.num_batches_tracked.item() == 5
    after = model.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert (model.calls, model.history, model.meta) == (calls, history, {"last": calls})
    assert torch.equal(model.plain, plain) and not hasattr(model, "extra")
    # the same objects: a reference taken before (an optimizer, a hook) sees the model's state
    assert all(
        a is b
        for a, b in zip(
            objects, (model.total, model.history, model.meta, model.plain, model.bn.running_mean)
        )
    )


def _trained(rt, cfgs: list) -> dict:
    """Whole training runs, one after another on this module's process group (one group for all),
    then `lockstep check` of the first config, then _compared."""
    from lockstep.rank_logs import init_rank_logging
    from lockstep.train.loop import StopRequest

    # the run as `lockstep train` makes it, on these processes
    from lockstep.train.run import _train

    out = []
    for cfg in cfgs:
        log = init_rank_logging(Path(cfg.checkpoint.output_dir), rt.rank, rt.is_main)
        with StopRequest() as stop:
            _, wl = _train(cfg, rt, log, stop)
        model = wl.model
        out.append(
            {"state": {k: v.clone() for k, v in model.state_dict().items()}, "calls": model.calls}
        )
    # `lockstep check` on the same model, its report in ddp_check.json
    from lockstep.tools.check import _check

    run_dir = Path(cfgs[0].checkpoint.output_dir).parent / "check"
    _check(cfgs[0], rt, run_dir, init_rank_logging(run_dir, rt.rank, rt.is_main))
    return {"runs": out, "compared": _compared(rt)}


RUNS = {  # name -> settings; every run compares gradients and buffers across ranks (check_grads)
    "checked": {"parallel.check_steps": 2},
    "unchecked": {"parallel.check_steps": 0},
    "unsynced": {"parallel.check_steps": 2, "parallel.broadcast_buffers": False},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """name -> (each rank's final model state, rank 0's log) of 5 steps of the Watched model on
    2 ranks; "root" -> their folder, where `lockstep check` of the first config wrote
    check/ddp_check.json; "compared" -> each rank's _compared, on the same ranks afterwards."""
    root = tmp_path_factory.mktemp("watched")
    (root / "watched_model.py").write_text(textwrap.dedent(WATCHED))
    cfgs = [
        load_config(
            None,
            {
                "model.kind": "custom",
                "model.factory": "watched_model:build_model",
                "data.kind": "custom",
                "data.factory": "watched_model:build_data",
                "data.num_workers": 0,
                "train.batch_size": 8,
                "train.grad_accum": 2,
                "train.max_steps": 5,
                "train.mixed_precision": "no",
                "train.eval_interval": 0,
                "distributed.device": "cpu",
                "parallel.check_grads": True,
                "checkpoint.output_dir": str(root / name),
                **sets,
            },
        )
        for name, sets in RUNS.items()
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))  # the ranks start with this sys.path
        per_rank = run_ranks(_trained, cfgs)
    got = {
        name: (
            [rank["runs"][i] for rank in per_rank],
            (root / name / "logs" / "rank0.log").read_text(),
        )
        for i, name in enumerate(RUNS)
    }
    return {**got, "root": root, "compared": [rank["compared"] for rank in per_rank]}


def test_the_ddp_check_leaves_the_model_as_a_run_without_it(runs):
    """The state after 5 steps with the check (2 steps x 2 micro-batches read ahead) equals that of
    a
    run with check_steps 0: every tensor and buffer on every rank, and the plain forward counter."""
    (checked, log), (unchecked, _) = runs["checked"], runs["unchecked"]
    assert "DDP check: the loss of each of the 8 micro-batches" in log
    for rank, (a, b) in enumerate(zip(checked, unchecked)):
        assert a["calls"] == b["calls"] == 10, rank  # 5 steps x 2 micro-batches: each seen once
        assert a["state"]["seen"].item() == 10 and a["state"]["bn.num_batches_tracked"].item() == 10
        assert list(a["state"]) == list(b["state"])
        for name in a["state"]:
            assert torch.equal(a["state"][name], b["state"][name]), (rank, name)


def _compared(rt) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()
    same = differing_buffers(rt, model)
    # each rank's own batch: shifted and scaled (a shift alone moves the mean, not the variance, so
    # running_var differed only by rounding, and not at all on a CPU with AVX-512)
    model(torch.randn(6, 3) * (1 + rt.rank) + rt.rank)
    return {"before": same, "after": differing_buffers(rt, model)}


def test_differing_buffers_names_what_each_rank_updated_from_its_own_batch(runs):
    for got in runs["compared"]:
        assert got["before"] == []
        # the batch count is the same on both ranks; the statistics are not
        assert got["after"] == ["1.running_mean", "1.running_var"]


def test_explain_buffers_says_why_and_the_fix():
    names = ["bn.running_mean", "bn.running_var"]
    on = explain_buffers(names, broadcast_buffers=True)
    assert on.startswith("2 buffer(s) differ between ranks (bn.running_mean, bn.running_var): ")
    assert "rank 0's to every rank before each forward" in on and "checkpoints keep rank 0's" in on
    assert on.endswith("use parallel.sync_batchnorm: true (CUDA)")
    assert "drift apart for the whole run" in explain_buffers(names, broadcast_buffers=False)
    many = explain_buffers([f"b{i}" for i in range(6)], True)
    assert "(b0, b1, b2, b3 and 2 more)" in many


def test_lockstep_check_reports_the_buffers_that_differ_beside_identical_gradients(runs):
    written = json.loads((runs["root"] / "check" / "ddp_check.json").read_text())
    assert (written["world_size"], written["agreed"], written["problem"]) == (2, True, None)
    assert written["buffers"].startswith(
        "3 buffer(s) differ between ranks (ema, bn.running_mean, "
        "bn.running_var): each rank updates them in its forward"
    )


def test_check_grads_reports_differing_buffers_once_and_broadcast_buffers_reaches_ddp(runs):
    for name in ("checked", "unsynced"):
        results, log = runs[name]
        warnings = [line for line in log.splitlines() if "buffer(s) differ between ranks" in line]
        # reported when the set of differing buffers first appears, not every step
        assert len(warnings) == 1, warnings
        assert (
            "3 buffer(s) differ between ranks (ema, bn.running_mean, bn.running_var)" in warnings[0]
        )
        assert ("drift apart" in warnings[0]) is (name == "unsynced")
        assert (
            "parallel.check_grads: gradients were identical on all 2 ranks after each of 5 steps"
            in log
        )
        assert not torch.equal(results[0]["state"]["ema"], results[1]["state"]["ema"])
    # with broadcast on, every forward starts from rank 0's buffers; off, each rank keeps its own
    on, off = (runs[name][0][1]["state"]["bn.running_mean"] for name in ("checked", "unsynced"))
    assert not torch.equal(on, off)


def test_buffer_digests_hash_every_buffer_by_its_bytes():
    model = nn.BatchNorm1d(2)
    digests = buffer_digests(model)
    assert list(digests) == ["running_mean", "running_var", "num_batches_tracked"]
    model.running_mean[0] = 1e-30  # a difference a float sum would hide
    assert buffer_digests(model)["running_mean"] != digests["running_mean"]


def test_sync_batchnorm_is_refused_off_cuda_and_outside_ddp_with_the_fix():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    check_sync_batchnorm(False, "ddp", cpu, 4)
    check_sync_batchnorm(True, "ddp", cpu, 1)  # one process: nothing to synchronise
    with pytest.raises(ConfigError) as e:
        check_sync_batchnorm(True, "ddp", cpu, 2)
    assert str(e.value).startswith(
        "parallel.sync_batchnorm: true needs CUDA devices (torch's SyncBatchNorm "
        "refuses cpu tensors across ranks)"
    )
    assert "parallel.broadcast_buffers" in str(e.value)
    with pytest.raises(
        ConfigError, match="with parallel.data_parallel: fsdp: .* use data_parallel: ddp"
    ):
        check_sync_batchnorm(True, "fsdp", cuda, 2)


def test_convert_sync_batchnorm_keeps_the_parameters_and_buffers():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm1d(4)))
    weight, mean = model[1].weight, model[1].running_mean
    keys = list(model.state_dict())
    assert convert_sync_batchnorm(model) == 2
    assert type(model[1]) is nn.SyncBatchNorm and type(model[2][0]) is nn.SyncBatchNorm
    assert (
        model[1].weight is weight
        and model[1].running_mean is mean
        and list(model.state_dict()) == keys
    )
    assert convert_sync_batchnorm(nn.Linear(2, 2)) == 0
    with pytest.raises(ConfigError, match="the model is a single BatchNorm layer"):
        convert_sync_batchnorm(nn.BatchNorm1d(2))


def test_sync_batchnorm_on_cpu_is_refused_before_any_worker_starts(tmp_path, capsys):
    from lockstep.cli import main

    code = main(
        [
            "train",
            "--world-size",
            "2",
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / "run"),
            "--set",
            "parallel.sync_batchnorm=true",
        ]
    )
    assert code == 2
    out = capsys.readouterr()
    assert "parallel.sync_batchnorm: true needs CUDA devices" in out.err + out.out
    assert not (tmp_path / "run" / "logs").exists()  # no worker started
