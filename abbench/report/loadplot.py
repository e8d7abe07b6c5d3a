"""The load plot (``load.png``): per arm, TTFT p50, TTFT p99 and ITL p99 against the achieved output tokens/s
of each level, one line per arm, each point labelled by its level; a 95% interval as error bars where the cell
has one. A panel whose percentile no cell has enough requests for says so instead of drawing nothing.

matplotlib is imported inside the function (Agg, no pyplot), as in :mod:`abbench.report.plots`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["PANELS", "plot_load"]

PANELS = (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("itl_p99_s", "ITL p99"))


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def plot_load(cells: pd.DataFrame, arms: list[str], path: Path) -> None:
    """Draw ``cells`` (:func:`abbench.analysis.load.cell_table`) into ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS), sharex=True)
    order = [a for a in arms if a in set(cells["arm"])] + sorted(set(cells["arm"]) - set(arms))
    for ax, (key, title) in zip(axes, PANELS):
        drawn = False
        for i, arm in enumerate(order):
            g = cells[cells["arm"] == arm]
            pts = [(x, y, _num(lo), _num(hi), lv) for x, y, lo, hi, lv in
                   zip(g["output_tok_s"].map(_num), g[key].map(_num), g[f"{key}_low"], g[f"{key}_high"], g["level"])
                   if x is not None and y is not None]
            if not pts:
                continue
            pts.sort()
            xs, ys = [p[0] for p in pts], [p[1] * 1e3 for p in pts]
            err = [[max(0.0, (p[1] - (p[2] if p[2] is not None else p[1])) * 1e3) for p in pts],
                   [max(0.0, ((p[3] if p[3] is not None else p[1]) - p[1]) * 1e3) for p in pts]]
            ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=arm, color=f"C{i}")
            for x, y, p in zip(xs, ys, pts):
                ax.annotate(p[4], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=f"C{i}")
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, f"no cell has enough requests\nfor its {title.split()[-1]}", ha="center",
                    va="center", transform=ax.transAxes, fontsize=9, color="0.4")
        ax.set_title(title)
        ax.set_xlabel("achieved output tokens/s")
        ax.set_ylabel(f"{title} (ms)")
        ax.grid(True, alpha=0.3)
    axes[-1].legend(title="arm", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("Latency against throughput, per load level")
    fig.savefig(path)
