"""Run by every interpreter the suite starts (tests/conftest.py puts this folder on PYTHONPATH while
coverage measures): one that will import torch imports it before coverage's tracer runs.

coverage.py measures lockstep/ only, but on Python 3.11 its tracer slows every line of every module
while it runs, torch's own import (thousands of modules) included: `import torch, torch._dynamo`
takes 5.1 s, 7.6 s traced (measured here). So a torch-importing interpreter (lockstep, torchrun, the
warm server) pauses coverage, imports torch, and resumes: no line of lockstep runs meanwhile, so
what coverage records is unchanged. An interpreter that does not import torch (warm_client, a
script) is left as it starts.
"""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _cmdline() -> list[str]:
    try:
        return Path("/proc/self/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


# lockstep's commands that load torch and its compiler stack (any torch optimizer loads it); the
# others (`lockstep slurm --dry-run`, `--help`) start without torch, and a test may check that
TORCH_COMMANDS = {"train", "launch", "doctor", "sample", "evaluate", "parity", "export", "merge"}


def _imports(argv: list[str]) -> list[str]:
    if any(a.endswith("torchrun") or a == "torch.distributed.run" for a in argv[:4]):
        return ["torch"]  # the agent: torch.distributed's elastic code, no compiler
    module, command = (
        (argv[argv.index("-m") + 1 : argv.index("-m") + 3] + ["", ""])[:2]
        if "-m" in argv[:3]
        else ("", "")
    )
    if module == "lockstep.launch.warm_start" or (
        module == "lockstep" and command in TORCH_COMMANDS
    ):
        return ["torch", "torch._dynamo"]
    return []


def _preimport() -> None:
    names = _imports(_cmdline())
    if not names:
        return
    import coverage

    cov = coverage.Coverage.current()  # started by coverage's own .pth file, before this one
    if cov is None:
        return
    cov.stop()
    try:
        for name in names:
            __import__(name)
    finally:
        cov.start()


def _chain() -> None:
    """The sitecustomize this one shadows (a distribution's), run as it would have been."""
    here = str(Path(__file__).resolve().parent)
    rest = [p for p in sys.path if p and str(Path(p).resolve()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_preimport()
_chain()
