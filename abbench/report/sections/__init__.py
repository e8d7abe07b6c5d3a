"""The report's Markdown sections: each is a function ``(ReportInput) -> lines``, and :data:`SECTIONS` lists
them in the report's order (:func:`render_markdown` joins them). A section without data says so.

One module per group of sections: :mod:`~abbench.report.sections.summary` (header, verdict, small-n notes,
problems, plots), :mod:`~abbench.report.sections.timing` (TTFT, latency percentiles, engines, ratios, floor, overhead),
:mod:`~abbench.report.sections.transfer` (H2D, engine counters, decode, host CPU, memory),
:mod:`~abbench.report.sections.parity` (parity, active path, attention batching),
:mod:`~abbench.report.sections.numerics` (an arm judged by numerics), :mod:`~abbench.report.sections.sweep`
(a sweep's crossovers), :mod:`~abbench.report.sections.load` (load levels) and
:mod:`~abbench.report.sections.environment`;
:mod:`~abbench.report.sections.base` holds what they share. Every section is importable from here.
"""

from __future__ import annotations

from abbench import analysis as an
from abbench.report.sections.base import CELL_COLS, PLOTS, ReportInput, plot_link
from abbench.report.sections.environment import environment_section, key_environment
from abbench.report.sections.numerics import numerics_section
from abbench.report.sections.parity import active_path_section, attention_batching_section, parity_section
from abbench.report.sections.summary import (
    header_section,
    plots_section,
    problems_section,
    small_n_section,
    verdict_section,
)
from abbench.report.sections.timing import (
    engines_section,
    latency_section,
    floor_section,
    overhead_section,
    ratios_section,
    ttft_section,
)
from abbench.report.sections.load import load_section
from abbench.report.sections.sweep import sweep_section
from abbench.report.sections.transfer import (
    decode_section,
    engine_counters_section,
    h2d_section,
    host_cpu_section,
    memory_section,
)
from abbench.results import RunRecord


__all__ = [
    "CELL_COLS", "PLOTS", "SECTIONS", "ReportInput", "active_path_section", "attention_batching_section",
    "decode_section", "engine_counters_section", "engines_section", "environment_section", "floor_section",
    "h2d_section", "header_section", "host_cpu_section",
    "key_environment", "latency_section", "load_section", "memory_section", "numerics_section", "overhead_section",
    "parity_section", "plot_link", "plots_section",
    "problems_section", "ratios_section", "render_markdown", "small_n_section", "sweep_section", "ttft_section",
    "verdict_section",
]

SECTIONS = [
    header_section, verdict_section, sweep_section, load_section, ttft_section, engines_section, ratios_section, h2d_section, floor_section,
    engine_counters_section, decode_section, latency_section, host_cpu_section, memory_section, parity_section,
    numerics_section, active_path_section, attention_batching_section, overhead_section, environment_section, small_n_section,
    problems_section, plots_section,
]
"""The report's sections, in order."""

SEQUENTIAL = (ttft_section, engines_section, ratios_section, h2d_section, floor_section, engine_counters_section,
              decode_section, latency_section, host_cpu_section, parity_section, numerics_section, active_path_section,
              attention_batching_section, overhead_section)
"""The sections of sequential samples: a load run (load levels only, no samples) leaves them out, and the plots
drawn from samples alone with them (:data:`SEQUENTIAL_PLOTS`)."""
SEQUENTIAL_PLOTS = ("ttft", "ratios", "h2d", "ttft_memory")


def load_only(record: RunRecord) -> bool:
    """A load run: load levels and no sequential sample."""
    from abbench.analysis.load import is_load_run

    return is_load_run(record) and not record.samples


def render_markdown(record: RunRecord, problems: list[str], a: an.Analysis, plot_links: dict[str, str],
                    plot_missing: dict[str, str]) -> str:
    """The report's Markdown, given the analysis and the plots' relative links (pure)."""
    sections = SECTIONS
    if load_only(record):
        sections = [s for s in SECTIONS if s not in SEQUENTIAL]
        plot_missing = {k: v for k, v in plot_missing.items() if k not in SEQUENTIAL_PLOTS}
    ri = ReportInput(record=record, analysis=a, problems=list(problems), plots=dict(plot_links),
                     plot_missing=dict(plot_missing))
    return "\n\n".join("\n".join(lines) for section in sections if (lines := section(ri))).rstrip() + "\n"
