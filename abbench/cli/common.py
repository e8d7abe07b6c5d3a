"""What every command group of the ``abbench`` command line shares: the two consoles (messages and progress on
stderr, results on stdout), the default results and reports folders, the error-to-exit-code mapping
(:func:`_fail`), the list and length option parsers, the common option and argument types, and the lookup of the
latest run. The consoles lay out at the terminal's width, and do not wrap when piped (:data:`PIPE_WIDTH`).
Imports nothing from the command modules.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, ConsoleDimensions

from abbench.errors import AbbenchError, ConfigError

PIPE_WIDTH = 10_000
"""The width the consoles lay out at when their stream is not a terminal (a pipe, a file, CI's log) and
``COLUMNS`` is unset: rich's default there is 80 columns, which wraps messages and squeezes tables mid-word;
a grep or a log reader wants each message on one line."""


class _Console(Console):
    """A rich console that, writing to something other than a terminal, neither wraps nor squeezes (see
    :data:`PIPE_WIDTH`); at a terminal, or with ``COLUMNS`` or a width set, rich's own size."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self.is_terminal or self._width is not None or os.environ.get("COLUMNS"):
            return dims
        return ConsoleDimensions(PIPE_WIDTH, dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


console = _Console(stderr=True)
out = _Console()

RESULTS_ROOT = Path("results")
REPORTS_ROOT = Path("reports")


def _fail(e: AbbenchError) -> None:
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
    raise typer.Exit(e.exit_code)


def _parse_csv(value: Optional[str], flag: str) -> Optional[list[str]]:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ConfigError(f"{flag}: give a comma-separated list")
    return items


def _parse_engine_args(value: Optional[str]) -> Optional[list[str]]:
    """``--engine-args``: one string split like a shell line (``'--chunk-tokens 4096'``)."""
    if value is None:
        return None
    try:
        items = shlex.split(value)
    except ValueError as e:
        raise ConfigError(f"--engine-args: {e} in {value!r}") from None
    if not items:
        raise ConfigError("--engine-args: give the arguments, e.g. --engine-args '--chunk-tokens 4096'")
    return items


def _parse_rounds(value: Optional[str]) -> int | str | None:
    """``--rounds``: a positive count or "auto"."""
    if value is None or value.strip().lower() == "auto":
        return None if value is None else "auto"
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"--rounds: {value!r} is neither a number of rounds (e.g. 4) nor auto") from None
    if n < 1:
        raise ConfigError(f"--rounds: {value!r} must be at least 1")
    return n


def _parse_lengths(value: Optional[str], flag: str = "--lengths") -> Optional[list[int]]:
    items = _parse_csv(value, flag)
    if items is None:
        return None
    out_: list[int] = []
    for it in items:
        mult = 1
        s = it.lower()
        if s.endswith("k"):
            mult, s = 1024, s[:-1]
        try:
            n = int(s) * mult
        except ValueError:
            raise ConfigError(f"{flag}: {it!r} is not a token count (e.g. 512, 4k, 32768)") from None
        if n <= 0:
            raise ConfigError(f"{flag}: {it!r} must be positive")
        out_.append(n)
    return out_


ProfileOpt = Annotated[
    Optional[str],
    typer.Option("--profile", "-p", help="A path to a .toml file, or a profile name: looked up in ./profiles, then "
                 "among the bundled profiles (`abbench profiles` lists them). Default: cpu-tiny."),
]



def _run_or_latest(run: Optional[Path]) -> Path:
    """``run`` as given, or the most recent run under ./results (said on stderr); ResultsError when none."""
    if run is not None:
        return run
    from abbench.results import latest_run

    found = latest_run(RESULTS_ROOT)
    console.print(f"no run given: using the latest under {RESULTS_ROOT}/: {found}", highlight=False)
    return found


JsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print one JSON document on stdout instead of the human output (its schema: docs/json.md); "
    "messages stay on stderr and the exit code is the same.")]


RunArg = Annotated[Optional[Path], typer.Argument(
    help="Run directory (or run id under results/). Default: the most recent run under ./results/.")]


def _render_report(run: Path, out: Optional[Path] = None, html: bool = True) -> Path:
    """The report of ``run`` at ``out`` (a Markdown file; a directory, or a path without ``.md``, gets
    ``<run-id>.md`` inside it), its plots in the folder beside it named after it, and (``html``) the
    self-contained page beside it (``<run-id>.html``). Default: reports/<run-id>.md."""
    from abbench.report import write_report
    from abbench.results import load_run

    record, problems = load_run(run, RESULTS_ROOT)
    path = out if out is not None and out.suffix == ".md" and not out.is_dir() else (
        (out or REPORTS_ROOT) / f"{record.run_id}.md")
    md = write_report(record, problems, path, path.with_suffix(""))
    console.print(f"report -> {md}")
    if html:
        from abbench.report.html import write_html

        console.print(f"report -> {write_html(md)} (one file: plots inline, sortable tables)")
    return md

