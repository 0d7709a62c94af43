"""The machine the GPU tier runs on: is there a CUDA device, which one, what the parts will import.

The cheap check reads two facts without importing torch, so a machine without a GPU is told so in
well under 5 seconds; everything else is asked of the Python that will run the parts, in a child
process (`python3 bench/gpu/machine.py`): the parent never holds a CUDA context while tests run.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = Path("/tmp/lockstep-site")  # where --wheels installs; first on PYTHONPATH
VERSIONS = ("transformers", "peft", "bitsandbytes", "pytest", "soundfile")  # recorded in env.json


class NoCuda(Exception):
    """This machine has no usable CUDA device; the message is the one line run.sh prints."""


def no_cuda_reason() -> str | None:
    """Why this machine surely has no NVIDIA GPU, from two cheap facts; None if it may have one."""
    if shutil.which("nvidia-smi") or any(Path("/dev").glob("nvidia[0-9]*")):
        return None
    return "no nvidia-smi on PATH and no /dev/nvidia0"


def part_env(with_site: bool) -> dict[str, str]:
    """The parts' environment: the wheels' folder (if any), then the repository, on PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = ([str(SITE)] if with_site else []) + [str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


def install_wheels(wheel_dir: Path, python: str) -> dict:
    """pip install every wheel of wheel_dir into SITE, offline and without dependencies."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        what = "holds no .whl files" if wheel_dir.is_dir() else "is not a folder"
        raise SystemExit(
            f"run.sh: --wheels {wheel_dir} {what}; download the wheels where a registry is "
            f"reachable with `bash bench/gpu/fetch_wheels.sh {wheel_dir}`, or leave out --wheels"
        )
    # --upgrade: into a --target that exists, pip would skip what is there instead of replacing it
    flags = ["-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade"]
    cmd = [python, "-m", "pip", "install", *flags, "--target", str(SITE), *map(str, wheels)]
    print(f"$ {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-2000:]
        print(
            f"run.sh: installing the wheels failed (exit {proc.returncode}); the parts run without "
            f"what failed:\n{output}",
            flush=True,
        )
    files = [w.name for w in wheels]
    return {"dir": str(wheel_dir), "target": str(SITE), "files": files, "rc": proc.returncode}


def probe() -> dict:
    """The parts' Python: its version, torch's, CUDA's, lockstep's cuda_facts, package versions."""
    import platform
    from importlib import metadata

    out: dict = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            out[name] = metadata.version(name)  # sys.path order: the wheels' folder comes first
        except metadata.PackageNotFoundError:
            out[name] = "-"
    import torch

    out |= {"torch": torch.__version__, "cuda": torch.version.cuda or "-"}
    out["cuda_available"] = torch.cuda.is_available()
    if out["cuda_available"]:
        try:  # lockstep's one place for CUDA device facts
            from lockstep.runtime.cuda import cuda_facts

            out["facts"] = cuda_facts(torch.device("cuda", 0))
        except Exception as e:  # recorded, not fatal: the tests show what is broken
            out["facts"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def nvidia_smi() -> dict:
    """GPU name, driver and memory as nvidia-smi reports them."""
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        proc = subprocess.run(query, capture_output=True, text=True, timeout=30)
        name, driver, memory = (x.strip() for x in proc.stdout.splitlines()[0].split(","))
        return {"gpu": name, "driver": driver, "gpu_memory": memory}
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError) as e:
        return {"gpu": "unknown", "driver": f"unknown ({type(e).__name__} from nvidia-smi)"}


def commit() -> str:
    """The checkout's commit (noting uncommitted changes), else LOCKSTEP_COMMIT, else unknown."""
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode == 0:
            status = [*git, "status", "--porcelain", "--untracked-files=no"]
            dirty = subprocess.run(
                status, capture_output=True, text=True, timeout=30
            ).stdout.strip()
            return head.stdout.strip() + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    given = os.environ.get("LOCKSTEP_COMMIT")  # a copy of the tree without .git (the device tool's)
    return f"{given} (from LOCKSTEP_COMMIT: no git checkout here)" if given else "unknown"


def describe_machine(python: str, wheels: dict | None, command: str) -> dict:
    """env.json's facts, from a child of `python`; raises NoCuda when torch sees no CUDA device."""
    child = [python, str(Path(__file__))]
    proc = subprocess.run(
        child,
        cwd=ROOT,
        env=part_env(wheels is not None),
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise NoCuda(
            f"{python} could not tell whether there is a CUDA device ({tail}); run with the "
            "Python that has torch: LOCKSTEP_PYTHON=/path/to/python3"
        ) from None
    smi = nvidia_smi()
    if not facts["cuda_available"]:
        raise NoCuda(
            f"no CUDA device: torch {facts['torch']} (CUDA {facts['cuda']}) reports "
            f"torch.cuda.is_available() False (nvidia-smi: {smi['gpu']}); nothing was run"
        )
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return {**smi, **facts, "date": date, "commit": commit(), "wheels": wheels, "command": command}


if __name__ == "__main__":
    print(json.dumps(probe()))
    sys.exit(0)
