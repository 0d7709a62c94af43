"""The doctor's verdicts on the cluster: a `Check` from the facts every rank gathered, with its fix.

`build_checks` is pure (no process group): tests feed it any cluster they describe, one facts
dict per rank in rank order. Each rank's device and matmul peak are judged in
lockstep.doctor.device, the output dir in lockstep.doctor.filesystem.

Thresholds, chosen here: clock skew warns above 1 s and fails above 60 s (per-rank logs and progress
times stop lining up); barrier latency warns above 50 ms.
"""

from __future__ import annotations

import os
import statistics

from lockstep.doctor.device import check_hardware, check_peak
from lockstep.doctor.filesystem import check_disk, check_shared, check_writable
from lockstep.doctor.report import (
    CORRECTNESS_DTYPES,
    CORRECTNESS_NUMEL,
    Check,
    by_value,
    span,
    where,
)
from lockstep.train.links import SLOW_LINK_FIX, slow_links

SKEW_WARN, SKEW_FAIL = 1.0, 60.0
BARRIER_WARN = 0.050


def check_devices(facts: list[dict]) -> Check:
    problems, fixes = [], []
    errs = [f["rank"] for f in facts if f["device_error"]]
    if errs:
        problems.append(f"{where(facts, errs)}: {facts[errs[0]]['device_error'].split(';')[0]}")
        fixes.append(
            "start at most one process per GPU on each node (--nproc = GPU count), or --device cpu"
        )
    for (host, local), ranks in by_value(facts, lambda f: (f["host"], f["local_rank"])).items():
        if len(ranks) > 1:
            problems.append(f"{span(ranks)} on host {host} all have local rank {local}")
            fixes.append(
                "LOCAL_RANK must differ between the ranks of one node: let torchrun / srun set it "
                "(srun: --ntasks-per-node = GPUs per node), do not export it by hand"
            )
    for (host, device_id), ranks in by_value(facts, lambda f: (f["host"], f["device_id"])).items():
        if device_id != "cpu" and len(ranks) > 1:
            names = sorted({facts[r]["device"] for r in ranks})
            problems.append(
                f"{len(ranks)} ranks on one GPU {'/'.join(names)} ({span(ranks)} on host {host})"
            )
            fixes.append("set CUDA_VISIBLE_DEVICES per rank or launch one process per GPU")
    if problems:
        return Check("devices", "fail", "; ".join(problems), "; ".join(dict.fromkeys(fixes)))
    if all(f["device"] == "cpu" for f in facts):
        return Check(
            "devices", "ok", f"cpu on all {len(facts)} rank(s) (CPU only: no GPU to share)"
        )
    per_host = by_value(facts, lambda f: f["host"])
    return Check(
        "devices",
        "ok",
        "one device per rank: "
        + "; ".join(
            f"host {h}: {', '.join(facts[r]['device'] for r in rs)}" for h, rs in per_host.items()
        ),
    )


def check_versions(facts: list[dict]) -> Check:
    diffs = []
    for key in ("python", "torch", "lockstep", "cuda", "nccl"):
        groups = by_value(facts, lambda f: f["versions"][key])
        if len(groups) > 1:
            diffs.append(
                f"{key} differs: "
                + ", ".join(f"{v} on {where(facts, rs)}" for v, rs in groups.items())
            )
    if diffs:
        return Check(
            "versions",
            "fail",
            "; ".join(diffs),
            "install one environment on every node (the same container image or venv, e.g. `pip "
            f"install torch=={facts[0]['versions']['torch']}`): mixed versions fail or hang in "
            "collectives",
        )
    v = facts[0]["versions"]
    return Check(
        "versions",
        "ok",
        f"python {v['python']}, torch {v['torch']}, lockstep {v['lockstep']}, CUDA {v['cuda']}, "
        f"NCCL {v['nccl']} on all {len(facts)} rank(s)",
    )


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
        return Check(
            "all_reduce correctness",
            "fail",
            "; ".join(wrong[:4]),
            "the backend returned wrong sums: check the versions row (mixed NCCL / driver), then "
            "isolate the transport with NCCL_P2P_DISABLE=1 or NCCL_IB_DISABLE=1 and "
            "NCCL_DEBUG=INFO",
        )
    if not good:
        return Check(
            "all_reduce correctness",
            "skip",
            "every dtype was skipped: " + "; ".join(skipped.values()),
        )
    dtypes = ", ".join(d for d in CORRECTNESS_DTYPES if d not in skipped)
    sizes = " and ".join(map(str, CORRECTNESS_NUMEL))
    detail = f"exact sums on all ranks for {dtypes} at {sizes} elements"
    return Check(
        "all_reduce correctness",
        "ok",
        detail + "".join(f"; {d} skipped: {why}" for d, why in skipped.items()),
    )


