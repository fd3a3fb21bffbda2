"""The SLO chart: each objective per bucket against its target (matplotlib, the ``analytics`` extra)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from projections.reports.slo.compute import Report

MISSING_MATPLOTLIB = (
    "the chart needs matplotlib: pip install 'chatplane[analytics]' (or run without --chart)"
)
FIGURE_SIZE_IN = (10.0, 9.0)


def write_chart(report: Report, path: Path) -> None:
    """Four panels (contract, availability, TTFT p95, completion), one point per bucket with data,
    each with its target as a dashed line; raises ``RuntimeError(MISSING_MATPLOTLIB)`` without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(MISSING_MATPLOTLIB) from None
    rows = report.buckets or [(report.start_ms, report.overall)]
    times = [dt.datetime.fromtimestamp(start / 1000, tz=dt.UTC) for start, _ in rows]
    panels = (
        ("Admission response contract (%)", [o.contract for _, o in rows], report.overall.contract.target * 100, 100),
        ("Eligible admission availability (%)", [o.availability for _, o in rows], report.overall.availability.target * 100, 100),
        ("Time to first text token p95 (ms)", [o.ttft for _, o in rows], report.overall.ttft.target_ms, 1),
        ("Accepted generation completion (%)", [o.completion for _, o in rows], report.overall.completion.target * 100, 100),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=FIGURE_SIZE_IN, sharex=True)
    for ax, (title, objectives, target, scale) in zip(axes, panels):
        points = [(t, o.value * scale) for t, o in zip(times, objectives) if o.value is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", linewidth=1.2)
        ax.axhline(target, linestyle="--", color="red", linewidth=1, label=f"target {target:g}")
        ax.set_title(title, fontsize=10)
        ax.legend(loc="best", fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("bucket start (UTC)")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
