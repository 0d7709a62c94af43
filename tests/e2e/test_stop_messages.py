"""What lockstep prints when a run stops early (SIGTERM, Ctrl-C, a crashed or hung worker): the checkpoint this
run committed, or plainly that it committed none, read from disk, and what the same command would resume
from. One message, printed once, on every path: in-process (1 process), lockstep's own launcher (2 workers),
an outside torchrun (every worker runs the CLI), and a stop that arrives while a rank is stuck in a collective.
Also asserted elsewhere, beside the scenario they share: a signal to the launcher after a commit
(test_cli_run.py), a hang stopped by the watchdog (test_train_dist.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TINY, run_lockstep
from lockstep_process import start_lockstep
from procs import kill_tree, wait_for

pytestmark = pytest.mark.slow

AGE = r"\d+ s ago"  # how long before the message the manifest was written


def _train(run: Path, corpus: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(corpus),
        "--output-dir",
        str(run),
        *TINY,
        "--global-batch-size",
        "8",
        "--set",
        f"data.cache_dir={cache}",
        *extra,
    ]


def _steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return (
        sum(json.loads(line)["split"] == "train" for line in path.read_text().splitlines())
        if path.exists()
        else 0
    )


def _latest(run: Path) -> str | None:
    path = run / "checkpoints" / "latest"
    return path.read_text().strip() if path.exists() else None


def _pid_of_rank(run: Path, rank: int) -> int:
    """The pid of this launch's rank (logs are appended to: the last start line is this launch's)."""
    starts = [
        line
        for line in (run / "logs" / f"rank{rank}.log").read_text().splitlines()
        if "(pid " in line
    ]
    return int(starts[-1].split("(pid ")[1].split(")")[0])


def _finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise


def _said(err: str) -> list[str]:
    """The lines lockstep itself printed on stopping (not the ranks' log lines)."""
    return [line for line in err.splitlines() if line.startswith("lockstep train:")]


def _resume_auto(name: str) -> str:
    return (
        f"to resume, run the same command again: --resume auto takes {name} (step {int(name[5:])}) and "
        "verifies its checksums before loading it"
    )


@pytest.fixture(scope="module")
def seeded(tmp_path_factory, corpus, token_cache) -> Path:
    """A run that committed step_00000002 before the launch under test (the tests train on in a
    copy of it)."""
    run = tmp_path_factory.mktemp("seeded") / "run"
    run_lockstep(*_train(run, corpus, token_cache, "--max-steps", "2", "--save-interval", "2"))
    return run


def _asleep_in_the_kernel(pid: int, polls: int = 5):
    """A predicate for wait_for: true once `pid`'s main thread has slept (state S) without using
    CPU time for `polls` polls in a row (0.1 s apart): blocked in a wait that does not return, as in
    a collective whose peer is frozen. A thread that computes, or waits for a core, is running (R)
    or gains CPU ticks."""
    seen = {"cpu": -1, "still": 0}

    def check() -> bool:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, cpu = fields[0], int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
        seen["still"] = seen["still"] + 1 if state == "S" and cpu == seen["cpu"] else 0
        seen["cpu"] = cpu
        return seen["still"] >= polls

    return check


# ---- one process: run_training in the CLI's own process --------------------------------------------------


def test_sigterm_in_process_names_the_committed_checkpoint(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    proc = start_lockstep(
        *_train(run, corpus, token_cache, "--max-steps", "100000", "--save-interval", "0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: _steps_logged(run) >= 3, 120, "step 3", proc)
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    latest = _latest(run)
    step = int(latest[5:])
    assert step >= 3 and f"stop requested (signal 15): checkpoint committed at step {step}" in err
    [line] = _said(err)
    assert re.fullmatch(
        rf"lockstep train: stopped by signal 15 \(SIGTERM\); this run committed checkpoint {latest} "
        rf"\(step {step}, {AGE}\); {re.escape(_resume_auto(latest))}",
        line,
    ), line


def test_resume_none_says_the_same_command_starts_over(tmp_path, corpus, token_cache, seeded):
    """checkpoint.resume none: running the same command again would NOT resume; the message says what to pass."""
    run = tmp_path / "run"
    shutil.copytree(seeded, run)
    first = run / "checkpoints" / "step_00000002"
    proc = start_lockstep(
        *_train(
            run,
            corpus,
            token_cache,
            "--max-steps",
            "100000",
            "--save-interval",
            "0",
            "--resume",
            "none",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: _steps_logged(run) >= 2 + 3, 120, "step 3 of the second run", proc)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    err = _finish(proc)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    latest = _latest(run)
    assert latest != first.name and first.is_dir()
    [line] = _said(err)
    assert re.fullmatch(
        rf"lockstep train: stopped by signal 2 \(SIGINT\); this run committed checkpoint {latest} "
        rf"\(step {int(latest[5:])}, {AGE}\); checkpoint.resume is 'none', so the same command starts "
        rf"over at step 0; to continue from {latest} \(step {int(latest[5:])}\) run it with "
        r"--resume auto instead",
        line,
    ), line


CRASHING_MODEL = """
    import os

    import torch
    from torch import nn

    class Crashing(nn.Module):
        '''A regression model that raises in its forward call number CRASH_AT (on rank CRASH_RANK only).'''

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)
            self.calls = 0

        def forward(self, x, y):
            self.calls += 1
            if self.calls == int(os.environ["CRASH_AT"]) and os.environ.get("RANK", "0") == os.environ["CRASH_RANK"]:
                raise RuntimeError(f"simulated crash in forward call {self.calls}")
            return ((self.lin(x).squeeze(-1) - y) ** 2).mean()

    def build_model():
        return Crashing()

    def build_data():
        g = torch.Generator().manual_seed(0)
        return [{"x": torch.randn(4, generator=g), "y": torch.randn((), generator=g)} for _ in range(512)]
"""


def _crashing(tmp_path: Path, crash_at: int, rank: int = 0) -> tuple[list[str], dict]:
    (tmp_path / "crashing_model.py").write_text(textwrap.dedent(CRASHING_MODEL))
    env = {
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "CRASH_AT": str(crash_at),
        "CRASH_RANK": str(rank),
    }
    args = [
        "--model-kind",
        "custom",
        "--set",
        "model.factory=crashing_model:build_model",
        "--data-kind",
        "custom",
        "--set",
        "data.factory=crashing_model:build_data",
        "--global-batch-size",
        "8",
        "--log-interval",
        "1",
        "--set",
        "data.num_workers=0",
        "--max-steps",
        "100",
        "--save-interval",
        "2",
    ]
    return args, env


def test_crash_in_process_names_the_last_commit(tmp_path):
    run = tmp_path / "run"
    # one forward per step: steps 1-6 run, 2, 4, 6 are committed
    args, env = _crashing(tmp_path, crash_at=7)
    proc = run_lockstep("train", "--output-dir", str(run), *args, env=env, check=False, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _latest(run) == "step_00000006"
    # the traceback is still shown
    assert "RuntimeError: simulated crash in forward call 7" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"lockstep train: error: RuntimeError: simulated crash in forward call 7; this run committed "
        rf"checkpoint step_00000006 \(step 6, {AGE}\); {re.escape(_resume_auto('step_00000006'))}",
        last,
    ), last


# ---- lockstep's own launcher: 2 workers under torch elastic ---------------------------------------------


def test_sigterm_while_a_rank_is_stuck_in_a_collective(tmp_path, corpus, token_cache, seeded):
    """Rank 1 frozen (SIGSTOP), rank 0 blocked in the step's all-reduce: SIGTERM reaches both, neither can run
    its handler, torch elastic kills them after its grace period. No checkpoint was committed, and the message
    says so, and that a resume takes the one from before this launch."""
    run = tmp_path / "run"
    shutil.copytree(seeded, run)
    before = _steps_logged(run)
    proc = start_lockstep(
        *_train(
            run,
            corpus,
            token_cache,
            "--world-size",
            "2",
            "--max-steps",
            "100000",
            "--save-interval",
            "0",
            "--set",
            "distributed.hang_seconds=0",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"},
    )  # grace period (default 30 s)
    frozen = None
    try:
        wait_for(lambda: _steps_logged(run) >= before + 3, 180, "3 steps on 2 ranks", proc)
        frozen = _pid_of_rank(run, 1)
        os.kill(frozen, signal.SIGSTOP)
        # rank 0 reaches the next all-reduce and waits there, in C++
        rank0 = _pid_of_rank(run, 0)
        wait_for(_asleep_in_the_kernel(rank0), 60, "rank 0 blocked in a collective", proc)
        proc.send_signal(signal.SIGTERM)
        err = _finish(proc, timeout=90)
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)  # SIGKILL ends a stopped process too
            except ProcessLookupError:
                pass
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert _latest(run) == "step_00000002"
    assert "committed a checkpoint first" not in err
    [line] = _said(err)
    assert line == (
        "lockstep train: stopped by signal 15 (SIGTERM); this run committed no checkpoint (`latest` still "
        f"names step_00000002, as when it started); {_resume_auto('step_00000002')}"
    ), line


ENDED = r"(exited with an error \(exit code 1\)|was killed by SIGTERM)"


def test_worker_crash_names_the_rank_and_the_last_commit(tmp_path):
    run = tmp_path / "run"
    args, env = _crashing(tmp_path, crash_at=9, rank=1)
    proc = run_lockstep(
        "train",
        "--world-size",
        "2",
        "--output-dir",
        str(run),
        *args,
        env=env,
        check=False,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    latest = _latest(run)
    assert latest is not None and int(latest[5:]) >= 2
    [line] = _said(proc.stderr)
    assert re.fullmatch(
        # rank 0 fails after it, in the step's all-reduce; either may leave the other to the agent's SIGTERM
        r"lockstep train: error: rank 1 failed first \(RuntimeError: simulated crash in forward call 9\)"
        rf" and {ENDED}; rank 0 {ENDED}; .*; this run committed "
        rf"checkpoint {latest} \(step {int(latest[5:])}, {AGE}\); {re.escape(_resume_auto(latest))}",
        line,
    ), line


# ---- an outside torchrun: every worker runs the CLI ------------------------------------------------------


def test_outside_torchrun_rank0_alone_prints_the_note(tmp_path, corpus, token_cache):
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "lockstep",
        *_train(run, corpus, token_cache, "--max-steps", "100000", "--save-interval", "0"),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    wait_for(lambda: _steps_logged(run) >= 3, 180, "step 3", proc)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both workers: they commit, and exit 0
    err = _finish(proc)
    latest = _latest(run)
    for rank in (0, 1):
        assert (
            f"checkpoint committed at step {int(latest[5:])}"
            in (run / "logs" / f"rank{rank}.log").read_text()
        )
    lines = _said(err)
    assert len(lines) == 1, err[-3000:]
    assert re.fullmatch(
        rf"lockstep train: stopped by signal 15 \(SIGTERM\); this run committed checkpoint {latest} "
        rf"\(step {int(latest[5:])}, {AGE}\); {re.escape(_resume_auto(latest))}",
        lines[0],
    ), lines[0]
