"""PNG plots: the TTFT CDF of each run, and latency percentiles against request rate.

Uses matplotlib's object API with the Agg canvas (no pyplot global state, no
display needed). Rates are placed as categories so that an "inf" run fits on the
same axis as finite rates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from splitserve.benchmark.metrics import percentile_key, request_metrics
from splitserve.benchmark.runner import RunOutcome

PANELS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def ttft_cdf_points(outcome: RunOutcome) -> tuple[list[float], list[float]]:
    """Sorted TTFTs (ms) of completed requests and their cumulative fractions."""
    ttfts = sorted(m.ttft * 1000 for m in (request_metrics(r) for r in outcome.results
                                           if r.success) if m.ttft is not None)
    n = len(ttfts)
    return ttfts, [(i + 1) / n for i in range(n)]


def plot_ttft_cdf(outcomes: list[RunOutcome], path: Path, title: str = "") -> Path:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for outcome in outcomes:
        xs, ys = ttft_cdf_points(outcome)
        if xs:
            ax.step(xs, ys, where="post", label=f"rate {outcome.request_rate:g} req/s")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "TTFT CDF")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no request returned a token", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    return _save(fig, path)


def plot_latency_vs_rate(runs: list[dict[str, Any]], percentiles: list[float], path: Path,
                         title: str = "") -> Path:
    """One panel per latency metric, one line per percentile (and the mean)."""
    labels = [rate if isinstance(rate, str) else f"{rate:g}"
              for rate in (run["request_rate"] for run in runs)]
    positions = list(range(len(runs)))
    fig = Figure(figsize=(11, 7.5))
    for i, (key, name) in enumerate(PANELS):
        ax = fig.add_subplot(2, 2, i + 1)
        for stat in ["mean"] + [percentile_key(p) for p in percentiles]:
            values = [run[key].get(stat) for run in runs]
            points = [(x, v) for x, v in zip(positions, values, strict=True) if v is not None]
            if points:
                ax.plot([x for x, _ in points], [v for _, v in points], marker="o", label=stat)
        ax.set_xticks(positions, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(title or "latency against request rate")
    fig.tight_layout()
    return _save(fig, path)