def check_bandwidth(bandwidth: list[dict], world_size: int) -> Check:
    if not bandwidth:  # the 1-rank group failed before measuring: the process group row says why
        return Check("all_reduce bandwidth", "skip", "not measured")
    top = bandwidth[-1]
    if world_size == 1:
        return Check(
            "all_reduce bandwidth",
            "ok",
            f"algbw {top['algbw_gbps']:.2f} GB/s at {top['size']} on 1 rank: its all_reduce "
            "crosses no link, so this times the collective's launch path, not a link (busbw = "
            "algbw x 2(n-1)/n is 0; table below)",
        )
    return Check(
        "all_reduce bandwidth",
        "ok",
        f"busbw {top['busbw_gbps']:.2f} GB/s, algbw {top['algbw_gbps']:.2f} GB/s at {top['size']} "
        f"across {world_size} ranks (table below)",
    )


def check_ring(facts: list[dict]) -> Check:
    bad = [f["rank"] for f in facts if not f["ring"]["ok"]]
    if bad:
        pairs = ", ".join(f"{facts[r]['ring']['from']} -> {r}" for r in bad)
        return Check(
            "p2p ring",
            "fail",
            f"wrong payload received on {pairs} (sender -> receiver)",
            "point-to-point between those ranks is broken: try NCCL_P2P_DISABLE=1 to rule out GPU "
            "peer copies, and check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name a routable "
            "interface",
        )
    slow = slow_links(facts)
    if slow:
        return Check("p2p ring", "warn", "; ".join(line for _, line in slow), SLOW_LINK_FIX)
    slowest = max(f["ring"]["seconds"] for f in facts)
    return Check(
        "p2p ring",
        "ok",
        f"every rank sent 512 KiB to rank+1 and got rank-1's intact (slowest {slowest * 1e3:.1f} "
        "ms)",
    )


def check_barrier(facts: list[dict]) -> Check:
    times = [t for f in facts for t in f["barrier"]]
    med = statistics.median(times)
    detail = (
        f"median {med * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms over "
        f"{len(facts[0]['barrier'])} barriers"
    )
    if med > BARRIER_WARN:
        return Check(
            "barrier latency",
            "warn",
            detail,
            "a slow control path: check that GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick the "
            "fast interface, not a management network",
        )
    return Check("barrier latency", "ok", detail)


def check_clock(facts: list[dict]) -> Check:
    rounds = len(facts[0]["clock"])
    # after a barrier every rank reads its clock; the spread is skew plus how far apart the
    # barrier released the ranks
    best = min(
        range(rounds),
        key=lambda i: max(f["clock"][i] for f in facts) - min(f["clock"][i] for f in facts),
    )
    hi = max(facts, key=lambda f: f["clock"][best])
    lo = min(facts, key=lambda f: f["clock"][best])
    noise = statistics.median([t for f in facts for t in f["barrier"]])
    spread = hi["clock"][best] - lo["clock"][best]
    skew = max(0.0, spread - noise)
    detail = (
        f"rank {hi['rank']} ({hi['host']}) is {skew:.3f} s ahead of rank {lo['rank']} "
        f"({lo['host']}) (barrier latency {noise * 1e3:.2f} ms subtracted)"
        if skew > 0
        else f"clocks agree: {spread * 1e3:.2f} ms apart after a barrier, within its latency "
        f"({noise * 1e3:.2f} ms)"
    )
    fix = (
        "synchronise the clocks of every node (chrony / ntpd): per-rank logs and progress times "
        "are compared"
    )
    if skew > SKEW_FAIL:
        return Check("clock skew", "fail", detail, fix)
    return (
        Check("clock skew", "warn", detail, fix)
        if skew > SKEW_WARN
        else Check("clock skew", "ok", detail)
    )


