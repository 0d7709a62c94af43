"""tests/coverage_start/sitecustomize.py: another package's import runs with this thread's tracer off,
lockstep's with it on (also when another package imports lockstep), torch.compile's compiler and the
dispatch modes lockstep.plan runs under, the optimizer's step and DCP's save with it off, a fork's coverage
restarted and saved once, and coverage records the same lines and branches of lockstep with the
hook as without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

START = Path(__file__).resolve().parents[1] / "coverage_start"

PROBE = """
    import sys, threading

    tracer = sys.gettrace()
    import outside                          # another package: imported untraced
    import outside_with_ours                # another package that imports lockstep.rng: that import traced
    from lockstep import errors             # lockstep itself: traced
    import torch                            # torch.compile's compiler: untraced; what it compiles traced
    from lockstep import rng

    def backend(gm, example_inputs):
        compiling["tracer"] = type(sys.gettrace()).__name__
        return gm.forward

    def step(x):
        torch._dynamo.disable(rng.capture_rng_state)()  # lockstep's lines, run as the graph runs
        return x + 1

    compiling = {}
    torch.compile(step, backend=backend)(torch.ones(2))
    from torch._subclasses.fake_tensor import FakeTensorMode   # a dispatch mode lockstep.plan runs under
    with FakeTensorMode():
        fake = torch.ones(2) + 1
        rng.capture_rng_state()                              # lockstep's lines inside the mode: traced
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    adam = sys.modules["torch.optim.adam"]
    functional, optimizing = adam.adam, {}
    def spy(*args, **kwargs):                               # what AdamW's step calls: traced?
        optimizing["tracer"] = type(sys.gettrace()).__name__
        return functional(*args, **kwargs)
    adam.adam = spy
    torch.optim.AdamW([param]).step()
    import torch.distributed.checkpoint as dcp
    from lockstep.checkpoint.sharded import saved_state, shard_writer
    writer, saving = shard_writer("shards"), {}
    write_data = writer.write_data
    def spy_write(*args, **kwargs):                         # what DCP's save calls: traced?
        saving["tracer"] = type(sys.gettrace()).__name__
        return write_data(*args, **kwargs)
    writer.write_data = spy_write
    dcp.save(saved_state(torch.nn.Linear(2, 2), None), storage_writer=writer, no_dist=True)
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(other=type(sys.gettrace()).__name__))
    thread.start()
    thread.join()
    print(json.dumps({
        "hook": __import__("builtins").__import__.__name__,
        "tracer": type(tracer).__name__,
        "during_outside": outside.SEEN,
        "during_ours": outside_with_ours.OURS_SEEN,
        "during_compile": compiling["tracer"],
        "restored": sys.gettrace() is tracer,
        "other_thread": seen["other"],
        "dispatch_untraced": hasattr(FakeTensorMode.__torch_dispatch__, "untraced"),
        "during_step": optimizing["tracer"],
        "during_save": saving["tracer"],
        "fake": type(fake).__name__,
    }))
"""


def _measure(tmp_path: Path, name: str, hook: bool) -> tuple[dict, dict]:
    """Run PROBE under `coverage run --branch --source=lockstep`: (what it printed, lockstep's lines
    and branches as coverage recorded them, by file)."""
    work = tmp_path / name
    work.mkdir()
    (work / "outside.py").write_text("import sys\nSEEN = type(sys.gettrace()).__name__\n")
    (work / "outside_with_ours.py").write_text(
        "import sys\nimport lockstep.rng\nOURS_SEEN = type(sys.gettrace()).__name__\n"
    )
    (work / "probe.py").write_text("import json\n" + textwrap.dedent(PROBE))
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")
    }  # not the suite's own
    env["PYTHONPATH"] = os.pathsep.join([str(START)] * hook + [str(work)])
    data = work / ".coverage"
    run = [
        sys.executable,
        "-m",
        "coverage",
        "run",
        "--branch",
        "--source=lockstep",
        f"--data-file={data}",
        str(work / "probe.py"),
    ]
    proc = subprocess.run(run, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = work / "coverage.json"
    subprocess.run(
        [sys.executable, "-m", "coverage", "json", f"--data-file={data}", "-o", str(report)],
        cwd=work,
        env=env,
        capture_output=True,
        check=True,
        timeout=120,
    )
    return json.loads(proc.stdout.splitlines()[-1]), _recorded(report)


def _recorded(report: Path) -> dict:
    """lockstep's lines and branches in a `coverage json` report, by file name."""
    files = json.loads(report.read_text())["files"]
    return {
        Path(f).name: (v["executed_lines"], v["executed_branches"])
        for f, v in files.items()
        if v["executed_lines"]
    }


