"""A run's step time by rank and cause, from its metrics.jsonl: a table and a picture.

Each train record holds every rank's milliseconds per step in each phase over its log window
(lockstep.train.step_clock). The table gives each rank's means over the run and the windows in which
it was behind (its own time more than the margin above the other ranks' median,
lockstep.train.stragglers); the picture stacks each rank's mean by cause beside its own time per step
over the run, and names the rank behind most often with its cause. `lockstep report RUN_DIR` prints
the table and writes RUN/step_times.png, which a run also writes at its end, next to loss.png.

Reads metrics.jsonl, writes the picture; no process group.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from lockstep.metrics import read_metrics
from lockstep.train.step_clock import PHASES, RankTimes
from lockstep.train.stragglers import MIN_STEPS, Behind, behind, pooled

COLORS = {
    "data": "tab:orange",
    "compute": "tab:blue",
    "comm": "tab:gray",
    "bubble": "tab:olive",
    "optimizer": "tab:green",
    "checkpoint": "tab:red",
    "other": "tab:purple",
}
SHOWN = 32  # ranks drawn at most: the ones with the most time of their own


def windows(metrics_path: Path) -> list[tuple[int, list[RankTimes]]]:
    """(step, every rank's times) of each train record that holds them."""
    out = []
    for record in read_metrics(metrics_path):
        if record.get("split") == "train" and record.get("ranks"):
            ranks = [
                RankTimes(
                    row["rank"],
                    row["host"],
                    row["local_rank"],
                    {p: row.get(f"{p}_ms", 0.0) / 1000 for p in PHASES},
                    row.get("steps", 0),
                )
                for row in record["ranks"]
            ]
            out.append((record["step"], ranks))
    return out


def means(found: list[tuple[int, list[RankTimes]]]) -> list[RankTimes]:
    """Every rank's mean over the windows, per phase."""
    by_rank: dict[int, list[RankTimes]] = {}
    for _, ranks in found:
        for t in ranks:
            by_rank.setdefault(t.rank, []).append(t)
    return [
        RankTimes(
            r,
            ts[0].host,
            ts[0].local_rank,
            {p: statistics.mean(t.phases[p] for t in ts) for p in PHASES},
        )
        for r, ts in sorted(by_rank.items())
    ]


def comparisons(found: list[tuple[int, list[RankTimes]]], margin: float) -> list[Behind | None]:
    """The run's comparisons as the run made them: windows pooled to MIN_STEPS steps or more, the
    rank behind in each (or None)."""
    out, pool = [], []
    for _, ranks in found:
        pool = pooled(pool, ranks)
        if pool and pool[0].steps >= MIN_STEPS:
            out.append(behind(pool, margin))
            pool = []
    return out


def behind_counts(judged: list[Behind | None]) -> dict[int, tuple[int, str]]:
    """{rank: (comparisons it was behind in, its most frequent cause there)}."""
    causes: dict[int, Counter] = {}
    for late in filter(None, judged):
        causes.setdefault(late.times.rank, Counter())[late.cause] += 1
    return {r: (c.total(), c.most_common(1)[0][0]) for r, c in causes.items()}


def table(metrics_path: Path, margin: float) -> str:
    """Markdown: each rank's mean milliseconds per step by phase over the run, its own time, and in
    how many of the run's comparisons it was the rank behind."""
    found = windows(metrics_path)
    if not found:
        return f"{metrics_path}: no record holds per-rank step times"
    judged = comparisons(found, margin)
    counts = behind_counts(judged)
    head = ["rank", "host", "local rank", *(f"{p} (ms)" for p in PHASES), "own (ms)", "behind"]
    lines = [
        f"Milliseconds per step, means over {len(found)} log windows (steps {found[0][0]}-"
        f"{found[-1][0]}); own: all but the waits for other ranks; behind: of the run's comparisons "
        f"(windows pooled to {MIN_STEPS} steps or more), those in which the rank's own time was "
        f"more than {margin:.0%} above the other ranks' median.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for t in means(found):
        cells = [str(t.rank), t.host, str(t.local_rank)]
        cells += [f"{1000 * t.phases[p]:.1f}" for p in PHASES]
        cells += [f"{1000 * t.own:.1f}", f"{counts.get(t.rank, (0,))[0]} of {len(judged)}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(metrics_path: Path, out_png: Path, margin: float) -> Path | None:
    """RUN/step_times.png: figure()'s picture, written to `out_png`. None without per-rank
    records."""
    fig = figure(Path(metrics_path), margin)
    if fig is None:
        return None
    out_png = Path(out_png)
    fig.savefig(out_png)
    return out_png


def figure(metrics_path: Path, margin: float):
    """Each rank's mean time per step stacked by cause (left) and its own time per step over the
    run (right); the SHOWN ranks with the most time of their own, each one that was behind (by
    `margin`, as the run compares) labelled with how often and why, the one most often behind named
    in the title. A matplotlib Figure, or None without per-rank records."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    found = windows(metrics_path)
    if not found:
        return None
    ranks = sorted(means(found), key=lambda t: t.own, reverse=True)[:SHOWN]
    ranks.sort(key=lambda t: t.rank)
    fig = Figure(figsize=(12, max(3.5, 0.35 * len(ranks) + 1.5)), dpi=100)
    FigureCanvasAgg(fig)
    bars, lines = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
    judged = comparisons(found, margin)
    counts = behind_counts(judged)
    labels = [f"rank {t.rank} ({t.host}, {t.local_rank})" for t in ranks]
    labels = [
        f"{label}\nbehind {counts[t.rank][0]} of {len(judged)}: {counts[t.rank][1]}"
        if t.rank in counts
        else label
        for label, t in zip(labels, ranks)
    ]
    left = [0.0] * len(ranks)
    for phase in PHASES:
        widths = [1000 * t.phases[phase] for t in ranks]
        bars.barh(labels, widths, left=left, color=COLORS[phase], label=phase)
        left = [a + b for a, b in zip(left, widths)]
    bars.invert_yaxis()
    bars.set_xlabel("ms per step, mean over the run")
    bars.legend(fontsize=8, ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    for t in ranks:  # a rank may be missing from some windows: an elastic job's world changes
        own = [(step, 1000 * x.own) for step, rs in found for x in rs if x.rank == t.rank]
        lines.plot([s for s, _ in own], [ms for _, ms in own], label=f"rank {t.rank}")
    lines.set_xlabel("step")
    lines.set_ylabel("ms of its own per step (all but the waits)")
    lines.grid(alpha=0.3)
    if len(ranks) <= 16:
        lines.legend(fontsize=8)
    title = f"Step time by rank and cause: {Path(metrics_path).parent.name}"
    if counts:
        rank, (n, cause) = max(counts.items(), key=lambda item: item[1][0])
        where = next(t for _, rs in found for t in rs if t.rank == rank)
        title += (
            f"\nrank {rank} ({where.host}, local rank {where.local_rank}) behind in {n} of "
            f"{len(judged)} comparisons, cause {cause}"
        )
    fig.suptitle(title)
    fig.tight_layout()
    return fig
