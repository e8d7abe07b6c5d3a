"""The Markdown report of one run, with PNG plots.

Contract
--------
:func:`write_report` reads a :class:`~abbench.results.RunRecord` (and the problems :func:`~abbench.results.
load_run` found), computes everything through :mod:`abbench.analysis`, writes GitHub-flavoured Markdown to
``out_md`` and the plots into ``plots_dir``, and returns ``out_md``. It never prints and never raises on
missing data: a section without data says so, and so does "Problems and missing data". It reads results
only: no adapters, no network.

Layout: the CLI's default is :func:`report_paths` — ``reports/<run-id>.md`` and ``reports/<run-id>/`` for
``ttft.png``, ``ratios.png``, ``h2d.png``, ``memory.png``; the Markdown links them relatively, so the pair
can be moved together.

* :mod:`~abbench.report.format`: numbers for humans, Markdown tables (:class:`Col`, :func:`table`);
* :mod:`~abbench.report.sections`: the sections, each ``(ReportInput) -> lines``, and :func:`render_markdown`;
* :mod:`~abbench.report.plots`: the PNG plots (matplotlib imported only when drawing).
"""

from __future__ import annotations

import os
from pathlib import Path

from abbench import analysis as an
from abbench.report.format import (
    DASH,
    MAX_LISTED,
    Col,
    fmt_bool,
    fmt_counts,
    fmt_gb,
    fmt_gib,
    fmt_int,
    fmt_num,
    fmt_ratio,
    fmt_s,
    fmt_text,
    table,
)
from abbench.report.plots import plot_h2d, plot_memory, plot_ratios, plot_ttft, write_plots
from abbench.report.sections import PLOTS, SECTIONS, ReportInput, key_environment, render_markdown
from abbench.results import RunRecord

__all__ = [
    "DASH", "MAX_LISTED", "PLOTS", "SECTIONS", "Col", "ReportInput", "fmt_bool", "fmt_counts", "fmt_gb", "fmt_gib",
    "fmt_int", "fmt_num", "fmt_ratio", "fmt_s", "fmt_text", "key_environment", "plot_h2d", "plot_memory",
    "plot_ratios", "plot_ttft", "render_markdown", "report_paths", "table", "write_plots", "write_report",
]


def report_paths(reports_dir: Path, run_id: str) -> tuple[Path, Path]:
    """Default locations: (``reports/<run-id>.md``, ``reports/<run-id>/`` for the plots)."""
    return reports_dir / f"{run_id}.md", reports_dir / run_id


def write_report(record: RunRecord, problems: list[str], out_md: Path, plots_dir: Path,
                 draw_plots: bool = True) -> Path:
    """Write the Markdown report to ``out_md`` and its plots into ``plots_dir``; returns ``out_md``.
    ``draw_plots=False`` writes the same Markdown (linking the plots drawing would write) and no plot."""
    out_md = Path(out_md)
    plots_dir = Path(plots_dir)
    a = an.analyze(record)
    written, skipped = write_plots(record, a, plots_dir, draw=draw_plots)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    links = {name: Path(os.path.relpath(p, out_md.parent)).as_posix() for name, p in written.items()}
    text = render_markdown(record, problems, a, links, skipped)
    tmp = out_md.with_name(out_md.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out_md)
    return out_md
