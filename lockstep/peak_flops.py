"""The matmul peak this process reaches: the MFU denominator, measured once per machine and cached.

Measured rather than looked up: CPUs and BLAS builds vary widely (MKL's fp32 path on AMD reaches well under
half of the hardware peak), and a datasheet number would flatter nobody. A probe costs about 0.6 s before
the first step, so its result is kept in `<cache dir>/peak_flops.json` under a key that names what it
depends on (device model, ISA level, threads, dtype, torch version); every later run on the machine reads
it. `train.peak_flops` overrides both; deleting the file measures again.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lockstep.runtime.cuda import synchronize

CACHE_FILE = "peak_flops.json"


def load_peak_flops(device: torch.device, dtype: torch.dtype, cache_dir: Path) -> float:
    """This process's matmul FLOP/s at its current thread count: from the cache, else measured and cached."""
    key = peak_key(torch.device(device), dtype)
    path = Path(cache_dir) / CACHE_FILE
    cached = _read(path)
    if key in cached:
        return float(cached[key])
    peak = measure_peak_flops(device, dtype)
    _write(path, key, peak)
    return peak


def peak_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a measured peak depends on: the device model, the ISA torch dispatches to, threads, dtype, torch."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        threads = "-"
    else:
        name = cpu_model()
        threads = str(torch.get_num_threads())
    isa = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else "-"
    return f"{device.type}|{name}|{isa}|threads {threads}|{str(dtype).removeprefix('torch.')}|torch {torch.__version__}"


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measure (and rewrite it)
    return data if isinstance(data, dict) else {}


def _write(path: Path, key: str, peak: float) -> None:
    """Add `key` (best effort: an unwritable cache only means measuring again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read(path), key: peak}
        # ranks of one node may write at once
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def probe_size(device: torch.device) -> int:
    """The matmul side the probe uses on `device`.

    An H100 does a 1024^3 product (2.1 GFLOP) in ~3 us, about a kernel launch: timed that way it
    reads far under its ~790 TFLOP/s bf16 peak, and MFU comes out too high. 8192^3 (1.1 TFLOP,
    ~1.4 ms; three 128 MiB bf16 operands) reaches it. CPUs reach theirs at 1024.
    """
    return 8192 if torch.device(device).type == "cuda" else 1024


def measure_peak_flops(
    device: torch.device, dtype: torch.dtype, size: int | None = None, seconds: float = 0.5
) -> float:
    """Matmul FLOP/s this process reaches with its current thread count: `seconds` of size x size
    matmuls (size None: probe_size(device)).

    On CUDA `seconds / 4` of untimed products come first, so that the timing starts with the GPU's
    clocks up; a synchronize ends each batch of timed products.
    """
    device = torch.device(device)
    size = size or probe_size(device)
    cuda = device.type == "cuda"
    sync = functools.partial(synchronize, device)
    # its own generator: drawing from the global one would shift the training RNG (dropout) by where the probe
    # ran, and a resumed run probes at its restart, where the uninterrupted run did not
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    out = torch.empty(size, size, device=device, dtype=dtype)
    # A CPU without native bf16 takes seconds for one bf16 product (~3 s on a 2-core EPYC without AVX-512):
    # there one warm-up, and a check of the clock after every product, keep the probe near `seconds`
    # (BENCHMARKS.md, "Command start").
    per_check = 8 if cuda else 1
    with torch.no_grad():
        # warm-up: BLAS thread pool, kernel selection, CUDA context
        for _ in range(3 if cuda else 1):
            torch.matmul(a, b, out=out)
        if cuda:  # and a GPU's clocks, which take a while to rise from idle
            _timed_products(a, b, out, sync, seconds / 4, per_check)
        sync()
        count, elapsed = _timed_products(a, b, out, sync, seconds, per_check)
    return 2 * size**3 * count / elapsed


def _timed_products(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sync: Callable[[], None],
    seconds: float,
    per_check: int,
) -> tuple[int, float]:
    """(products done, seconds taken): batches of `per_check` products until `seconds` have passed."""
    count, start = 0, time.perf_counter()
    while True:
        # on CUDA several matmuls per check, so that a synchronize does not dominate the timing
        for _ in range(per_check):
            torch.matmul(a, b, out=out)
        count += per_check
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count, elapsed
