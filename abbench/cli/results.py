"""The commands that read recorded runs: ``report`` (Markdown and plots), ``gate`` (the CI verdict: exit 0 pass,
1 fail, 2 usage or results error) and ``compare`` (two runs of one profile: exit 1 on a regression).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from abbench.cli.common import RESULTS_ROOT, RunArg, _fail, _render_report, _run_or_latest, console, out
from abbench.errors import AbbenchError



def report(
    run: RunArg = None,
    out: Annotated[Optional[Path], typer.Option(help="Reports folder. Default: reports/.")] = None,
) -> None:
    """Render reports/<run-id>.md and its PNG plots from a run directory."""
    try:
        _render_report(_run_or_latest(run), out)
    except AbbenchError as e:
        _fail(e)


def gate(
    run: RunArg = None,
    parity_tokens: Annotated[
        Optional[int], typer.Option(min=1, help="First K greedy ids that must match. Default: the profile's.")
    ] = None,
    check: Annotated[Optional[list[str]], typer.Option(
        "--check", help="A declared check, METRIC[ARM(, KIND)(, >=TOKENS|<=TOKENS)] OP VALUE (repeatable), on top "
        "of the profile's gate.checks; e.g. 'ttft_ratio[layer-major, fresh, >=32768] <= 0.15'.")] = None,
    checks_from: Annotated[Optional[str], typer.Option(
        "--checks-from", help="Also judge the gate.checks of this profile (name or .toml), e.g. a run recorded "
        "before its profile declared them.")] = None,
    accept_near_ties: Annotated[
        Optional[float], typer.Option(min=1e-9, help="Accept near-tie flips whose top-2 margin is "
                                      "below this many nats (arms with their own accept_near_ties keep it). Default: the "
                                      "profile's gate.accept_near_ties.")
    ] = None,
) -> None:
    """Exit 0 when every prompt's first K ids match the parity reference arm (or, where accepted, flip at a near
    tie) and the declared checks hold; 1 when
    not (naming prompt, arm and position, or the check and its cell); 2 on a usage or results error (a bad
    check expression or an unknown arm included)."""
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
    out_file: Annotated[Optional[Path], typer.Option("--out", help="Write the Markdown here (default: stdout).")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        help="The plot (PNG). Default: next to --out (<out>.png); none when writing to stdout.")] = None,
) -> None:
    """Compare two runs of one profile (main vs a PR): per arm, kind and length the median TTFT, decode
    rate, H2D and peak device memory, the change with a 95% bootstrap interval, and the fingerprint
    differences. Exit 0 no regression, 1 a regression beyond --threshold, 2 when the prompts or the tokenizer
    differ (or a usage error)."""
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
    else:
        sys.stdout.write(text)
    if len(c.regressions):
        console.print(f"[bold red]compare: {len(c.regressions)} regression(s) beyond {threshold:.0%}[/]")
        raise typer.Exit(1)
