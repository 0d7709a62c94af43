"""The doctor's verdicts: thresholds, checks built from the gathered facts, and the printed report.

Every function here is pure (no process group): tests feed `build_checks` any cluster they describe."""

from __future__ import annotations

import errno
import os
import re
import statistics
from dataclasses import asdict, dataclass, field

from lockstep.config import CheckpointConfig
from lockstep.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_OUTPUT_DIR = os.path.dirname(CheckpointConfig().output_dir) or "."
DISK_WARN, DISK_FAIL = 5 * GiB, 1 * GiB
SKEW_WARN, SKEW_FAIL = 1.0, 60.0
BARRIER_WARN = 0.050
CORRECTNESS_DTYPES = ("float32", "float64", "int64", "bfloat16")
CORRECTNESS_NUMEL = (257, 1 << 20)  # an odd small size catches chunking off-by-ones; the large one is chunked
ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_DEBUG",
            "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_DISTRIBUTED_DEBUG")
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
HANG_FIX = ("rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL and look for the first rank that reports "
            "an error; check that NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name an interface that routes between "
            "the hosts; raise --timeout if the network is just slow")


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
    comm: dict | None = None  # --config: the all-reduce vs compute estimate (lockstep.doctor.comm_check)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict:
        checks = [{**asdict(c), "ok": c.ok} for c in self.checks]
        return {"ok": self.ok, "summary": self.summary, "checks": checks, "ranks": self.ranks,
                "bandwidth": self.bandwidth, **({"comm": self.comm} if self.comm is not None else {})}


