"""The doctor's report: a `Check` per row, the `Report` every rank builds, the printed table.

The verdicts are in lockstep.doctor.checks (the cluster), lockstep.doctor.device (each rank's
device and matmul peak) and lockstep.doctor.filesystem (the output dir); `where` and `by_value`
group the ranks they name. Every function here is pure (no process group)."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

from lockstep.config import CheckpointConfig
from lockstep.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_OUTPUT_DIR = os.path.dirname(CheckpointConfig().output_dir) or "."
CORRECTNESS_DTYPES = ("float32", "float64", "int64", "bfloat16")
# an odd small size catches chunking off-by-ones; the large one is chunked
CORRECTNESS_NUMEL = (257, 1 << 20)
ENV_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_DISTRIBUTED_DEBUG",
)
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
HANG_FIX = (
    "rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL and look for the first rank that reports "
    "an error; check that NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name an interface that routes between "
    "the hosts; raise --timeout if the network is just slow"
)


class DoctorError(RuntimeError):
    """The doctor could not run its checks at all (e.g. the store is unreachable); the message ends with a fix."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}\n  fix: {fix}")


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail" | "skip"
    detail: str
    fix: str = ""  # always set when status is "fail" or "warn"
    advice: list[str] = field(default_factory=list)  # tips that are not failures

    @property
    def ok(self) -> bool:
        return self.status != "fail"


@dataclass
class Report:
    summary: str
    checks: list[Check]
    ranks: list[dict]
    bandwidth: list[dict]
    rank: int = 0  # the rank that built this copy (every rank builds the same report)
    local_rank: int = 0
    # --config: the all-reduce vs compute estimate (lockstep.doctor.comm_check)
    comm: dict | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict:
        checks = [{**asdict(c), "ok": c.ok} for c in self.checks]
        return {
            "ok": self.ok,
            "summary": self.summary,
            "checks": checks,
            "ranks": self.ranks,
            "bandwidth": self.bandwidth,
            **({"comm": self.comm} if self.comm is not None else {}),
        }


def parse_size(text: str) -> int:
    """'64MiB', '256K', '1GiB', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[m.group(2).upper()] < KiB:
        raise ConfigError(
            f"--max-size {text!r} is not a size of at least 1 KiB; e.g. 64MiB, 256KiB, 1GiB"
        )
    return int(float(m.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[m.group(2).upper()])


def format_size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def bandwidth_sizes(max_bytes: int) -> list[int]:
    sizes, s = [], KiB
    while s < max_bytes:
        sizes.append(s)
        s *= 4
    return sizes + [max_bytes // 4 * 4]  # whole float32 elements


def bus_bandwidth(algbw: float, world_size: int) -> float:
    # nccl-tests' all_reduce bus bandwidth: algbw * 2(n-1)/n, the per-link traffic of a ring all-reduce that
    # makes the number comparable with the hardware's link speed (nccl-tests doc/PERFORMANCE.md, "AllReduce")
    return algbw * 2 * (world_size - 1) / world_size


def span(ranks) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    rs, parts = sorted(set(ranks)), []
    for r in rs:
        if parts and r == parts[-1][1] + 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in parts)
    return f"rank{'s' if len(rs) > 1 else ''} {text}"


def where(facts: list[dict], ranks) -> str:
    """[0, 1, 5] -> 'ranks 0-1 on host a; rank 5 on host b' (facts: one dict per rank, in order)."""
    by_host: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_host.setdefault(facts[r]["host"], []).append(r)
    return "; ".join(f"{span(rs)} on host {h}" for h, rs in by_host.items())


def by_value(facts: list[dict], value) -> dict:
    """{value(f): [ranks with it]}, in the order the values first appear."""
    groups: dict = {}
    for f in facts:
        groups.setdefault(value(f), []).append(f["rank"])
    return groups


# ---- the human report, from `Report.to_dict()` (the launching process renders its workers' JSON) ----


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def fmt(row: list[str]) -> str:
        cells = (
            str(x).rjust(w) if i in right else str(x).ljust(w)
            for i, (x, w) in enumerate(zip(row, widths))
        )
        return "  ".join(cells).rstrip()

    return [fmt(headers), *map(fmt, rows)]


def format_report(report: dict) -> str:
    lines = [f"lockstep doctor: {report['summary']}", ""]
    keys = ["rank", "local_rank", "host", "device", "python", "torch", "lockstep", "cuda", "nccl"]
    lines += _table(keys, [[r[k] for k in keys] for r in report["ranks"]], {0, 1}) + [""]
    width = max(len(c["name"]) for c in report["checks"])
    rows = [
        [c["name"], {"fail": "FAIL"}.get(c["status"], c["status"]), c["detail"]]
        for c in report["checks"]
    ]
    table = _table(["check", "status", "detail"], rows)
    lines.append(table[0])
    for line, c in zip(table[1:], report["checks"]):
        lines.append(line)
        pad = " " * (width + 10)
        lines += [f"{pad}fix: {c['fix']}"] if c["fix"] and c["status"] in ("fail", "warn") else []
        lines += [f"{pad}tip: {tip}" for tip in c["advice"]]
    if report["bandwidth"]:
        lines += [
            "",
            "all_reduce bandwidth (float32 sum; algbw = bytes / time, busbw = algbw * 2(n-1)/n as in "
            "nccl-tests)",
        ]
        lines += _table(
            ["size", "iters", "time (us)", "algbw (GB/s)", "busbw (GB/s)"],
            [
                [
                    b["size"],
                    b["iterations"],
                    f"{b['time_us']:.1f}",
                    f"{b['algbw_gbps']:.3f}",
                    f"{b['busbw_gbps']:.3f}",
                ]
                for b in report["bandwidth"]
            ],
            {0, 1, 2, 3, 4},
        )
    if report.get("comm"):
        lines += _comm_table(report["comm"])
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    warned = sum(c["status"] == "warn" for c in report["checks"])
    verdict = (
        f"FAILED: {len(failed)} of {len(report['checks'])} checks ({', '.join(failed)})"
        if failed
        else f"ok: no check failed ({warned} warning{'s' if warned != 1 else ''})"
    )
    return "\n".join(lines + ["", f"lockstep doctor: {verdict}"])


def _comm_table(comm: dict) -> list[str]:
    lines = [
        "",
        f"communication vs compute ({comm['grad_bytes'] / 1e6:,.3g} MB of gradients per step over "
        f"{comm['world_size']} rank(s), DDP buckets of {format_size(comm['bucket_bytes'])}; no overlap with "
        "backward assumed: an upper bound)",
        f"compute: {comm['compute_s']:.3g} s/step = {comm['compute']}",
    ]
    lines += _table(
        ["setting", "sent/step (MB)", "message", "busbw (GB/s)", "comm (s/step)", "share of step"],
        [
            [
                r["setting"] + (" (set)" if r["setting"] == comm["current"] else ""),
                f"{r['bytes'] / 1e6:,.3g}",
                format_size(r["message_bytes"]),
                f"{r['busbw_gbps']:.3g}",
                f"{r['comm_s']:.3g}",
                f"{100 * r['share']:.0f}%",
            ]
            for r in comm["settings"]
        ],
        {1, 2, 3, 4, 5},
    )
    return lines + [f"recommended: {comm['recommend']}: {comm['reason']}", f"  {comm['fix']}"]
