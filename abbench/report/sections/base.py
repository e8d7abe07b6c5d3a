"""What every section reads (:class:`ReportInput`), the plots the report links (:data:`PLOTS`), the first
columns of every per-cell table (:data:`CELL_COLS`) and a plot's link (:func:`plot_link`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from abbench import analysis as an
from abbench.report.format import Col, fmt_int
from abbench.results import RunRecord


PLOTS = ("ttft", "ratios", "h2d", "memory", "ttft_memory")
"""The plots of every run with data; a sweep run adds ``sweep`` (:mod:`abbench.report.sections.sweep`), a load run
``load`` (:mod:`abbench.report.sections.load`)."""


@dataclass
class ReportInput:
    """What every section reads: the run, the problems its loading found, its analysis, and the plots
    (name -> link relative to the Markdown, or why a plot was not drawn)."""

    record: RunRecord
    analysis: an.Analysis
    problems: list[str] = field(default_factory=list)
    plots: dict[str, str | None] = field(default_factory=dict)
    plot_missing: dict[str, str] = field(default_factory=dict)


CELL_COLS = (Col("arm", "Arm", descriptive=True, right=False), Col("kind", "Kind", descriptive=True, right=False),
             Col("target_tokens", "Prompt tokens", fmt_int, descriptive=True),
             Col("n", "n", fmt_int, descriptive=True))
"""The first columns of every per-cell table: arm, kind, prompt length and samples."""


def plot_link(plots: dict[str, str | None], name: str, title: str) -> list[str]:
    rel = plots.get(name)
    return ["", f"![{title}]({rel})"] if rel else []