def test_other_packages_import_untraced_and_lockstep_is_recorded_as_without_the_hook(tmp_path):
    seen, with_hook = _measure(tmp_path, "hook", hook=True)
    assert seen == {
        "hook": "untraced_import",
        "tracer": "CTracer",
        "during_outside": "NoneType",
        "during_ours": "NoneType",
        "during_compile": "NoneType",
        "restored": True,
        "other_thread": "CTracer",
        "dispatch_untraced": True,
        "during_step": "NoneType",
        "during_save": "NoneType",
        "fake": "FakeTensor",
    }
    plain_seen, without = _measure(tmp_path, "plain", hook=False)
    assert plain_seen["hook"] == "__import__" and plain_seen["during_outside"] == "CTracer"
    assert plain_seen["during_compile"] == "CTracer" and not plain_seen["dispatch_untraced"]
    assert plain_seen["during_step"] == plain_seen["during_save"] == "CTracer"
    # lockstep.rng, imported by another package while its import ran untraced, is recorded all the same
    assert {"rng.py", "errors.py", "sharded.py"} <= with_hook.keys()
    assert with_hook == without


FORKS = """
    import os, sys
    from lockstep import rng

    def level(depth):  # a fork of a fork of a fork, as a rank of `lockstep launch` is
        pid = os.fork()
        if pid == 0:
            if depth < 3:
                level(depth + 1)
            else:
                rng.capture_rng_state()  # lockstep's lines in the deepest process only
            os._exit(0)  # as a multiprocessing child ends
        assert os.waitpid(pid, 0)[1] == 0

    level(1)
"""


def _fork_chain(tmp_path: Path, name: str, hook: bool) -> tuple[int, dict]:
    """FORKS under coverage with the suite's patches (pyproject.toml): (the data files its four
    processes wrote, lockstep's lines and branches recorded, by file)."""
    work = tmp_path / name
    work.mkdir()
    (work / "forks.py").write_text(textwrap.dedent(FORKS))
    (work / "rc").write_text(
        "[run]\nbranch = true\nsource = lockstep\npatch = subprocess, fork, _exit, execv\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(START)] * hook)
    cov = [sys.executable, "-m", "coverage"]
    run = [*cov, "run", "--rcfile=rc", "forks.py"]
    proc = subprocess.run(run, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = len(list(work.glob(".coverage*")))
    for step in (["combine", "--rcfile=rc"], ["json", "--rcfile=rc", "-o", "cov.json"]):
        subprocess.run([*cov, *step], cwd=work, env=env, capture_output=True, check=True)
    return files, _recorded(work / "cov.json")


def test_each_fork_restarts_coverage_once_and_saves_once_with_the_same_lines_recorded(tmp_path):
    # coverage 7.17 alone restarts a fork's coverage once per handler its ancestors registered
    # (1, 2, 4 times here) and each restart's _exit saves again: 15 files (one a process with it)
    files, recorded = _fork_chain(tmp_path, "hook", hook=True)
    plain_files, plain = _fork_chain(tmp_path, "plain", hook=False)
    assert files == 4 and plain_files >= files, (files, plain_files)
    assert "rng.py" in recorded and recorded == plain
