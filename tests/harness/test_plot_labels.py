"""The report's plots label their axes plainly: a log axis's ticks read 0.1, 0.2, 0.5, 1 (not 4×10^0 or
6e-01), and the paired-ratio plot names its x axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from abbench import analysis as an
from abbench.report import plots
from abbench.results import load_run

REPO = Path(__file__).resolve().parents[2]
H200 = REPO / "results" / "20261129-h200-qwen3-30b-a3b"  # resident / chunked spans 0.08-1: a log axis


def _labels(ax: Any) -> list[str]:
    ax.figure.canvas.draw()
    major = [t.get_text() for t in ax.get_yticklabels()]
    minor = [t.get_text() for t in ax.get_yticklabels(minor=True)]
    return [x for x in major + minor if x]


def test_a_log_axis_has_plain_tick_labels() -> None:
    fig = plots._figure(4, 3)
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], [0.08, 0.3, 1.0])
    plots._log_if_wide(ax, [0.08, 0.3, 1.0])
    assert ax.get_yscale() == "log"
    labels = _labels(ax)
    assert labels and not any(c in x for x in labels for c in ("$", "×", "e-", "e+", "^")), labels
    assert {"0.1", "1"} <= set(labels) and "0.2" in labels and "0.3" not in labels, labels


def test_the_ratio_plot_has_an_x_label_and_plain_log_ticks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = []
    make = plots._figure

    def keep(*a: Any, **k: Any) -> Any:
        figures.append(make(*a, **k))
        return figures[-1]

    monkeypatch.setattr(plots, "_figure", keep)
    plots.plot_ratios(an.analyze(load_run(H200)[0]), tmp_path / "ratios.png")
    axes = figures[0].axes
    assert axes and all(ax.get_xlabel() == "prompt (kind, tokens)" for ax in axes)
    logs = [ax for ax in axes if ax.get_yscale() == "log"]
    assert logs, "the resident arm's ratios span more than 10x"
    for ax in logs:
        labels = _labels(ax)
        assert labels and not any(c in x for x in labels for c in ("$", "×", "e-", "^")), labels
