"""The commands that read recorded runs: ``report`` (Markdown and plots, and one HTML file), ``gate`` (the CI verdict: exit 0 pass,
1 fail, 2 usage or results error), ``compare`` (two runs of one profile: exit 1 on a regression) and ``export``
(one row per sample, CSV). ``--json`` prints a document of :mod:`abbench.cli.documents` instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from abbench.checkexpr import GRAMMAR
from abbench.cli.common import RESULTS_ROOT, JsonOpt, RunArg, _fail, _render_report, _run_or_latest, console, out
from abbench.errors import AbbenchError, ConfigError



def report(
    run: RunArg = None,
    out: Annotated[Optional[Path], typer.Option(
        help="The Markdown file to write; its plots go in the folder of the same name beside it. A directory: "
        "<run-id>.md inside it. Default: reports/<run-id>.md.")] = None,
    html: Annotated[bool, typer.Option(
        "--html/--no-html", help="Also write the report as one self-contained HTML file beside the Markdown "
        "(<run-id>.html: plots inline, tables sortable by a click on a header, nothing fetched from the "
        "network).")] = True,
) -> None:
    """Render a run's Markdown report and its PNG plots, and the same report as one HTML file.

    Examples:

    \b
      abbench report results/readme-cpu-tiny
      abbench report results/chunk-sizes-bf16 --out chunk-sizes.md
      abbench report results/readme-cpu-tiny --out md-only --no-html
    """
    try:
        _render_report(_run_or_latest(run), out, html=html)
    except AbbenchError as e:
        _fail(e)


def gate(
    run: RunArg = None,
    parity_tokens: Annotated[
        Optional[int], typer.Option(min=1, help="First K greedy ids that must match. Default: the profile's.")
    ] = None,
    check: Annotated[Optional[list[str]], typer.Option(
        "--check", metavar="EXPR", help=f"A declared check, {GRAMMAR} (repeatable), on top of the profile's "
        "gate.checks; e.g. 'ttft_ratio[layer-major, fresh, >=32768] <= 0.15' (docs/checks-and-gate.md).")] = None,
    checks_from: Annotated[Optional[str], typer.Option(
        "--checks-from", help="Also judge the gate.checks of this profile (name or .toml), e.g. a run recorded "
        "before its profile declared them.")] = None,
    accept_near_ties: Annotated[
        Optional[float], typer.Option(min=1e-9, help="Accept near-tie flips whose top-2 margin is "
                                      "below this many nats (arms with their own accept_near_ties keep it). Default: the "
                                      "profile's gate.accept_near_ties.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Exit 0 when every prompt's first K ids match the parity reference arm (or, where accepted, flip at a near
    tie) and the declared checks hold; 1 when not (naming prompt, arm and position, or the check and its cell);
    2 on a usage or results error (a bad check expression or an unknown arm included).

    Examples:

    \b
      abbench gate results/readme-cpu-tiny
      abbench gate results/cpu-tiny-auto --check 'ttft_ratio[layer-major, fresh] <= 1.5' --json
      abbench gate results/20261130-h200-qwen3-30b-a3b --checks-from h200-qwen3-30b-a3b    # exit 1: inconclusive
      abbench gate results/chunk-sizes-bf16 --accept-near-ties 0.05
    """
    from rich.markup import escape

    from abbench.analysis import gate as judge
    from abbench.results import load_run

    try:
        record, problems = load_run(_run_or_latest(run), RESULTS_ROOT)
        extra = list(check or [])
        if checks_from is not None:
            from abbench.profile import load_profile

            extra = load_profile(checks_from).gate.checks + extra
        verdict = judge(record, parity_tokens=parity_tokens, checks=extra, accept_near_ties=accept_near_ties)
        if as_json:
            from abbench.analysis.declared import declared_exprs
            from abbench.cli.documents import emit, gate_document

            emit(gate_document(record, verdict, problems, declared_exprs(record) + extra))
            raise typer.Exit(0 if verdict.passed else 1)
    except AbbenchError as e:
        _fail(e)
        return
    for p in problems:
        console.print(f"[yellow]note:[/] {p}")
    table = Table(title=f"gate: {record.run_id}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for c in verdict.checks:
        colour = "green" if c.passed else "yellow" if c.result == "inconclusive" else "red"
        table.add_row(escape(c.name), f"[{colour}]{c.result}[/]", escape(c.detail))
    out.print(table)
    for c in verdict.checks:  # declared checks, unwrapped: one line per cell they judged
        if "[" in c.name:
            out.print(f"check {escape(c.name)}: {c.result}", highlight=False, soft_wrap=True)
            for cell in c.detail.split("; "):
                out.print(f"  {escape(cell)}", highlight=False, soft_wrap=True)
    for f in verdict.failures:
        out.print(f"[red]FAIL[/] {escape(f)}", highlight=False, soft_wrap=True)
    for n in verdict.notes:
        out.print(f"[yellow]note:[/] {escape(n)}", highlight=False, soft_wrap=True)
    if not verdict.passed:
        out.print("[bold red]gate: FAIL[/]")
        raise typer.Exit(1)
    out.print("[bold green]gate: PASS[/]")


def compare(
    base: Annotated[Path, typer.Argument(help="The base run (e.g. main): a run directory or id under results/.")],
    cand: Annotated[Path, typer.Argument(help="The candidate run (e.g. the PR), made with the same profile.")],
    threshold: Annotated[float, typer.Option(
        min=0.0, help="Exit 1 when a metric is worse by more than this fraction with its whole 95% interval "
        "beyond it.")] = 0.05,
    out_file: Annotated[Optional[Path], typer.Option("--out", help="The Markdown file to write. Default: stdout "
                                                     "(with --json: no Markdown).")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        help="The plot (PNG). Default: next to --out (<out>.png); none when writing to stdout.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Compare two runs of one profile (main vs a PR): per arm, kind and length the median TTFT, decode
    rate, H2D and peak device memory, the change with a 95% bootstrap interval, and the fingerprint
    differences. A cell with fewer than 3 samples on a side is too few to judge; each arm is also judged over
    all its cells (geometric-mean change, stratified bootstrap interval and a sign test across cells), so a
    slowdown in every cell is a regression at 2 samples a cell. Exit 0 no regression, 1 a regression beyond
    --threshold (a cell's or an arm's), 2 when the runs are of another profile, prompt set or tokenizer (or a
    usage error), 3 when nothing could be judged (no cell with enough samples, no arm with enough cells).
    See docs/compare.md.

    Examples:

    \b
      abbench compare results/20261129-h200-qwen3-30b-a3b results/20261129b-h200-qwen3-30b-a3b
      abbench compare results/20261129-h200-qwen3-30b-a3b results/20261129b-h200-qwen3-30b-a3b --out compare.md
      abbench compare results/readme-cpu-tiny results/cpu-tiny-auto    # exit 2: different profiles
    """
    import os

    from abbench.compare import compare as compare_runs
    from abbench.compare import plot_changes, render_markdown
    from abbench.results import load_run

    try:
        rb, _ = load_run(base, RESULTS_ROOT)
        rc, _ = load_run(cand, RESULTS_ROOT)
        c = compare_runs(rb, rc, threshold=threshold)
    except AbbenchError as e:
        _fail(e)
        return
    plot_path = plot or (out_file.with_suffix(".png") if out_file is not None else None)
    link = None
    if plot_path is not None and plot_changes(c, plot_path):
        where = out_file.parent if out_file is not None else Path.cwd()
        link = Path(os.path.relpath(plot_path, where)).as_posix()
    text = render_markdown(c, link)
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(text, encoding="utf-8")
        console.print(f"compare -> {out_file}" + (f" (plot {plot_path})" if link else ""))
    elif not as_json:
        sys.stdout.write(text)
    if as_json:
        from abbench.cli.documents import compare_document, emit

        emit(compare_document(c))
    if c.exit_code == 1:
        console.print(f"[bold red]compare: {c.regression_count} regression(s) beyond {threshold:.0%}[/]")
    elif c.exit_code:
        console.print(f"[bold yellow]compare: nothing could be judged (exit {c.exit_code}): every cell has too few "
                      "samples and no arm enough cells; run more rounds or lengths[/]")
    if c.exit_code:
        raise typer.Exit(c.exit_code)


def export(
    run: RunArg = None,
    csv: Annotated[bool, typer.Option("--csv", help="One row per sample, comma-separated, with a header.")] = False,
    out_file: Annotated[Optional[Path], typer.Option("--out", help="The file to write. Default: stdout.")] = None,
    load: Annotated[bool, typer.Option("--load", help="One row per request of the run's load levels instead "
                                                      "(stamps, latencies, errors, ids; docs/json.md); the "
                                                      "default for a run of load levels only.")] = False,
) -> None:
    """Export a run's samples for pandas, a spreadsheet or a database: one row per sample (every sample, with
    `measured` and `ok` saying which count), its timings (ttft_s, total_s, decode_tok_s, tpot_s), token counts,
    the engine's counters and telemetry, and its output ids. The columns: docs/json.md.

    Examples:

    \b
      abbench export results/readme-cpu-tiny --csv --out samples.csv
      abbench export results/readme-cpu-tiny --csv
    """
    from abbench.cli.documents import samples_table
    from abbench.results import load_run

    try:
        if not csv:
            raise ConfigError("choose a format: --csv (the run's own records are run.json and requests.jsonl)")
        record, _ = load_run(_run_or_latest(run), RESULTS_ROOT)
        if not load and record.load and not record.samples:  # a load run has requests, not samples
            console.print(f"run {record.run_id} is a load run: one row per request of its load levels (as --load)",
                          highlight=False)
            load = True
        if load:
            from abbench.analysis.load import requests_table

            if not record.load:
                raise ConfigError(f"--load: run {record.run_id} has no load levels (its profile has no [load] table)")
            table = requests_table(record)
            table.insert(0, "run_id", record.run_id)
        else:
            table = samples_table(record)
        if out_file is not None:
            out_file.parent.mkdir(parents=True, exist_ok=True)
            table.to_csv(out_file, index=False)
            console.print(f"export -> {out_file}: {len(table)} {'load requests' if load else 'samples'}",
                          highlight=False)
        else:
            table.to_csv(sys.stdout, index=False)
    except AbbenchError as e:
        _fail(e)
    except OSError as e:
        _fail(ConfigError(f"--out {out_file}: cannot write there ({e.strerror or e})"))
