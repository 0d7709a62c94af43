"""Device profiles for `lockstep plan`: what one device holds and computes, and its links.

    load_profile(NAME | FILE.yaml | FILE.json)   a built-in profile, one's values from a YAML file,
                                                 or what `lockstep doctor --json` measured

Built-in profiles come from NVIDIA's datasheets (SXM boards): dense BF16 tensor-core TFLOP/s (the
datasheets print the 2:4-sparse figure, twice these; lockstep.doctor.device.DATASHEET_BF16 holds
the same numbers for the doctor), NVLink bandwidth per GPU in one direction (half the datasheet's
bidirectional figure), and one InfiniBand NIC per GPU at the rate DGX systems of that generation
ship with (H100/H200: 400 Gb/s NDR; A100: 200 Gb/s HDR). Memory is what torch reports as the
device's total (an H100 80GB HBM3 shows 79.1 GiB; this project's H200 ~139 GiB), less RESERVE_GIB
for the CUDA context, NCCL's buffers and the caching allocator's slack, which no tensor accounts
for.

compute_efficiency is the share of the dense peak a training step's matmuls reach (model FLOPs
utilisation): 0.38 is what this project measured for GPT-2 124M on an H100 (BENCHMARKS.md, "The GPU
tier": MFU 54.8% of a measured 680 TFLOP/s matmul peak, i.e. 0.38 of the datasheet's 989), for the
H100 and the H200 (the same compute). It depends on the device more than on the model's size:
MosaicML's published FSDP runs of MPT models from 125M to 70B parameters (mosaicml/llm-foundry,
scripts/train/benchmarking/README.md, read 28 Nov 2026) reach a median MFU of 0.40 on 52 H100 80GB
bf16 runs (0.26-0.46), which agrees with ours, and 0.54 on 61 A100 80GB runs (0.39-0.64), nearly
flat from 125M to 30B: the A100 profile takes that 0.54 (A100_EFFICIENCY; no A100 was measured
here). link_efficiency is the share of a link's rate a ring collective reaches
(nccl-tests' bus bandwidth over the line rate, ~0.8 on NVLink and InfiniBand).

collective_latency_us is what a collective costs whatever its size (the alpha of an alpha-beta
model: launch, synchronisation, the first byte's trip): 0 in the built-in profiles, which have no
measured value for it (NCCL's is tens of microseconds, under a millisecond a step for GPT-2's TP).

A doctor's report (`lockstep doctor --json > cluster.json`, run as training will run) gives a
profile of the cluster as measured (profile_from_doctor): the smallest device memory of its ranks (a
CPU rank's share of its host's RAM), the slowest rank's measured bf16 matmul peak (CPU ranks: with
their host's ranks computing at once, as in training; 4 ranks on 2 cores here get half the peak each
reaches alone), the all-reduce bus bandwidth of its largest message, a node's if the report spans
one host and the nodes' if it spans more (then also standing for the link inside a node, which it
did not measure alone), and the time of its fastest all-reduce as the latency (gloo on this
project's CPU: ~1.4 ms). A measured matmul peak is ~80% of a datasheet's, so its compute_efficiency
is MEASURED_EFFICIENCY (GPT-2 124M's MFU of the H100's measured peak in "The GPU tier"), and a bus
bandwidth is a ring's rate already (link_efficiency 1).

A YAML file gives the same keys (name, memory_gib, bf16_tflops, intra_node_gbs, inter_node_gbs,
and optionally compute_efficiency, link_efficiency, reserve_gib, collective_latency_us) for any
other device.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from lockstep.errors import ConfigError

RESERVE_GIB = 2.0
MEASURED_EFFICIENCY = 0.548
A100_EFFICIENCY = 0.54  # MosaicML's published A100 80GB runs' median MFU (the docstring)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_gib: float  # what torch reports as the device's total
    bf16_tflops: float  # dense peak
    intra_node_gbs: float  # GB/s per device, one direction, to the devices of its node
    inter_node_gbs: float  # GB/s per device, one direction, to other nodes
    compute_efficiency: float = 0.38
    link_efficiency: float = 0.8
    reserve_gib: float = RESERVE_GIB
    collective_latency_us: float = 0.0
    source: str = ""

    @property
    def usable_bytes(self) -> int:
        return int((self.memory_gib - self.reserve_gib) * 2**30)


PROFILES = {
    p.name: p
    for p in (
        DeviceProfile(
            "h100-80gb",
            79.1,
            989.0,
            450.0,
            50.0,
            source="NVIDIA H100 SXM datasheet; 400 Gb/s NDR per GPU",
        ),
        DeviceProfile(
            "h200",
            139.8,
            989.0,
            450.0,
            50.0,
            source="NVIDIA H200 SXM datasheet; 400 Gb/s NDR per GPU",
        ),
        DeviceProfile(
            "a100-80gb",
            79.2,
            312.0,
            300.0,
            25.0,
            compute_efficiency=A100_EFFICIENCY,
            source="NVIDIA A100 80GB SXM datasheet; 200 Gb/s HDR per GPU",
        ),
    )
}


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in profile by name, or a YAML file's; else a ConfigError listing the known ones."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        try:
            return profile_from_doctor(json.loads(path.read_text()), str(path))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"--device-profile {path}: not a report of `lockstep doctor --json` "
                f"({type(e).__name__}: {e}); write one with `lockstep doctor --json > {path.name}`"
            ) from None
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        raise ConfigError(
            f"--device-profile {name_or_path!r} is neither a known profile nor a YAML file; known: "
            f"{', '.join(PROFILES)}, a YAML file with the keys {', '.join(_keys())}, or the JSON "
            "report of `lockstep doctor --json`"
        )
    values = yaml.safe_load(path.read_text()) or {}
    known = {f.name for f in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(values) - known) if isinstance(values, dict) else ["(not a mapping)"]
    missing = [k for k in _keys() if k not in values] if isinstance(values, dict) else []
    if unknown or missing:
        raise ConfigError(
            f"device profile {path}: unknown keys {unknown or 'none'}, "
            f"missing {missing or 'none'}; "
            f"it takes {', '.join(sorted(known - {'source'}))}"
        )
    try:
        profile = DeviceProfile(**{**values, "source": str(path)})
        bad = [k for k in known - {"name", "source"} if not float(getattr(profile, k)) >= 0]
    except (TypeError, ValueError) as e:
        raise ConfigError(f"device profile {path}: {e}") from None
    if bad:
        raise ConfigError(f"device profile {path}: {', '.join(bad)} must be numbers >= 0")
    return profile


def _keys() -> list[str]:
    return ["name", "memory_gib", "bf16_tflops", "intra_node_gbs", "inter_node_gbs"]


def profile_from_doctor(report: dict, source: str) -> DeviceProfile:
    """The cluster a doctor's report measured, as a profile (the module's docstring says how)."""
    ranks = report["ranks"]
    per_host: dict[str, int] = {}
    for r in ranks:
        per_host[r["host"]] = per_host.get(r["host"], 0) + 1
    memory = min(
        r["hardware"]["memory_gib"] / (per_host[r["host"]] if r["hardware"]["kind"] == "cpu" else 1)
        for r in ranks
    )
    # each rank's peak with its host's ranks computing at once, where the doctor measured it
    peak = min(r["peak"].get("together_flops", r["peak"]["flops"]) for r in ranks) / 1e12
    sizes = report.get("bandwidth") or []
    if not sizes:
        raise ConfigError(
            f"--device-profile {source}: the doctor measured no all-reduce bandwidth (one rank); "
            "run it with the ranks training will use (`lockstep doctor --nproc N`, or under "
            "torchrun or srun)"
        )
    busbw = max(sizes, key=lambda b: b["bytes"])["busbw_gbps"]
    gpu = ranks[0]["hardware"]["kind"] == "cuda"
    hosts = len(per_host)
    return DeviceProfile(
        name=f"{ranks[0]['hardware']['name']} as the doctor measured it ({len(ranks)} ranks on "
        f"{hosts} host{'s' if hosts > 1 else ''})",
        memory_gib=memory,
        bf16_tflops=peak,
        intra_node_gbs=busbw,
        inter_node_gbs=busbw,
        compute_efficiency=MEASURED_EFFICIENCY,
        link_efficiency=1.0,
        reserve_gib=RESERVE_GIB if gpu else 0.0,
        collective_latency_us=min(b["time_us"] for b in sizes),
        source=f"{source}: measured bf16 matmul peak, all-reduce busbw of "
        f"{max(sizes, key=lambda b: b['bytes'])['size']}",
    )
