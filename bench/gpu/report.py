"""The GPU section of BENCHMARKS.md, rebuilt from one or more results folders of bench/gpu/run.sh.

    python3 bench/gpu/report.py gpu-results/             # one folder (--part all)
    python3 bench/gpu/report.py tests-out/ bench-out/    # parts run as separate invocations
    python3 bench/gpu/report.py DIR --benchmarks COPY.md # write into another file

A folder holds what run.sh wrote there: env.json (device, driver, CUDA, torch, commit, the command,
an entry per part that ran), junit.xml and tests.log (`pytest -m gpu`), bench.json and bench.log
(GPT-2 124M, bench/gpu/gpt2.py), section.md (this section as that folder alone gives it). Of several
folders, each part comes from the last one given that holds it. Nothing is written as measured that
no file measured: a part without its file says "not run", one stopped at its time limit says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from bench_train import write_section  # noqa: E402  (the one marker-replacing writer of sections)

MARK_BEGIN = (
    "<!-- gpu_tier:begin (written by bench/gpu/report.py from run.sh's results folders; "
    "edits between the markers are replaced) -->"
)
MARK_END = "<!-- gpu_tier:end -->"
# all of them
FILES = ("env.json", "junit.xml", "tests.log", "bench.json", "bench.log", "section.md")
RATIO_GOAL, MFU_GOAL = 0.98, 0.45  # issue 23, on an H100: lockstep / raw, and MFU with compile
LISTED = 12  # failed / skipped tests named in the section; the rest are counted


@dataclass
class Results:
    """What the folders hold, merged: each part's environment, the tests' counts, the bench."""

    envs: dict[str, dict] = field(default_factory=dict)  # part -> env.json of its folder
    tests: dict | None = None  # parse_junit's summary
    bench: dict | None = None  # bench.json


def load_results(dirs: list[Path]) -> Results:
    """Merge results folders in order: a later folder's part replaces an earlier one's."""
    out = Results()
    for d in dirs:
        if not d.is_dir():
            raise SystemExit(
                f"report.py: {d} is not a folder; pass the results folders run.sh "
                "wrote (its --out, default gpu-results/)"
            )
        env = _read_json(d / "env.json") or {}
        parts = env.get("parts", {})
        if (d / "junit.xml").exists() or "tests" in parts:
            out.envs["tests"] = env
            out.tests = parse_junit(d / "junit.xml") if (d / "junit.xml").exists() else None
        if (d / "bench.json").exists() or "bench" in parts:
            out.envs["bench"] = env
            out.bench = _read_json(d / "bench.json")
    return out


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def parse_junit(path: Path) -> dict:
    """Counts and names from pytest's JUnit XML: passed, failed, errors, skipped, interrupted."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    summary = {
        "tests": 0,
        "passed": 0,
        "failed": [],
        "errors": [],
        "skipped": [],
        "interrupted": 0,
        "time_s": 0.0,
    }
    for suite in suites:
        summary["time_s"] += float(suite.get("time", 0) or 0)
        for case in suite.iter("testcase"):
            if case.get("name") is None:  # the test a SIGINT stopped: pytest writes it nameless
                summary["interrupted"] += 1
                continue
            name = "::".join(filter(None, [case.get("classname"), case.get("name")]))
            summary["tests"] += 1
            for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
                if (el := case.find(tag)) is not None:
                    summary[key].append((name, _reason(el)))
                    break
            else:
                summary["passed"] += 1
    return summary


def _reason(el: ET.Element) -> str:
    """The message; for a bare "collection failure|skipped" also the text's last line (the why)."""
    message = (el.get("message") or "").strip().splitlines()[:1]
    last = [line.strip() for line in (el.text or "").splitlines() if line.strip()][-1:]
    if not message or (message[0].startswith("collection ") and last):
        message += last
    return ": ".join(message)[:200]


# ----------------------------------------------------------------------------- the section


def render_section(res: Results) -> str:
    lines = [MARK_BEGIN, "## The GPU tier: `pytest -m gpu` and GPT-2 124M on one GPU", ""]
    if not res.envs:
        lines += [
            "Not run yet: no results folder held a part of the tier. On a machine with one "
            "NVIDIA GPU run `bash bench/gpu/run.sh` (`--plan` shows the steps).",
            MARK_END,
        ]
        return "\n".join(lines) + "\n"
    lines += _env_lines(res.envs)
    lines += ["", "### `pytest -m gpu`", "", *_tests_lines(res.envs.get("tests"), res.tests)]
    lines += ["", "### GPT-2 124M: lockstep vs the raw loop, one GPU", "", *_bench_part(res)]
    return "\n".join([*lines, MARK_END]) + "\n"


