"""Shared helpers: run lockstep as a user would (a real subprocess), a tiny model's settings, real gloo
process groups for in-process tests, and the user's own modules and text."""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from procs import descendants

if TYPE_CHECKING:
    import torch

# One thread per process: the suite's runs share 2 cores, and OpenMP threads that spin on a busy core make a
# 1-process run ~30x slower (measured: 2.3k vs 70k tok/s with a benchmark running beside it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch.compile's C++ kernels built in the compiling process: inductor's default pool of 2 compiler
# processes (each a new interpreter importing torch) cost 86 CPU-s where one process took 73 on a cold
# cache (tests/unit/train/test_setup.py's compiled run, 2-core Xeon), and the suite has no core to spare
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# and a graph's kernels in one C++ module with its wrapper (inductor's cpp_wrapper): 18 compiler runs
# where the Python wrapper's one module per kernel took 37, 45 CPU-s where it took 60 (that test, cold)
os.environ.setdefault("TORCHINDUCTOR_CPP_WRAPPER", "1")

# Bytecode written by the first process of the suite that imports a module, and read by every later
# one: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines), each interpreter would
# compile every module it imports again (lockstep's alone ~0.5 s of each start). The second command
# installs without compiling (README): 17.8k files compiled at install took 36 s of its wall time,
# where those the suite imports are compiled once as it goes (`import torch`: 1,222 modules, 1.8 s).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# While coverage measures (pytest --cov), every interpreter the suite starts, and the pytest workers,
# import other packages with coverage's tracer off (tests/coverage_start/sitecustomize.py)
if os.environ.get("COVERAGE_PROCESS_CONFIG") or os.environ.get("COVERAGE_PROCESS_START"):
    _start = str(Path(__file__).resolve().parent / "coverage_start")
    if _start not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [_start, os.environ.get("PYTHONPATH")])
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    """Collection imports the test modules, and with them torch, transformers, peft...: no garbage to
    speak of, but each full collection on the way walks every object imported so far (a pytest
    process's collection: 11.2-12.1 CPU-s with the collector on, 8.4-9.5 off). Not in pytest-xdist's
    controller, which collects nothing (and so would not turn it on again)."""
    if not session.config.pluginmanager.has_plugin("dsession"):
        gc.disable()


def pytest_collection_modifyitems(config, items):
    """Files with a slow test first, in their order (pytest-xdist's --dist loadfile hands out files in
    this order): a long file that starts late is the suite's tail, one worker busy while the others
    have finished (the cold torch.compile of tests/unit/train/test_setup.py ran the last 50 s alone)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # sort is stable


def pytest_collection_finish(session):
    """What collection imported (torch, transformers: ~300k objects) is not garbage: the collector skips
    it from now on instead of walking all of it at each full collection of the tests' own objects."""
    gc.collect()
    gc.freeze()
    gc.enable()


# a model small enough that 2 CPU processes train it in seconds
TINY = [
    "--hidden-size",
    "32",
    "--attention-heads",
    "2",
    "--layers",
    "2",
    "--max-seq-length",
    "32",
    "--log-interval",
    "1",
    "--set",
    "train.sample_tokens=0",
    "--set",
    "data.num_workers=0",
    "--set",
    "train.plots=false",  # the pictures: drawn by the runs of the tests that look at them
    "--peak-flops",
    "1e12",
]


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    """One token cache for the whole session (keyed by content, so sharing it is safe)."""
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small fixed text corpus: a slice of the standard library's own source, copied once."""
    import sysconfig

    src = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join(
        (src / name).read_text() for name in ("argparse.py", "dataclasses.py", "textwrap.py")
    )
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text[:300_000])
    return path


def lockstep_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lockstep", *map(str, args)]


