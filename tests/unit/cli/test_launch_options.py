"""lockstep/cli/launch_options.py: the launch flags declared once, in every command that takes them, with the
same spellings, defaults and refusals; KEY=VALUE pairs; the elastic batch plan printed by one function."""

from __future__ import annotations

import argparse
import io

import pytest
from conftest import run_main

from lockstep.cli.launch_options import (
    add_launch_options,
    key_values,
    options_from,
    print_elastic_plan,
)
from lockstep.errors import ConfigError
from lockstep.launch.options import LaunchOptions

from ..launch.test_slurm import config  # noqa: F401  (the fixture, written once)


def test_the_group_parses_to_launch_options_with_one_default_each():
    p = argparse.ArgumentParser()
    add_launch_options(p, nodes_help="nodes")
    assert options_from(p.parse_args([])) == LaunchOptions(1, 1, 0, {})
    # --nodes: --nnodes's alias
    args = p.parse_args(["--nodes", "1:2", "--rdzv-conf", "last_call_timeout=5"])
    assert options_from(args) == LaunchOptions(1, 2, 3, {"last_call_timeout": "5"})
    assert options_from(p.parse_args(["--nnodes", "2", "--max-restarts", "1"])) == LaunchOptions(
        2, 2, 1, {}
    )
    restarts_only = argparse.ArgumentParser()
    add_launch_options(restarts_only)  # `lockstep train`: this node's workers, their restarts
    assert options_from(restarts_only.parse_args(["--max-restarts", "2"])) == LaunchOptions(
        1, 1, 2, {}
    )
    with pytest.raises(SystemExit):
        restarts_only.parse_args(["--nnodes", "2"])


def test_every_command_lists_the_same_flags(capsys):
    for command in ("launch", "slurm", "k8s"):
        code, out, _ = run_main(capsys, command, "--help")
        assert code == 0
        for flag in (
            "--nnodes N|MIN:MAX, --nodes N|MIN:MAX",
            "--max-restarts MAX_RESTARTS",
            "--rdzv-conf KEY=VALUE",
            "(default: 0; 3 for a node range)",
        ):
            assert flag in " ".join(out.split()), (command, flag)
    code, out, _ = run_main(capsys, "train", "--help")
    assert code == 0 and "--max-restarts MAX_RESTARTS" in out and "--rdzv-conf" not in out


def test_every_command_refuses_a_bad_setting_with_the_same_words(config, tmp_path, capsys):  # noqa: F811
    extra = {"launch": [], "slurm": ["--dry-run"], "k8s": ["--image", "x", "--kind", "pytorchjob"]}
    for command, more in extra.items():
        for flags, words in (
            (
                ["--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=abc"],
                "last_call_timeout must be a whole number of seconds (or attempts) above 0",
            ),
            (["--nnodes", "2", "--rdzv-conf", "is_host=1"], "lockstep sets it per node"),
            (["--nodes", "1:2", "--max-restarts", "0"], "--nnodes 1:2 with --max-restarts 0"),
        ):
            code, out, err = run_main(capsys, command, config, *flags, *more)
            assert (
                (code, out) == (2, "") and f"lockstep {command}: error: " in err and words in err
            ), (command, err)
    code, _, err = run_main(
        capsys, "train", "--max-restarts", "-1", "--output-dir", tmp_path / "run"
    )
    assert code == 2 and "--max-restarts -1 must be >= 0" in err


def test_key_values_and_the_elastic_plan():
    assert key_values(["A=1", " B =x=y", "C="], "--env") == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(
        ConfigError, match=r"^--env 'NOEQUALS' is not KEY=VALUE; e.g. --env NCCL_DEBUG=INFO$"
    ):
        key_values(["NOEQUALS"], "--env")
    out = io.StringIO()
    print_elastic_plan("lockstep k8s", ["4 ranks: a", "2 ranks: b"], file=out)
    print_elastic_plan("lockstep k8s", [], file=out)  # a fixed job: nothing
    assert (
        out.getvalue()
        == "lockstep k8s: elastic job; the batch plan at each world size:\n  4 ranks: a\n  2 ranks: b\n"
    )


def test_train_under_a_launcher_leaves_the_restarts_to_it(tmp_path, capsys, monkeypatch):
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(key, value)  # as torchrun starts a worker
    code, out, err = run_main(
        capsys, "train", "--max-restarts", "2", "--output-dir", tmp_path / "run"
    )
    assert (code, out) == (2, "") and err == (
        "lockstep train: error: --max-restarts 2: this process was started by a launcher, which decides the "
        "restarts (torchrun --max-restarts, `lockstep launch --max-restarts`); drop it here\n"
    )
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_launch_and_doctor_join_the_nodes_with_the_same_flags(tmp_path, capsys):
    for command in ("launch", "doctor"):
        code, out, _ = run_main(capsys, command, "--help")
        assert code == 0
        for flag in ("--node-rank NODE_RANK", "--rdzv-endpoint HOST:PORT", "--rdzv-id RDZV_ID",
                     "--rdzv-timeout RDZV_TIMEOUT"):  # fmt: skip
            assert flag in out, (command, flag)
    code, out, _ = run_main(capsys, "doctor", "--help")
    # one fixed set of nodes, measured once
    assert "--max-restarts" not in out and "--rdzv-conf" not in out
    code, out, err = run_main(capsys, "doctor", "--nnodes", "1:2", "--output-dir", tmp_path / "out")
    assert (code, out) == (2, "") and err == (
        "lockstep doctor: error: --nnodes 1:2: the doctor measures a fixed set of nodes; pass their count N "
        "(run it on each node)\n"
    )