def _env_lines(envs: dict[str, dict]) -> list[str]:
    """One block per distinct machine, date and commit, naming the parts that ran there."""
    groups: dict[str, tuple[dict, list[str]]] = {}
    for part, env in envs.items():
        key = json.dumps([env.get(k) for k in ("gpu", "driver", "torch", "commit", "date")])
        groups.setdefault(key, (env, []))[1].append(part)
    lines: list[str] = []
    for env, parts in groups.values():
        facts = env.get("facts") or {}
        detail = ", ".join(
            filter(
                None,
                [
                    f"capability {facts['capability']}" if facts.get("capability") else "",
                    f"{facts['memory_gib']:.1f} GiB" if facts.get("memory_gib") else "",
                    f"{facts['multiprocessors']} SMs" if facts.get("multiprocessors") else "",
                ],
            )
        )
        lines += [
            f"- {' and '.join(parts)}: {env.get('date', 'date unknown')}, "
            f"{env.get('gpu', 'GPU unknown')}" + (f" ({detail})" if detail else ""),
            f"  - driver {env.get('driver', 'unknown')}, CUDA {env.get('cuda', 'unknown')}, torch "
            f"{env.get('torch', 'unknown')}, NCCL {facts.get('nccl', 'unknown')}, Python "
            f"{env.get('python', 'unknown')}, transformers {env.get('transformers', '-')}, "
            f"bitsandbytes {env.get('bitsandbytes', '-')}",
            f"  - lockstep at `{env.get('commit', 'unknown')}`; command: "
            f"`{env.get('command', 'unknown')}`",
        ]
        if facts.get("error"):
            lines.append(f"  - lockstep.runtime.cuda.cuda_facts failed: {facts['error']}")
        if env.get("wheels"):
            w = env["wheels"]
            lines.append(
                f"  - wheels from `{w['dir']}` into `{w['target']}` (pip exit {w['rc']}): "
                + ", ".join(w["files"])
            )
    return lines


def _part_status(env: dict | None, part: str) -> str:
    info = (env or {}).get("parts", {}).get(part)
    if not info:
        return ""
    text = f"`{info['command']}`: {info['status']} after {info['wall_s']:.0f} s"
    return text + (f" (limit {info['limit_s']:.0f} s)" if info.get("limit_s") else "")


def _tests_lines(env: dict | None, t: dict | None) -> list[str]:
    status = _part_status(env, "tests")
    if t is None:
        return [f"Not run{': ' + status if status else ''}; no junit.xml."]
    lines = [
        f"- {status}" if status else "- command: unknown (a junit.xml without env.json)",
        f"- {t['tests']} tests: **{t['passed']} passed, {len(t['failed'])} failed, "
        f"{len(t['errors'])} errors, {len(t['skipped'])} skipped** ({t['time_s']:.0f} s, from "
        "junit.xml)",
    ]
    stopped = (env or {}).get("parts", {}).get("tests", {}).get("status", "").startswith("stopped")
    if stopped or t["interrupted"]:
        lines.append(
            f"- stopped at the time limit: {t['interrupted']} test interrupted, the tests "
            "after it not run"
        )
    for label, key in (("failed", "failed"), ("error", "errors"), ("skipped", "skipped")):
        items = t[key]
        lines += [
            f"  - {label}: `{name}`" + (f": {why}" if why else "") for name, why in items[:LISTED]
        ]
        if len(items) > LISTED:
            lines.append(f"  - ... and {len(items) - LISTED} more {label} (see junit.xml)")
    return lines


def _bench_part(res: Results) -> list[str]:
    status = _part_status(res.envs.get("bench"), "bench")
    if res.bench is None:
        return [f"Not run{': ' + status if status else ''}; no bench.json."]
    return ([f"- {status}"] if status else []) + render_bench(res.bench)


def summarize(bench: dict) -> list[dict]:
    """Per compile mode: each side's median tokens/s over its completed runs, MFU, peak memory."""
    rows = []
    peak, fpt = bench["peak_flops"], bench["model"]["flops_per_token"]
    for compiled in bench["compile_modes"]:
        row: dict = {"compile": compiled}
        for impl in ("raw", "lockstep"):
            runs = [r for r in bench["runs"] if r["impl"] == impl and r["compile"] == compiled]
            done = [r for r in runs if r["status"] == "ok"]
            tok = [r["tokens_per_s"] for r in done]
            mem = [r["peak_mem_mb"] for r in done if r.get("peak_mem_mb") is not None]
            med = statistics.median(tok) if tok else None
            row[impl] = {
                "tokens_per_s": med,
                "runs": tok,
                "mfu": med * fpt / peak if med else None,
                "peak_mem_mb": max(mem) if mem else None,
                "not_done": [r["status"] for r in runs if r["status"] != "ok"],
            }
        raw, ls = row["raw"]["tokens_per_s"], row["lockstep"]["tokens_per_s"]
        row["ratio"] = ls / raw if raw and ls else None
        rows.append(row)
    return rows


