"""The two sides of bench/gpu/gpt2.py: their commands, one run of either, its result read back.

The raw loop reports its own tokens/s and peak memory (bench/raw_loop.py --out). lockstep's side is
read from its metrics.jsonl as bench/bench_train.py reads it: the `time` field of the train
records at steps `warmup` and `steps`, and the largest logged `peak_mem_mb` (on CUDA
torch.cuda.max_memory_allocated, as the raw loop reports it).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAW_LOOP = ROOT / "bench" / "raw_loop.py"


@dataclass(frozen=True)
class Sides:
    """What both sides train with: the same model, batch, steps, precision and device."""

    device: str  # cuda | cpu
    precision: str  # bf16 | fp32
    shape: dict[str, int]  # ModelConfig fields: vocab_size, hidden_size, layers, ...
    global_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per forward; global / micro accumulation steps
    steps: int  # optimizer steps per run
    warmup: int  # steps before the timed region (compile included)
    log_interval: int
    peak_flops: float  # measured by gpt2.py; lockstep gets it so that it does not probe again

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.shape["max_seq_length"]

    def raw_command(self, compiled: bool, out: str) -> list[str]:
        flags = _flags(
            {
                "device": self.device,
                "precision": self.precision,
                "batch_size": self.global_batch,
                "micro_batch": self.micro_batch,
                "steps": self.steps,
                "warmup": self.warmup,
                "log_interval": self.log_interval,
                "out": out,
                **self.shape,
            }
        )
        return [sys.executable, str(RAW_LOOP), *flags] + (["--compile"] if compiled else [])

    def lockstep_command(self, compiled: bool, run_dir: str) -> list[str]:
        flags = _flags(
            {
                "device": self.device,
                "world_size": 1,
                "mixed_precision": "bf16" if self.precision == "bf16" else "no",
                "global_batch_size": self.global_batch,
                "micro_batch_size": self.micro_batch,
                "max_steps": self.steps,
                "log_interval": self.log_interval,
                "eval_fraction": 0,  # no held-out windows: nothing but training steps
                "eval_interval": 0,
                "save_interval": 0,  # one checkpoint, at the end: after the last timed log point
                "resume": "none",
                "output_dir": run_dir,
                "peak_flops": f"{self.peak_flops:.6g}",
                **self.shape,
            }
        )
        cmd = [sys.executable, "-m", "lockstep", "train", *flags, "--set", "train.sample_tokens=0"]
        return cmd + (["--compile"] if compiled else [])

    @staticmethod
    def allocator() -> str:
        """The allocator setting both sides run with."""
        env = child_env()
        found = [
            f"{k}={env[k]}" for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if k in env
        ]
        return ", ".join(found)

    def shown(self) -> dict[str, str]:
        """Both commands as a reader would type them (the compile flag marked optional)."""
        raw = self.raw_command(False, "RAW.json")[1:]
        raw[0] = str(RAW_LOOP.relative_to(ROOT))
        lockstep = self.lockstep_command(False, "RUN_DIR")[1:]
        return {
            "raw": f"python3 {shlex.join(raw)} [--compile]",
            "lockstep": f"python3 {shlex.join(lockstep)} [--compile]",
        }

    def run(self, impl: str, compiled: bool, timeout: float) -> dict:
        """One process of one side: tokens/s, peak memory and last loss, or why there are none."""
        start = time.monotonic()
        result: dict = {"impl": impl, "compile": compiled, "status": "ok"}
        with tempfile.TemporaryDirectory(prefix="gpt2_bench.") as tmp:
            try:
                if impl == "raw":
                    out = Path(tmp) / "raw.json"
                    run_once(self.raw_command(compiled, str(out)), timeout)
                    raw = json.loads(out.read_text())
                    result |= {k: raw[k] for k in ("tokens_per_s", "peak_mem_mb", "last_loss")}
                else:
                    run_dir = Path(tmp) / "run"  # its end-of-run checkpoint (~1.5 GB) goes with tmp
                    run_once(self.lockstep_command(compiled, str(run_dir)), timeout)
                    result |= self.lockstep_result(run_dir)
            except subprocess.TimeoutExpired:
                result["status"] = f"stopped after {timeout:.0f} s"
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                result["status"] = f"failed: {str(e).splitlines()[0][:200]}"
                print(f"{impl} compile={compiled}: {e}", flush=True)
        result["wall_s"] = time.monotonic() - start
        return result

    def lockstep_result(self, run_dir: Path) -> dict:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        train = [r for r in map(json.loads, filter(str.strip, lines)) if r.get("split") == "train"]
        times = {r["step"]: r["time"] for r in train}
        if self.warmup not in times or self.steps not in times:
            raise RuntimeError(
                f"{run_dir}/metrics.jsonl has no train records at steps {self.warmup} "
                f"and {self.steps}"
            )
        elapsed = times[self.steps] - times[self.warmup]
        mem = [r["peak_mem_mb"] for r in train if "peak_mem_mb" in r]
        return {
            "tokens_per_s": (self.steps - self.warmup) * self.tokens_per_step / elapsed,
            # on a CPU peak_mem_mb is the process's resident set, not comparable to the raw loop's
            "peak_mem_mb": max(mem) if mem and self.device == "cuda" else None,
            "last_loss": train[-1]["loss"],
        }


def _flags(values: dict) -> list[str]:
    """["--batch-size", "32", ...] from {"batch_size": 32, ...}."""
    return [x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))]


# lockstep starts CUDA processes with this allocator setting unless the user chose one
# (lockstep.runtime.cuda); the raw loop gets it too, so that both sides allocate alike
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def child_env() -> dict[str, str]:
    """Ours, with the repository on PYTHONPATH and lockstep's allocator setting (unless one is set).
    Unlike bench_train.py's, an inherited OMP_NUM_THREADS is kept: a GPU run does not depend on it,
    and the CPU smoke run (--quick, under pytest's OMP_NUM_THREADS=1) shares 2 cores."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not any(k in env for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        env[ALLOC_CONF[0]] = ALLOC_CONF[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_once(cmd: list[str], timeout: float) -> None:
    """Run one side's process; its output goes to ours as it comes (run.sh keeps it: bench.log)."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode} (its output is above)")
