"""The ``abbench`` command line (Typer). Thin: parse, load, call the core, show progress, map errors to exit
codes (0 ok, 1 gate failed, 2 usage/config/results error, 130 interrupted).

Commands: ``run``, ``sweep`` (where two arms' TTFT cross), ``report``, ``gate``, ``compare`` (two runs), ``export``
(samples as CSV), ``diff`` and ``probe`` (divergence diagnostics), ``prompts``, ``profiles``, ``serve`` (the vendored
engine), ``memory-plan``, ``export-gguf`` (the engine's weights as a llama.cpp GGUF); ``--version``.

This package holds the Typer ``app`` and registers the commands, in the order ``--help`` lists them, from one
module per group: :mod:`~abbench.cli.experiment` (run), :mod:`~abbench.cli.sweep` (sweep), :mod:`~abbench.cli.results`
(report, gate, compare, export),
:mod:`~abbench.cli.diagnostics` (diff, probe), :mod:`~abbench.cli.catalog` (prompts, profiles) and
:mod:`~abbench.cli.engine` (serve, memory-plan, export-gguf); what they share is in :mod:`~abbench.cli.common`.
The command modules do not import this one.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from abbench import __version__
from abbench.cli import catalog, diagnostics, engine, experiment, results, sweep
from abbench.cli.common import REPORTS_ROOT, RESULTS_ROOT, console, out

__all__ = ["app", "console", "out", "RESULTS_ROOT", "REPORTS_ROOT", "main"]

app = typer.Typer(
    help="abbench: rigorous A/B validation of inference-engine changes (exact prompts, ABBA rounds, greedy "
    "parity, TTFT/ITL/H2D/VRAM telemetry, reports, a CI gate). `abbench COMMAND --help` for each command, with "
    "examples.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text as written: a check's [ARM, KIND] is not markup
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"abbench {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[Optional[bool], typer.Option(
        "--version", callback=_version, is_eager=True, help="Print abbench's version and exit.")] = None) -> None:
    """The options before a command (the app's help is the Typer ``help`` above)."""


app.command()(experiment.run)
app.command()(sweep.sweep)
app.command()(results.report)
app.command()(results.gate)
app.command()(results.compare)
app.command()(results.export)
app.command()(diagnostics.diff)
app.command()(diagnostics.probe)
app.command()(catalog.prompts)
app.command()(catalog.profiles)
app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)(engine.serve)
app.command("memory-plan")(engine.memory_plan_cmd)
app.command("export-gguf")(engine.export_gguf_cmd)


def main() -> None:  # pragma: no cover - console entry
    app()