def _fmt(value: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "not measured" if value is None else f"{value * scale:{spec}}{unit}"


def _runs(side: dict) -> str:
    """Each run's tokens/s, then why the others have none."""
    done = ", ".join(f"{v:,.0f}" for v in side["runs"])
    return done + "".join(f" ({why})" for why in side["not_done"])


def render_bench(bench: dict) -> list[str]:
    """The bench's notes, table and goals (gpt2.py prints them too)."""
    m, b = bench["model"], bench["batch"]
    peak = bench["peak_flops"]
    peak_text = f"{peak / 1e12:,.1f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:,.1f} GFLOP/s"
    autocast = f"{bench['precision']} autocast" if bench["precision"] != "fp32" else "fp32"
    ended = f"; {bench['interrupted']}" if bench.get("interrupted") else ""
    lines = [
        f"- device: {bench['device']}; {bench['precision']} matmul peak measured in the same job: "
        f"{peak_text} (best of {len(bench['peak_runs'])}, `measure_peak_flops` at "
        f"{bench['peak_size']}^3)",
        f"- model: lockstep's GPT, {m['layers']} layers, {m['hidden_size']} wide, "
        f"{m['attention_heads']} heads, context {m['max_seq_length']}, vocab {m['vocab_size']:,} "
        f"({m['params'] / 1e6:.1f}M parameters without position embeddings, "
        f"{m['flops_per_token'] / 1e6:,.0f} MFLOP/token = 6 x parameters + 12 x layers x width x "
        "context, `GPT.flops_per_token`: MFU = tokens/s x that / the peak)",
        f"- batch: {b['global']} sequences = {b['tokens_per_step']:,} tokens per step on both "
        f"sides, micro-batch {b['micro']} x {b['accum']} accumulation; {autocast}, fused AdamW: "
        f"{b['why']}",
        f"- data: {bench['data_note']}",
        f"- timed: steps {bench['warmup']}..{bench['steps']} of each run (log interval "
        f"{bench['log_interval']}); each run a separate process, {bench['order']}; medians",
        f"- raw side: `{bench['commands']['raw']}`",
        f"- lockstep side: `{bench['commands']['lockstep']}`",
        f"- both sides with `{bench.get('allocator', 'the allocator setting unrecorded')}` "
        "(lockstep's default for CUDA processes), so that they allocate alike",
        f"- command: `{bench['command']}` ({bench.get('wall_s', 0):.0f} s{ended})",
        "",
        "| compile | raw tok/s | lockstep tok/s | lockstep / raw | MFU raw | MFU lockstep "
        "| peak mem raw | peak mem lockstep | runs raw; lockstep (tok/s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summarize(bench):
        raw, ls = r["raw"], r["lockstep"]
        cells = [
            "on" if r["compile"] else "off",
            _fmt(raw["tokens_per_s"], ",.0f"),
            _fmt(ls["tokens_per_s"], ",.0f"),
            _fmt(r["ratio"], ".3f"),
            _fmt(raw["mfu"], ".1f", 100, "%"),
            _fmt(ls["mfu"], ".1f", 100, "%"),
            _fmt(raw["peak_mem_mb"], ",.2f", 1 / 1024, " GiB"),
            _fmt(ls["peak_mem_mb"], ",.2f", 1 / 1024, " GiB"),
            f"{_runs(raw)}; {_runs(ls)}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if bench.get("quick"):
        lines += [
            "",
            "A `--quick` smoke run of the harness on a tiny model: no measurement of GPT-2.",
        ]
    return [*lines, "", *goal_lines(summarize(bench), bench["device"])]


def goal_lines(rows: list[dict], device: str) -> list[str]:
    """The issue's goals, each met, not met, or not measured."""

    def verdict(value: float | None, goal: float, shown: str) -> str:
        if value is None:
            return "not measured"
        return ("**met**" if value >= goal else "**not met**") + f" ({shown})"

    lines = []
    for r in rows:
        ratio = r["ratio"]
        lines.append(
            f"- goal lockstep / raw >= {RATIO_GOAL} with compile "
            f"{'on' if r['compile'] else 'off'}: "
            + verdict(ratio, RATIO_GOAL, f"{ratio:.4f}" if ratio else "")
        )
    on = next((r for r in rows if r["compile"]), None)
    mfu, raw_mfu = (on["lockstep"]["mfu"], on["raw"]["mfu"]) if on else (None, None)
    shown = f"{_fmt(mfu, '.1f', 100, '%')}; raw {_fmt(raw_mfu, '.1f', 100, '%')}"
    lines.append(
        f"- goal MFU >= {100 * MFU_GOAL:.0f}% with compile (lockstep): "
        + verdict(mfu, MFU_GOAL, shown)
    )
    if "H100" not in device:
        lines.append(f"- the goals are set for an H100; this ran on {device}")
    return lines


def update_benchmarks(dirs: list[Path], benchmarks: Path) -> str:
    """Render the section from `dirs` and write it between the markers of `benchmarks`."""
    section = render_section(load_results(dirs))
    write_section(benchmarks, section, MARK_BEGIN, MARK_END)
    return section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "dirs",
        nargs="+",
        type=Path,
        help="results folders; a later one's part replaces an earlier one's",
    )
    p.add_argument(
        "--benchmarks",
        type=Path,
        default=ROOT / "BENCHMARKS.md",
        help="the markdown file to update (default: the repository's BENCHMARKS.md)",
    )
    args = p.parse_args(argv)
    print(update_benchmarks(args.dirs, args.benchmarks), end="")
    print(f"wrote the gpu_tier section of {args.benchmarks}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
