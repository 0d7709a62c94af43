"""`lockstep train` (lockstep/cli/train.py): the resolved config printed, what is refused before any
worker starts with its one-line message and exit code, a crash's traceback shown once. Its flags:
test_train_flags.py; training runs: tests/e2e."""

from __future__ import annotations

import os

import yaml
from conftest import run_lockstep, run_main

from lockstep.runtime import free_port


def test_print_config_shows_the_resolved_values(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: {hidden_size: 48}\ntrain: {max_steps: 3}\n")
    code, out, err = run_main(
        capsys,
        "train",
        "--config",
        config,
        "--layers",
        "3",
        "--set",
        "train.max_steps=7",
        "--print-config",
    )
    assert code == 0 and err == ""
    printed = yaml.safe_load(out)
    # file, then flags
    assert printed["model"]["hidden_size"] == 48 and printed["model"]["layers"] == 3
    assert printed["train"]["max_steps"] == 7  # --set overrides the file


def test_bad_input_is_one_line_and_exit_2(capsys):
    cases = [
        (
            ["--set", "foo"],
            "lockstep train: error: --set 'foo' is not KEY=VALUE; e.g. --set train.batch_size=64",
        ),
        (
            ["--hiden-size", "64"],
            "lockstep train: error: unknown option '--hiden-size'; did you mean --hidden-size?",
        ),
        (
            ["--layers", "two", "--print-config"],
            "lockstep train: error: model.layers = 'two' (from command line) must be an integer; got str",
        ),
        # the batch arithmetic is checked before any worker starts
        (
            ["--world-size", "3", "--global-batch-size", "32", "--micro-batch-size", "4"],
            "lockstep train: error: global batch 32 is not divisible by world_size(3) x micro_batch_size(4) = 12; set "
            "train.batch_size to a multiple of 12",
        ),
    ]
    for argv, message in cases:
        code, out, err = run_main(capsys, "train", *argv)
        assert (code, out, err) == (2, "", message + "\n"), argv


CRASHES = """
    import torch
    from torch import nn

    class Crashes(nn.Module):
        '''Trains one step, then its forward fails as a bug in the user's model would.'''

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("the model's own bug")
            return self.lin(x).pow(2).mean()

    def build_model():
        return Crashes()

    def build_data():
        return [{"x": torch.randn(2)} for _ in range(16)]
"""


def test_a_crash_shows_its_traceback_once(tmp_path, write_module):
    """In this process (--world-size 1) and as a launched worker, the traceback of a crash reaches the
    console once: run_training's log line shows it, so the command does not print it again."""
    module = write_module(CRASHES)
    common = (
        "train",
        "--model-kind",
        "custom",
        "--set",
        f"model.factory={module}:build_model",
        "--set",
        "data.kind=custom",
        "--set",
        f"data.factory={module}:build_data",
        "--set",
        "data.num_workers=0",
        "--global-batch-size",
        "4",
        "--max-steps",
        "3",
        "--set",
        "parallel.check_steps=0",
        "--device",
        "cpu",
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    here = run_lockstep(
        *common, "--world-size", "1", "--output-dir", str(tmp_path / "here"), check=False, env=env
    )
    worker_env = {
        **env,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    worker = run_lockstep(
        *common,
        "--launched-by-lockstep",
        "--output-dir",
        str(tmp_path / "worker"),
        check=False,
        env=worker_env,
    )
    for proc in (here, worker):
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-6000:]
        assert "RuntimeError: the model's own bug" in proc.stderr


def test_a_run_whose_step_would_not_fit_is_refused_before_a_worker_starts(capsys, tmp_path):
    run = tmp_path / "run"
    # fmt: off
    code, _, err = run_main(
        capsys, "train", "--hidden-size", 32768, "--attention-heads", 256, "--layers", 2,
        "--max-seq-length", 16, "--global-batch-size", 2, "--world-size", 2,
        "--output-dir", run, "--set", "train.plan_check=refuse",
    )
    # fmt: on
    assert code == 2
    assert "lockstep plan: a step of this run needs" in err
    assert "to start anyway: --set train.plan_check=warn (or off)" in err
    assert not run.exists()  # no worker started, nothing written