def check_env(facts: list[dict]) -> Check:
    keys = sorted(set().union(*(f["env"] for f in facts)))
    detail = (
        ", ".join(f"{k}={facts[0]['env'].get(k, '<unset>')}" for k in keys)
        or "none of the variables below set"
    )
    warns, tips = [], []

    def anywhere(key, pred=lambda v: v not in ("", "0")):
        return [f["rank"] for f in facts if key in f["env"] and pred(f["env"][key])]

    for key, what in (
        ("NCCL_P2P_DISABLE", "direct GPU-to-GPU copies"),
        ("NCCL_IB_DISABLE", "InfiniBand"),
    ):
        if anywhere(key):
            warns.append(
                f"{key}=1 turns off {what} ({span(anywhere(key))}): unset it unless you are "
                "isolating a hang, bandwidth drops several-fold"
            )
    if anywhere("TORCH_NCCL_ASYNC_ERROR_HANDLING", lambda v: v == "0"):
        warns.append(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 leaves the other ranks hanging when one fails: "
            "unset it"
        )
    if anywhere("TORCH_NCCL_BLOCKING_WAIT"):
        tips.append(
            "TORCH_NCCL_BLOCKING_WAIT=1 makes every collective block the CPU: only for debugging"
        )
    for k in keys:
        values = by_value(facts, lambda f: f["env"].get(k, "<unset>"))
        if len(values) > 1 and k not in (
            "CUDA_VISIBLE_DEVICES",
            "NCCL_SOCKET_IFNAME",
            "GLOO_SOCKET_IFNAME",
        ):
            tips.append(
                f"{k} differs: " + ", ".join(f"{v} on {span(rs)}" for v, rs in values.items())
            )
    crowded = max(f["local_world_size"] for f in facts)
    if crowded > 1 and anywhere("OMP_NUM_THREADS", lambda v: True) != [f["rank"] for f in facts]:
        tips.append(
            f"OMP_NUM_THREADS is unset with {crowded} processes per node: lockstep sets torch's "
            f"threads to cores / {crowded}, but data workers and other libraries take every core; "
            f"export OMP_NUM_THREADS={max(1, (os.cpu_count() or 1) // crowded)}"
        )
    if len({f["host"] for f in facts}) > 1 and not anywhere("GLOO_SOCKET_IFNAME", lambda v: True):
        tips.append(
            "several hosts and GLOO_SOCKET_IFNAME unset: if rendezvous or gloo hangs, set it (and "
            "NCCL_SOCKET_IFNAME) to the interface that routes between the nodes"
        )
    if anywhere("NCCL_DEBUG", lambda v: v.upper() in ("INFO", "TRACE")):
        tips.append("NCCL_DEBUG=INFO logs every connection: unset it for long runs")
    elif not anywhere("NCCL_DEBUG", lambda v: True):
        tips.append(
            "for a hang or NCCL error report, rerun with NCCL_DEBUG=INFO "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL"
        )
    return Check("environment", "warn" if warns else "ok", detail, "; ".join(warns), tips)


def check_group(facts: list[dict], backend: str | None) -> Check:
    n = len(facts)
    if n > 1:
        hosts = len({f["host"] for f in facts})
        return Check("process group", "ok", f"{backend}: {n} ranks on {hosts} host(s) joined")
    tip = "check N ranks with `lockstep doctor --nproc N`, or run it under torchrun / srun"
    rest = "ring, barrier, clock and shared-filesystem checks need several"
    if facts[0].get("group_error"):
        return Check(
            "process group",
            "fail",
            f"one process: a 1-rank {backend} group on {facts[0]['device']} could not run: "
            f"{facts[0]['group_error']}",
            f"{backend} cannot start on this device, and training on several GPUs needs it: rerun "
            "with NCCL_DEBUG=INFO for its reason; check that the driver (`nvidia-smi`) supports "
            f"torch's CUDA {facts[0]['versions']['cuda']} and that this torch build has NCCL "
            "(torch.cuda.nccl.version())",
            [tip],
        )
    if "all_reduce" in facts[0]:
        return Check(
            "process group",
            "ok",
            f"one process: a 1-rank {backend} group on {facts[0]['device']} ran the all_reduce "
            f"checks; {rest}",
            advice=[tip],
        )
    return Check(
        "process group", "skip", f"one process: all_reduce, bandwidth, {rest}", advice=[tip]
    )


def build_checks(
    facts: list[dict], bandwidth: list[dict], out: str, backend: str | None
) -> list[Check]:
    """The rows, in the report's order. With one rank, `backend` is the 1-rank group the doctor
    formed for the all_reduce checks (nccl on a GPU; None: none), facts[0]["group_error"] why it
    failed."""
    n = len(facts)
    checks = [check_group(facts, backend), check_devices(facts), check_hardware(facts)]
    checks += [check_peak(facts), check_versions(facts)]
    if n > 1 or "all_reduce" in facts[0]:
        checks += [check_all_reduce(facts), check_bandwidth(bandwidth, n)]
    if n > 1:
        checks += [check_ring(facts), check_barrier(facts), check_clock(facts)]
    checks += [check_writable(facts, out)]
    if n > 1:
        checks.append(check_shared(facts, out))
    return checks + [check_disk(facts), check_env(facts)]
