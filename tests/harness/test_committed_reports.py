"""Committed reports are what ``abbench report`` writes today from their committed runs: byte for byte, their
plots too where compared; the reports an earlier version rendered are listed, and noticed when they match again.
(They were in ``test_devicerun.py``: a file of its own lets the test workers share the load.)"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

REPORTS = REPO / "reports"
RENDERED = sorted(p.stem for p in REPORTS.glob("*.md") if (REPO / "results" / p.stem / "run.json").is_file())
# Rendered by an earlier version of the report (a section or a note added since) and not re-rendered: today's
# Markdown differs from the committed file. Listed so that a report that starts to match again is noticed (and
# moved off the list, so that its plots are compared too).
OLDER_RENDERING = {
    "20261129-h200-qwen3-30b-a3b", "20261129b-h200-qwen3-30b-a3b", "20261130-cpu-tiny-llamacpp-bf16",
    "20261130-cpu-tiny-llamacpp", "20261130-cpu-tiny-reference", "20261130-h200-qwen3-30b-a3b",
    "20261130-h200-qwen3.5-35b-a3b", "20261130b-cpu-tiny-llamacpp", "20261201-cpu-tiny-vllm",
    "20261201-h200-qwen3-30b-a3b-giant-chunk-128k", "20261201-h200-qwen4-exp-half", "20261201b-h200-qwen4-exp-half",
    "20261201c-h200-qwen4-exp-half", "20261201d-h200-qwen4-exp-half", "20261201e-h200-peer-llamacpp",
    "20261201f-h200-peer-llamacpp", "20261201g-h200-qwen3.5-35b-a3b-long", "20261201j-h200-qwen3-30b-a3b-sweep-skewed",
    "20261201j-h200-qwen3-30b-a3b-sweep", "20261201l-h200-qwen3-30b-a3b-sweep-skewed",
    "20261201l-h200-qwen3-30b-a3b-sweep", "20261201n-h200-decode-kernels", "chunk-sizes-bf16", "cpu-tiny-auto",
    "cpu-tiny-sweep", "readme-cpu-tiny",
}


CURRENT = [n for n in RENDERED if n not in OLDER_RENDERING]


def _plots_to_compare(names: list[str], newest: int = 5) -> set[str]:
    """The reports whose plots are drawn again and compared: the ``newest`` (by name) and, going back in time,
    each first report with a set of plots not seen yet, so every kind of plot is drawn; the other reports'
    Markdown alone is compared (drawing is most of a report's time, and the Markdown is the same drawn or not,
    ``test_the_markdown_is_the_same_whether_or_not_the_plots_are_drawn``)."""
    chosen, seen = set(), set()
    for i, name in enumerate(sorted(names, reverse=True)):
        plots = frozenset(p.name for p in (REPORTS / name).iterdir()) if (REPORTS / name).is_dir() else frozenset()
        if i < newest or not plots <= seen:
            chosen.add(name)
            seen |= plots
    return chosen


PLOTTED = _plots_to_compare(CURRENT)


@pytest.mark.parametrize("name", CURRENT)
def test_a_committed_report_regenerates_byte_for_byte_from_its_run(name: str, tmp_path: Path) -> None:
    """``abbench report results/NAME`` writes ``reports/NAME.md`` again, byte for byte, and its plots where they
    are compared (``PLOTTED``): removing the scripts and editing the READMEs of results/ changed nothing a report
    reads."""
    if name not in PLOTTED:
        from abbench.report import write_report
        from abbench.results import load_run

        record, problems = load_run(REPO / "results" / name, REPO / "results")
        md = write_report(record, problems, tmp_path / f"{name}.md", tmp_path / name, draw_plots=False)
        assert md.read_bytes() == (REPORTS / f"{name}.md").read_bytes()
        return
    from typer.testing import CliRunner

    from abbench.cli import app

    r = CliRunner().invoke(app, ["report", str(REPO / "results" / name), "--out", str(tmp_path / f"{name}.md")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / f"{name}.md").read_bytes() == (REPORTS / f"{name}.md").read_bytes()
    if (REPORTS / name).is_dir():
        for plot in sorted((REPORTS / name).iterdir()):
            assert_same_plot(tmp_path / name / plot.name, plot)


def test_every_kind_of_plot_is_drawn_again() -> None:
    drawn = {p.name for n in PLOTTED if (REPORTS / n).is_dir() for p in (REPORTS / n).iterdir()}
    every = {p.name for n in CURRENT if (REPORTS / n).is_dir() for p in (REPORTS / n).iterdir()}
    assert drawn == every and len(PLOTTED) < len(CURRENT)


def _png_software(png: bytes) -> bytes:
    """The tEXt 'Software' value matplotlib writes into a PNG ('Matplotlib version3.11.2, https://...')."""
    at = png.find(b"tEXtSoftware\x00")
    return png[at:png.find(b"\x00\x00", at + 13)] if at >= 0 else b""


def assert_same_plot(made: Path, committed: Path) -> None:
    """Byte for byte when the installed matplotlib wrote the committed plot; with another matplotlib (a newer
    release draws text a pixel apart) the same picture size, as PIL decodes both."""
    new, old = made.read_bytes(), committed.read_bytes()
    if _png_software(new) == _png_software(old):
        assert new == old, committed.name
        return
    from PIL import Image

    with Image.open(made) as a, Image.open(committed) as b:
        assert a.size == b.size, (committed.name, a.size, b.size)


def test_the_older_renderings_are_committed_runs() -> None:
    assert OLDER_RENDERING <= set(RENDERED) and len(RENDERED) - len(OLDER_RENDERING) >= 7


@pytest.mark.parametrize("name", sorted(OLDER_RENDERING))
def test_an_older_rendering_differs_from_todays_markdown(name: str, tmp_path: Path) -> None:
    """Today's Markdown of the run (what ``abbench report`` writes, its plots linked but not drawn: an older
    rendering's plots are never compared) is not the committed one."""
    from abbench.report import write_report
    from abbench.results import load_run

    record, problems = load_run(REPO / "results" / name, REPO / "results")
    md = write_report(record, problems, tmp_path / f"{name}.md", tmp_path / name, draw_plots=False)
    assert md.read_bytes() != (REPORTS / f"{name}.md").read_bytes(), \
        f"{name} renders as committed again: take it off OLDER_RENDERING"
    assert not (tmp_path / name).exists()


def test_the_markdown_is_the_same_whether_or_not_the_plots_are_drawn(tmp_path: Path) -> None:
    """What the test above relies on: ``draw_plots=False`` changes no byte of the Markdown, and draws nothing."""
    from abbench.report import write_report
    from abbench.results import load_run

    record, problems = load_run(REPO / "results" / "readme-cpu-tiny")
    drawn = write_report(record, problems, tmp_path / "a" / "r.md", tmp_path / "a" / "r")
    linked = write_report(record, problems, tmp_path / "b" / "r.md", tmp_path / "b" / "r", draw_plots=False)
    assert drawn.read_bytes() == linked.read_bytes() and "](r/ttft.png)" in linked.read_text()
    assert sorted(p.name for p in (tmp_path / "a" / "r").iterdir()) == ["h2d.png", "memory.png", "ratios.png",
                                                                        "ttft.png"]
    assert not (tmp_path / "b" / "r").exists()
