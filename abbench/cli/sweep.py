"""``abbench sweep``: where do two arms' TTFT cross? Runs a profile's ``[sweep]`` (or one built from the flags)
as an ordinary run (:mod:`abbench.runner.sweep`), renders the report and prints, per arm pair, the paired ratio
at every point and the crossover with its interval; ``--json`` prints the ``abbench.sweep/1`` document instead
(:func:`abbench.cli.documents.sweep_document`). ``abbench run`` runs the same profile the same way; ``abbench
report``/``gate``/``compare`` read the run like any other.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from abbench.cli.common import RESULTS_ROOT, JsonOpt, ProfileOpt, _fail, _parse_csv, _parse_lengths, console, out
from abbench.cli.progress import finish, run_with_progress
from abbench.errors import AbbenchError, ConfigError


def _sweep_table(data: dict[str, Any], current: dict[str, Any] | None, flags: dict[str, Any]) -> dict[str, Any]:
    """The ``[sweep]`` table: the profile's (``current``) with the flags given over it; without one, the flags
    must say what to vary and where."""
    given = {k: v for k, v in flags.items() if v is not None}
    if current is None:
        missing = [f"--{k.replace('_', '-')}" for k in ("vary", "points") if k not in given]
        if missing:
            raise ConfigError(f"the profile has no [sweep] table: give {' and '.join(missing)} (e.g. --vary suffix "
                              "--prefix 16k --points 64,256,1k,4k), or a profile with one (docs/sweep.md)")
        data["prompts"].update(lengths=[], pairs=[])  # the sweep's points are the prompts
        arms = [a["name"] for a in data["arms"]]
        current = {"crossovers": [arms[:2]] if len(arms) >= 2 else []}
    return {**current, **given}


def sweep(
    profile: ProfileOpt = None,
    vary: Annotated[Optional[str], typer.Option(
        metavar="suffix|length", help="What the points count: the uncached suffix after a cached prefix (with "
        "--prefix), or the length of a fresh prompt. Default: the profile's [sweep].")] = None,
    points: Annotated[Optional[str], typer.Option(help="The grid, e.g. 64,256,1k,4k.")] = None,
    prefix: Annotated[Optional[str], typer.Option(help="--vary suffix: tokens of the cached prefix, e.g. 16k.")] = None,
    crossover: Annotated[Optional[list[str]], typer.Option(
        "--crossover", metavar="A,B", help="An arm pair whose crossing is located and refined, the arm faster "
        "below it first (repeatable). Default: the profile's, else its first two arms.")] = None,
    arms: Annotated[Optional[str], typer.Option(help="Comma-separated arms to run, in order (A,B). Default: all.")] = None,
    rounds: Annotated[Optional[int], typer.Option(min=1, help="Rounds at every point; arm order reverses every "
                                                    "round.")] = None,
    per_point: Annotated[Optional[int], typer.Option(min=1, help="Distinct prompts per point.")] = None,
    max_refinements: Annotated[Optional[int], typer.Option(min=0, help="Points added per crossover, at most.")] = None,
    target_width: Annotated[Optional[float], typer.Option(
        min=1e-9, help="Refine until the crossover's interval and bracket are this fraction of it wide.")] = None,
    out_dir: Annotated[Optional[Path], typer.Option(
        "--out", help="The run directory to write (it must not hold a run). Default: results/<run-id>.")] = None,
    as_json: JsonOpt = False,
    report: Annotated[bool, typer.Option(help="Render the Markdown report when the run ends.")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
) -> None:
    """Sweep one quantity over a grid, run the arms in ABBA rounds at every point, refine near where two arms'
    TTFT cross, and print per arm pair the ratio at every point and the crossover with its 95% interval
    (docs/sweep.md). The run is an ordinary run: report, gate and compare read it.

    Examples:

    \b
      abbench sweep -p cpu-tiny-sweep
      abbench sweep -p cpu-tiny-sweep --arms demand,chunked --points 16,256 --max-refinements 1 --json
    """
    from abbench import runner
    from abbench.analysis.sweep import sweep_summary
    from abbench.cli.documents import emit, sweep_document
    from abbench.profile import load_profile, profile_from_dict

    try:
        prof = load_profile(profile).with_overrides(arms=_parse_csv(arms, "--arms"), rounds=rounds)
        pts = _parse_lengths(points, "--points")
        pre = _parse_lengths(prefix, "--prefix")
        if pre is not None and len(pre) != 1:
            raise ConfigError("--prefix: one token count, e.g. 16k")
        pairs = [tuple(_parse_csv(c, "--crossover") or []) for c in crossover] if crossover else None
        if pairs is not None and any(len(p) != 2 for p in pairs):
            raise ConfigError("--crossover: two arms, the one faster below the crossover first, e.g. demand,chunked")
        data = prof.model_dump()
        data["sweep"] = _sweep_table(data, data.get("sweep"), {
            "vary": vary, "points": pts, "prefix_tokens": pre[0] if pre else None, "crossovers": pairs,
            "per_point": per_point, "max_refinements": max_refinements, "target_width": target_width})
        prof = profile_from_dict(data, where=f"{prof.source_path or prof.name} with the sweep flags")
        run_dir = out_dir or RESULTS_ROOT / runner.new_run_id(prof)
        runner.check_run_dir_free(run_dir)
        t0 = time.perf_counter()
        record = run_with_progress(runner, prof, run_dir, resume=False, quiet=quiet)
        if record.status == "complete":  # a stopped sweep has no crossovers to print: finish says how to resume
            if as_json:
                emit(sweep_document(record))
            else:
                _print(sweep_summary(record))
        finish(record, run_dir, time.perf_counter() - t0, report=report, what="sweep", as_json=as_json)
    except AbbenchError as e:
        _fail(e)
    except KeyboardInterrupt:
        console.print("[bold red]error:[/] interrupted", highlight=False)
        raise typer.Exit(130) from None


def _print(summary: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    for p in summary.get("pairs") or []:
        t = Table(title=f"TTFT {p['a']} / {p['b']} against {summary.get('quantity')}")
        for col in ("point", "pairs", "median ratio", "95% CI", "verdict"):
            t.add_column(col, justify="left" if col == "verdict" else "right")
        for r in p["points"]:
            ci = "-" if r["ci_low"] is None else f"{r['ci_low']:.3f}-{r['ci_high']:.3f}"  # n = 1: no interval
            t.add_row(str(r["x"]), str(r["n"]), f"{r['median_ratio']:.3f}", ci, r["verdict"])
        out.print(t)
        c = p["crossover"]
        out.print(f"crossover: {escape(c['summary'])}" + (f" (note: {escape(c['note'])})" if c.get("note") else ""),
                  highlight=False, soft_wrap=True)
