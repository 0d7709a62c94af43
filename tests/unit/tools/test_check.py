"""lockstep/tools/check.py: `lockstep check`'s library call on the built-in GPT, in one process and on two real
hand-started gloo ranks: the micro-batches checked, the DDP settings chosen, the gradients compared, the verdict
printed and RUN/ddp_check.json written. Its arguments: tests/unit/cli/test_check.py."""

from __future__ import annotations

import json

import torch
from conftest import start_ranks

from lockstep.config import load_config
from lockstep.runtime import free_port
from lockstep.tools.check import run_check


def _cfg(corpus, cache, run, **distributed):
    overrides = {
        "model.hidden_size": 32,
        "model.attention_heads": 2,
        "model.layers": 2,
        "model.max_seq_length": 32,
        "data.path": str(corpus),
        "data.cache_dir": str(cache),
        "data.num_workers": 0,
        "train.batch_size": 8,
        "train.micro_batch_size": 4,
        "train.mixed_precision": "no",
        "parallel.check_steps": 2,
        "checkpoint.output_dir": str(run),
        "distributed.device": "cpu",
        **{f"distributed.{k}": v for k, v in distributed.items()},
    }
    return load_config(None, {k: str(v) for k, v in overrides.items()})


def test_one_process_checks_the_steps_but_not_ddp(tmp_path, corpus, token_cache, capsys):
    result = run_check(_cfg(corpus, token_cache, tmp_path / "run"))
    assert (result.agreed, result.problem) == (True, None)
    # 2 steps of a global batch of 8 in micro-batches of 4 on one rank: 2 x 2 micro-batches, every parameter used
    assert result.report.micro_batches == 4 and not result.report.any_unused
    assert result.choice.find_unused_parameters is False and result.choice.static_graph is False
    out = capsys.readouterr().out
    assert out.rstrip().endswith(
        "one process: DDP was not exercised; run with --world-size 2 or more to test it"
    )
    written = json.loads((tmp_path / "run" / "ddp_check.json").read_text())
    assert (written["world_size"], written["agreed"], written["problem"]) == (1, True, None)
    assert written["choice"]["find_unused_parameters"] is False


def _rank(rank: int, cfg_args: tuple, out: str) -> None:
    torch.set_num_threads(1)
    corpus, cache, run, port = cfg_args
    result = run_check(_cfg(corpus, cache, run, world_size=2, rank=rank, master_port=port))
    torch.save(
        {
            "agreed": result.agreed,
            "problem": result.problem,
            "micro_batches": result.report.micro_batches,
            "any_unused": result.report.any_unused,
        },
        f"{out}.{rank}",
    )


def test_two_ranks_run_the_steps_under_ddp_with_identical_gradients(tmp_path, corpus, token_cache):
    run, out = tmp_path / "run", str(tmp_path / "result")
    start_ranks(_rank, (str(corpus), str(token_cache), str(run), free_port()), out, nprocs=2)
    for rank in (0, 1):  # each rank's own answer: 2 steps x 1 micro-batch on each of 2 ranks
        assert torch.load(f"{out}.{rank}") == {
            "agreed": True,
            "problem": None,
            "micro_batches": 4,
            "any_unused": False,
        }, rank
    written = json.loads((run / "ddp_check.json").read_text())
    assert (written["world_size"], written["agreed"], written["problem"]) == (2, True, None)
    assert len(written["report"]["unused"]) == 2  # what each rank saw, gathered on rank 0
    # the GPT keeps no buffers; a BatchNorm model's differ: tests/unit/parallel/test_buffers.py
    assert written["buffers"] == "every rank holds the same 0 buffer(s)"