def run_lockstep(
    *args: str, timeout: float = 300, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`lockstep ARGS` as a user runs it, in a process of its own with the environment, working directory
    and `python -m`'s sys.path a new interpreter would have: a fork of the warm server (start_ranks), whose
    imports are done (3-5 s of every command's start); a new interpreter where `env` sets a variable that a
    library reads when imported (READ_AT_IMPORT). lockstep_cmd is the command itself, for a test that
    starts it with subprocess (signals to the launcher, hand-started ranks).

    Forked only where lockstep's launcher forks its own workers (warm_start.worker_start): with a
    GPU build of torch a fork of the server cannot use CUDA once a preloaded import has touched it
    (the GPU tier on an H100, 27 Nov: every command failed "Cannot re-initialize CUDA in forked
    subprocess"), so there each command is a new interpreter, as a user's is."""
    import multiprocessing

    environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = [str(a) for a in args]
    if not forks_warm(env):
        proc = subprocess.run(
            lockstep_cmd(*argv), capture_output=True, text=True, timeout=timeout, env=environ
        )
        return _checked(proc, argv, check)
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts (1st call)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = multiprocessing.get_context("forkserver").Process(
            target=_forked,
            name="lockstep",
            args=(
                0,
                environ,
                (_Inherited(out.fileno()), _Inherited(err.fileno())),
                _lockstep_main,
                (argv, os.getcwd()),
            ),
        )
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            for pid in [proc.pid, *descendants(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.join()
            raise subprocess.TimeoutExpired(lockstep_cmd(*argv), timeout)
        stdout, stderr = _text(out), _text(err)
    return _checked(
        subprocess.CompletedProcess(lockstep_cmd(*argv), proc.exitcode, stdout, stderr), argv, check
    )


# variables that libraries read once, when imported (huggingface_hub's HF_HUB_CACHE, torch's settings)
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_")


def forks_warm(env: dict | None = None) -> bool:
    """Whether a command is a fork of the warm server (run_lockstep, tests/nodes.py) rather than a
    new interpreter: where lockstep's launcher forks its workers, and `env` sets no variable that the
    server's imports have read with its own value."""
    from lockstep.launch.warm_start import worker_start

    return worker_start() == "warm" and not any(k.startswith(READ_AT_IMPORT) for k in env or {})


def _checked(
    proc: subprocess.CompletedProcess, argv: list[str], check: bool
) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(
            f"lockstep {' '.join(argv)} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n"
            f"STDERR:\n{proc.stderr[-6000:]}"
        )
    return proc


def _text(file) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def _lockstep_main(
    rank: int, argv: list[str], cwd: str
) -> None:  # run through _forked, as a rank is
    os.chdir(cwd)
    # `python -m lockstep` puts the working directory first on sys.path, then PYTHONPATH (a user's module)
    sys.path[:0] = [
        p
        for p in [cwd, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        if p not in sys.path
    ]
    sys.argv = ["lockstep", *argv]
    from lockstep.cli import entry

    entry()  # ends the process with the command's exit code


def run_main(capsys, *args) -> tuple[int, str, str]:
    """`lockstep ARGS` in this process: (exit code, stdout, stderr), argparse's own exits (--help, a bad value) too."""
    from lockstep.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def busy_port() -> tuple[socket.socket, int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


# ---------------------------------------------------------------- real process groups


# What every rank imports before its first line. torch alone takes 3-5 s in a fresh interpreter,
# its compiler stack (which any torch optimizer loads) as much again: a forkserver imports them once
# per session, and each rank is a fork of that warm server, still a process of its own in a real
# gloo group. The imports start no thread (the server has 1: a fork copies no other thread, nor a
# lock one held), and OMP_NUM_THREADS=1 (above) is in the server's environment before torch loads.
# A module missing here is imported by the rank itself. Beside torch: what every training run's
# rank 0 imports at its end (matplotlib for loss.png, tensorboard's writer: 0.6 s), and peft, whose
# import builds transformers' lazy table of models that any Hugging Face model needs (1.3 s).
RANK_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    "torch._dynamo",
    "transformers",
    "peft",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "torch.utils.tensorboard",
    "lockstep.runtime",
    "lockstep.runtime.process_end",
    "lockstep.parallel.ddp",
    "lockstep.train.step",
    "lockstep.train.setup",
    "lockstep.train.run",
    "lockstep.cli",
    "conftest",
]


def start_ranks(fn, *args, nprocs: int = 2) -> None:
    """fn(rank, *args) in `nprocs` real processes, as torch.multiprocessing.start_processes runs
    them (a rank that raises fails the caller with its traceback), each a fork of the warm server.

    fn must be a module-level function (each rank unpickles it by name). As under spawn, a rank
    starts in this process's working directory with its sys.path (multiprocessing sends both), its
    environment, and its standard output and error (sent with it: the server's are those of its
    start), where pytest's capture of the running test sees what a rank prints.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts (1st call)
    streams = (_Inherited(1), _Inherited(2))
    mp.start_processes(
        _forked,
        args=(dict(os.environ), streams, fn, args),
        nprocs=nprocs,
        start_method="forkserver",
    )


class _Inherited:
    """A file descriptor of this process that a rank receives as the same open file (multiprocessing
    sends it with the process): an int there."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _detach, (DupFd(self.fd),)  # DupFd: called while multiprocessing sends the process


def _detach(dup) -> int:
    return dup.detach()


def _forked(rank: int, environ: dict, streams: tuple[int, int], fn, args: tuple) -> None:
    # what this process holds already (the server's imports) is not garbage: the collector skips it
    # from now on instead of walking (and so copying) it at each collection, shutdown_runtime's and
    # exit_process's too (a 2-rank group that does nothing: 12-16 s -> 4 s on the loaded 2 cores)
    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for target, fd in zip((1, 2), streams):
        os.dup2(fd, target)
        os.close(fd)
    fn(rank, *args)


def _rank_main(rank: int, world_size: int, port: int, out: str, fn, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    from lockstep.runtime import Runtime, shutdown_runtime
    from lockstep.runtime.process_end import exit_process

    torch.set_num_threads(1)
    # a rank that waits for a collective its peer never joins raises after the timeout instead of hanging the suite
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    rt = Runtime(
        rank,
        rank,
        world_size,
        world_size,
        0,
        torch.device("cpu"),
        "gloo",
        "test",
        "h",
        control_group=dist.group.WORLD,
    )
    try:
        torch.save(fn(rt, *args), f"{out}.{rank}")
    finally:
        shutdown_runtime(rt)
    # as a lockstep worker ends: a gloo thread still dropping a comm hook's callback would abort the interpreter's
    # finalization (lockstep/runtime/process_end.py; 1 in 20 runs of the powersgd gradients test)
    exit_process(0)


def run_ranks(fn, *args, world_size: int = 2) -> list:
    """fn(rt, *args) on `world_size` real CPU processes joined in one gloo group; each rank's result,
    in rank order.

    fn must be a module-level function (each rank unpickles it by name). A rank that raises fails
    the caller with its traceback; to assert on an error, catch it in fn and return its message.
    The ranks are forks of a warm server (start_ranks).
    """
    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nobody holds it once closed
    with tempfile.TemporaryDirectory(prefix="lockstep-ranks-") as tmp:
        start_ranks(_rank_main, world_size, port, f"{tmp}/result", fn, args, nprocs=world_size)
        return [
            torch.load(f"{tmp}/result.{rank}", weights_only=False) for rank in range(world_size)
        ]


def one_process():
    """The Runtime of a plain single process: no process group, every collective a no-op."""
    import torch

    from lockstep.runtime import Runtime

    return Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "h")


# ---------------------------------------------------------------- the user's own modules and text

_module_ids = itertools.count()


@pytest.fixture
def write_module(tmp_path, monkeypatch):
    """write_module(source) -> a fresh, importable module name (dropped from sys.modules afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(source: str) -> str:
        name = f"lockstep_user_mod_{next(_module_ids)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


SAMPLE = (
    "def add(a, b):\n    return a + b\n\n"
    "Grüße aus Köln, naïve café — 東京 🚀\n"
    "the quick brown fox jumps over the lazy dog\n"
)


def write_corpus(folder: Path, n_files: int = 3, repeat: int = 40) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_files):
        p = folder / f"doc{i}.txt"
        p.write_text(f"# document {i}\n" + SAMPLE * repeat, encoding="utf-8")
        paths.append(p)
    return paths


# a user's module for model.factory / model.loss / import_object tests (write it with the write_module fixture)
USER_MODULE = """
    import torch
    from torch import nn

    VALUE = 3

    def build_model():
        return nn.Linear(4, 2)

    def build_pair():
        return nn.Linear(4, 2), None

    def my_loss(output, batch):
        return output.float().pow(2).mean()

    class Net(nn.Module):
        pass
"""


# batch containers the batch and custom-model tests feed through: a namedtuple, and a dataclass with a non-init field
Pair = namedtuple("Pair", ["features", "name"])


@dataclass
class Batch:
    x: torch.Tensor
    extras: list
    tag: str = "train"
    size: int = field(init=False, default=0)

    def __post_init__(self):
        self.size = len(self.x)