def parse_size(text: str) -> int:
    """'64MiB', '256K', '1GiB', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[m.group(2).upper()] < KiB:
        raise ConfigError(f"--max-size {text!r} is not a size of at least 1 KiB; e.g. 64MiB, 256KiB, 1GiB")
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


# ---- checks: pure functions of the gathered facts (one dict per rank, in rank order) ----

def _where(facts: list[dict], ranks) -> str:
    by_host: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_host.setdefault(facts[r]["host"], []).append(r)
    return "; ".join(f"{span(rs)} on host {h}" for h, rs in by_host.items())


def _by_value(facts: list[dict], value) -> dict:
    groups: dict = {}
    for f in facts:
        groups.setdefault(value(f), []).append(f["rank"])
    return groups


def check_devices(facts: list[dict]) -> Check:
    problems, fixes = [], []
    errs = [f["rank"] for f in facts if f["device_error"]]
    if errs:
        problems.append(f"{_where(facts, errs)}: {facts[errs[0]]['device_error'].split(';')[0]}")
        fixes.append("start at most one process per GPU on each node (--nproc = GPU count), or --device cpu")
    for (host, local), ranks in _by_value(facts, lambda f: (f["host"], f["local_rank"])).items():
        if len(ranks) > 1:
            problems.append(f"{span(ranks)} on host {host} all have local rank {local}")
            fixes.append("LOCAL_RANK must differ between the ranks of one node: let torchrun / srun set it "
                         "(srun: --ntasks-per-node = GPUs per node), do not export it by hand")
    for (host, device_id), ranks in _by_value(facts, lambda f: (f["host"], f["device_id"])).items():
        if device_id != "cpu" and len(ranks) > 1:
            names = sorted({facts[r]["device"] for r in ranks})
            problems.append(f"{len(ranks)} ranks on one GPU {'/'.join(names)} ({span(ranks)} on host {host})")
            fixes.append("set CUDA_VISIBLE_DEVICES per rank or launch one process per GPU")
    if problems:
        return Check("devices", "fail", "; ".join(problems), "; ".join(dict.fromkeys(fixes)))
    if all(f["device"] == "cpu" for f in facts):
        return Check("devices", "ok", f"cpu on all {len(facts)} rank(s) (CPU only: no GPU to share)")
    per_host = _by_value(facts, lambda f: f["host"])
    return Check("devices", "ok", "one device per rank: " + "; ".join(
        f"host {h}: {', '.join(facts[r]['device'] for r in rs)}" for h, rs in per_host.items()))


def check_versions(facts: list[dict]) -> Check:
    diffs = []
    for key in ("python", "torch", "lockstep", "cuda", "nccl"):
        groups = _by_value(facts, lambda f: f["versions"][key])
        if len(groups) > 1:
            diffs.append(f"{key} differs: " + ", ".join(f"{v} on {_where(facts, rs)}" for v, rs in groups.items()))
    if diffs:
        return Check("versions", "fail", "; ".join(diffs),
                     "install one environment on every node (the same container image or venv, e.g. `pip install "
                     f"torch=={facts[0]['versions']['torch']}`): mixed versions fail or hang in collectives")
    v = facts[0]["versions"]
    return Check("versions", "ok", f"python {v['python']}, torch {v['torch']}, lockstep {v['lockstep']}, "
                 f"CUDA {v['cuda']}, NCCL {v['nccl']} on all {len(facts)} rank(s)")


def check_all_reduce(facts: list[dict]) -> Check:
    wrong, skipped, good = [], {}, set()
    for f in facts:
        for key, result in f["all_reduce"].items():
            if result.startswith("wrong"):
                wrong.append(f"{key} on rank {f['rank']}: {result}")
            elif result.startswith("skip"):
                skipped.setdefault(key.split()[0], result[6:])
            else:
                good.add(key)
    if wrong:
        return Check("all_reduce correctness", "fail", "; ".join(wrong[:4]),
                     "the backend returned wrong sums: check the versions row (mixed NCCL / driver), then isolate the "
                     "transport with NCCL_P2P_DISABLE=1 or NCCL_IB_DISABLE=1 and NCCL_DEBUG=INFO")
    if not good:
        return Check("all_reduce correctness", "skip", "every dtype was skipped: " + "; ".join(skipped.values()))
    dtypes = ", ".join(d for d in CORRECTNESS_DTYPES if d not in skipped)
    detail = f"exact sums on all ranks for {dtypes} at {' and '.join(map(str, CORRECTNESS_NUMEL))} elements"
    return Check("all_reduce correctness", "ok",
                 detail + "".join(f"; {d} skipped: {why}" for d, why in skipped.items()))


def check_bandwidth(bandwidth: list[dict], world_size: int) -> Check:
    top = bandwidth[-1]
    return Check("all_reduce bandwidth", "ok", f"busbw {top['busbw_gbps']:.2f} GB/s, algbw {top['algbw_gbps']:.2f} "
                 f"GB/s at {top['size']} across {world_size} ranks (table below)")


def check_ring(facts: list[dict]) -> Check:
    bad = [f["rank"] for f in facts if not f["ring"]["ok"]]
    if bad:
        pairs = ", ".join(f"{facts[r]['ring']['from']} -> {r}" for r in bad)
        return Check("p2p ring", "fail", f"wrong payload received on {pairs} (sender -> receiver)",
                     "point-to-point between those ranks is broken: try NCCL_P2P_DISABLE=1 to rule out GPU peer "
                     "copies, and check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name a routable interface")
    slowest = max(f["ring"]["seconds"] for f in facts)
    return Check("p2p ring", "ok", f"every rank sent 512 KiB to rank+1 and got rank-1's intact "
                 f"(slowest {slowest * 1e3:.1f} ms)")


def check_barrier(facts: list[dict]) -> Check:
    times = [t for f in facts for t in f["barrier"]]
    med = statistics.median(times)
    detail = f"median {med * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms over {len(facts[0]['barrier'])} barriers"
    if med > BARRIER_WARN:
        return Check("barrier latency", "warn", detail, "a slow control path: check that GLOO_SOCKET_IFNAME / "
                     "NCCL_SOCKET_IFNAME pick the fast interface, not a management network")
    return Check("barrier latency", "ok", detail)


def check_clock(facts: list[dict]) -> Check:
    rounds = len(facts[0]["clock"])
    # after a barrier every rank reads its clock; the spread is skew plus the barrier's release spread
    best = min(range(rounds), key=lambda i: max(f["clock"][i] for f in facts) - min(f["clock"][i] for f in facts))
    hi = max(facts, key=lambda f: f["clock"][best])
    lo = min(facts, key=lambda f: f["clock"][best])
    noise = statistics.median([t for f in facts for t in f["barrier"]])
    spread = hi["clock"][best] - lo["clock"][best]
    skew = max(0.0, spread - noise)
    detail = (f"rank {hi['rank']} ({hi['host']}) is {skew:.3f} s ahead of rank {lo['rank']} ({lo['host']}) "
              f"(barrier latency {noise * 1e3:.2f} ms subtracted)" if skew > 0 else
              f"clocks agree: {spread * 1e3:.2f} ms apart after a barrier, within its latency ({noise * 1e3:.2f} ms)")
    fix = "synchronise the clocks of every node (chrony / ntpd): per-rank logs and progress times are compared"
    if skew > SKEW_FAIL:
        return Check("clock skew", "fail", detail, fix)
    return Check("clock skew", "warn", detail, fix) if skew > SKEW_WARN else Check("clock skew", "ok", detail)


def check_writable(facts: list[dict], out: str) -> Check:
    errs = [f["rank"] for f in facts if f["fs"]["error"]]
    if errs:
        fs = facts[errs[0]]["fs"]
        why = {errno.ENOTDIR: f"{fs['disk_path']} is a file, not a directory",
               errno.EACCES: f"fix the permissions of {fs['disk_path']} for this user",
               errno.EPERM: f"fix the permissions of {fs['disk_path']} for this user",
               errno.EROFS: f"{fs['disk_path']} is on a read-only filesystem",
               errno.ENOSPC: f"the filesystem of {fs['disk_path']} is full"}.get(fs["errno"], fs["error"])
        return Check("output dir writable", "fail", f"{out} cannot be written on {_where(facts, errs)}: {fs['error']}",
                     f"pass --output-dir a directory every rank can create and write (the same as `lockstep train "
                     f"--output-dir`); here {why}")
    return Check("output dir writable", "ok", f"every rank wrote and fsynced a marker in {out}/.doctor")


def check_shared(facts: list[dict], out: str) -> Check:
    ok_ranks = [f["rank"] for f in facts if not f["fs"]["error"]]
    if len(ok_ranks) < 2:
        return Check("shared filesystem", "skip", "fewer than 2 ranks could write a marker")
    groups = _by_value([facts[r] for r in ok_ranks], lambda f: tuple(f["fs"]["seen"]))
    if len(groups) == 1 and list(next(iter(groups))) == ok_ranks:
        return Check("shared filesystem", "ok", f"{span(ok_ranks)} share {out} (each sees every marker)")
    parts = []
    for seen, ranks in groups.items():
        if list(seen) == ranks == [ranks[0]]:
            parts.append(f"rank {ranks[0]} (host {facts[ranks[0]]['host']}) sees no other rank's marker: not shared")
        else:
            parts.append(f"{_where(facts, ranks)} see the markers of {span(seen)}")
    return Check("shared filesystem", "warn", "; ".join(parts),
                 "rank 0 alone writes checkpoints and every rank reads them on resume: put --output-dir on a "
                 "filesystem every node mounts at the same path (NFS, Lustre, ...)")


def check_disk(facts: list[dict]) -> Check:
    low = min(facts, key=lambda f: f["fs"]["free_bytes"])
    free, path = low["fs"]["free_bytes"], low["fs"]["disk_path"]
    detail = f"{format_size(free)} free on {path} (lowest, rank {low['rank']} on host {low['host']})"
    fix = (f"free space on {path} or point --output-dir at a larger filesystem: one checkpoint of a "
           "1B-parameter model with Adam state takes ~16 GB")
    if free < DISK_FAIL:
        return Check("free disk", "fail", detail + f"; below {format_size(DISK_FAIL)}", fix)
    if free < DISK_WARN:
        return Check("free disk", "warn", detail + f"; below {format_size(DISK_WARN)}", fix)
    return Check("free disk", "ok", detail)


def check_env(facts: list[dict]) -> Check:
    keys = sorted(set().union(*(f["env"] for f in facts)))
    detail = ", ".join(f"{k}={facts[0]['env'].get(k, '<unset>')}" for k in keys) or "none of the variables below set"
    warns, tips = [], []

    def anywhere(key, pred=lambda v: v not in ("", "0")):
        return [f["rank"] for f in facts if key in f["env"] and pred(f["env"][key])]
    for key, what in (("NCCL_P2P_DISABLE", "direct GPU-to-GPU copies"), ("NCCL_IB_DISABLE", "InfiniBand")):
        if anywhere(key):
            warns.append(f"{key}=1 turns off {what} ({span(anywhere(key))}): unset it unless you are isolating a "
                         "hang, bandwidth drops several-fold")
    if anywhere("TORCH_NCCL_ASYNC_ERROR_HANDLING", lambda v: v == "0"):
        warns.append("TORCH_NCCL_ASYNC_ERROR_HANDLING=0 leaves the other ranks hanging when one fails: unset it")
    if anywhere("TORCH_NCCL_BLOCKING_WAIT"):
        tips.append("TORCH_NCCL_BLOCKING_WAIT=1 makes every collective block the CPU: only for debugging")
    for k in keys:
        values = _by_value(facts, lambda f: f["env"].get(k, "<unset>"))
        if len(values) > 1 and k not in ("CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            tips.append(f"{k} differs: " + ", ".join(f"{v} on {span(rs)}" for v, rs in values.items()))
    crowded = max(f["local_world_size"] for f in facts)
    if crowded > 1 and anywhere("OMP_NUM_THREADS", lambda v: True) != [f["rank"] for f in facts]:
        tips.append(f"OMP_NUM_THREADS is unset with {crowded} processes per node: lockstep sets torch's threads to "
                    f"cores / {crowded}, but data workers and other libraries take every core; export "
                    f"OMP_NUM_THREADS={max(1, (os.cpu_count() or 1) // crowded)}")
    if len({f["host"] for f in facts}) > 1 and not anywhere("GLOO_SOCKET_IFNAME", lambda v: True):
        tips.append("several hosts and GLOO_SOCKET_IFNAME unset: if rendezvous or gloo hangs, set it (and "
                    "NCCL_SOCKET_IFNAME) to the interface that routes between the nodes")
    if anywhere("NCCL_DEBUG", lambda v: v.upper() in ("INFO", "TRACE")):
        tips.append("NCCL_DEBUG=INFO logs every connection: unset it for long runs")
    elif not anywhere("NCCL_DEBUG", lambda v: True):
        tips.append("for a hang or NCCL error report, rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL")
    return Check("environment", "warn" if warns else "ok", detail, "; ".join(warns), tips)


def build_checks(facts: list[dict], bandwidth: list[dict], out: str, backend: str | None) -> list[Check]:
    n = len(facts)
    if n == 1:
        tip = "check N ranks with `lockstep doctor --nproc N`, or run it under torchrun / srun"
        checks = [Check("process group", "skip", "one process: all_reduce, bandwidth, ring, barrier, clock and "
                        "shared-filesystem checks need several", advice=[tip])]
    else:
        hosts = len({f["host"] for f in facts})
        checks = [Check("process group", "ok", f"{backend}: {n} ranks on {hosts} host(s) joined")]
    checks += [check_devices(facts), check_versions(facts)]
    if n > 1:
        checks += [check_all_reduce(facts), check_bandwidth(bandwidth, n), check_ring(facts), check_barrier(facts),
                   check_clock(facts)]
    checks += [check_writable(facts, out)]
    if n > 1:
        checks.append(check_shared(facts, out))
    return checks + [check_disk(facts), check_env(facts)]


# ---- the human report, from `Report.to_dict()` (the launching process renders its workers' JSON) ----

def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = lambda row: "  ".join(str(x).rjust(w) if i in right else str(x).ljust(w)  # noqa: E731
                                for i, (x, w) in enumerate(zip(row, widths))).rstrip()
    return [fmt(headers), *map(fmt, rows)]


def format_report(report: dict) -> str:
    lines = [f"lockstep doctor: {report['summary']}", ""]
    keys = ["rank", "local_rank", "host", "device", "python", "torch", "lockstep", "cuda", "nccl"]
    lines += _table(keys, [[r[k] for k in keys] for r in report["ranks"]], {0, 1}) + [""]
    width = max(len(c["name"]) for c in report["checks"])
    rows = [[c["name"], {"fail": "FAIL"}.get(c["status"], c["status"]), c["detail"]] for c in report["checks"]]
    table = _table(["check", "status", "detail"], rows)
    lines.append(table[0])
    for line, c in zip(table[1:], report["checks"]):
        lines.append(line)
        pad = " " * (width + 10)
        lines += [f"{pad}fix: {c['fix']}"] if c["fix"] and c["status"] in ("fail", "warn") else []
        lines += [f"{pad}tip: {tip}" for tip in c["advice"]]
    if report["bandwidth"]:
        lines += ["", "all_reduce bandwidth (float32 sum; algbw = bytes / time, busbw = algbw * 2(n-1)/n as in "
                  "nccl-tests)"]
        lines += _table(["size", "iters", "time (us)", "algbw (GB/s)", "busbw (GB/s)"],
                        [[b["size"], b["iterations"], f"{b['time_us']:.1f}", f"{b['algbw_gbps']:.3f}",
                          f"{b['busbw_gbps']:.3f}"] for b in report["bandwidth"]], {0, 1, 2, 3, 4})
    if report.get("comm"):
        lines += _comm_table(report["comm"])
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    warned = sum(c["status"] == "warn" for c in report["checks"])
    verdict = (f"FAILED: {len(failed)} of {len(report['checks'])} checks ({', '.join(failed)})" if failed else
               f"ok: no check failed ({warned} warning{'s' if warned != 1 else ''})")
    return "\n".join(lines + ["", f"lockstep doctor: {verdict}"])


def _comm_table(comm: dict) -> list[str]:
    lines = ["", f"communication vs compute ({comm['grad_bytes'] / 1e6:,.3g} MB of gradients per step over "
             f"{comm['world_size']} rank(s), DDP buckets of {format_size(comm['bucket_bytes'])}; no overlap with "
             "backward assumed: an upper bound)", f"compute: {comm['compute_s']:.3g} s/step = {comm['compute']}"]
    lines += _table(["setting", "sent/step (MB)", "message", "busbw (GB/s)", "comm (s/step)", "share of step"],
                    [[r["setting"] + (" (set)" if r["setting"] == comm["current"] else ""), f"{r['bytes'] / 1e6:,.3g}",
                      format_size(r["message_bytes"]), f"{r['busbw_gbps']:.3g}", f"{r['comm_s']:.3g}",
                      f"{100 * r['share']:.0f}%"] for r in comm["settings"]], {1, 2, 3, 4, 5})
    return lines + [f"recommended: {comm['recommend']}: {comm['reason']}", f"  {comm['fix']}"]
