"""A run driven from the command line (``abbench run`` and ``abbench sweep``): the progress display while it runs
(:func:`run_with_progress`; with ``--quiet`` only the warnings) and its closing lines (:func:`finish`: samples,
failed ones by kind, the report, exit 2 naming ``--resume`` for a run that is not complete, else the gate's
verdict line and exit 1 when a measured sample failed).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import typer

from abbench.cli.common import _render_report, console, out
from abbench.errors import AbbenchError


def finish(record, run_dir: Path, seconds: float, *, report: bool, what: str,  # type: ignore[no-untyped-def]
           as_json: bool = False) -> None:
    """Print how the run ended and render its report (``report``); raise for a run that is not complete (exit
    2, naming the resume command); otherwise end with the gate's verdict line (:func:`verdict_line`; on stderr
    when stdout holds a JSON document) and exit 1 when a measured sample failed."""
    ok = sum(1 for s in record.samples if s.ok)
    excluded = sum(1 for s in record.samples if s.excluded)  # warm-up (and JIT) samples the gate does not count
    held = f"{len(record.samples)} samples ({ok} ok" + (f"; {excluded} warm-up, not measured)" if excluded else ")")
    if record.load:  # a load run: its levels and their requests (failed ones are judged by the gate's load-levels)
        reqs = [r for lv in record.load for r in lv.requests]
        held = (f"{len(record.load)} load levels, {len(reqs)} requests ({sum(r.ok for r in reqs)} ok)"
                if not record.samples else f"{held}, {len(record.load)} load levels")
    console.print(f"{what} {record.status}: {held} in {seconds:.1f} s -> {run_dir}")
    kinds = Counter(s.error_kind or "error" for s in record.samples if not s.ok)
    if kinds:
        console.print(f"[yellow]note:[/] {sum(kinds.values())} failed sample(s): "
                      + ", ".join(f"{n} {k}" for k, n in kinds.most_common()), highlight=False)
    if report:
        _render_report(run_dir)
    if record.status != "complete":  # stopped by run.on_request_failure = stop: not a finished run
        from abbench.runner.rundir import resume_hint

        raise AbbenchError(f"the {what} is {record.status}: {record.status_reason}; {resume_hint(run_dir)}")
    verdict_line(record, console if as_json else out)
    failed = [s for s in record.samples if not s.ok and not s.excluded]
    if failed:
        from abbench.runner.rundir import resume_hint

        console.print(f"[bold red]error:[/] {len(failed)} measured sample(s) failed; {resume_hint(run_dir)} to run "
                      "their steps again", highlight=False)
        raise typer.Exit(1)


def verdict_line(record, stream) -> None:  # type: ignore[no-untyped-def]
    """The gate's verdict on the run as ``abbench gate`` ends (its profile's checks): each failing check's
    line, then ``gate: PASS`` or ``gate: FAIL``, on ``stream``. Informative: the exit code is the samples'."""
    from rich.markup import escape

    from abbench.analysis import gate

    try:
        verdict = gate(record)
    except AbbenchError as e:  # a declared check the record cannot bind: said, not fatal to a finished run
        console.print(f"[yellow]note:[/] the gate could not judge the run: {escape(str(e))}", highlight=False)
        return
    for c in verdict.checks:
        if not c.passed:
            stream.print(f"[red]{escape(c.result)}[/] {escape(c.name)}: {escape(c.detail)}", highlight=False,
                         soft_wrap=True)
    stream.print("[bold green]gate: PASS[/]" if verdict.passed else "[bold red]gate: FAIL[/]")


def run_with_progress(runner, prof, run_dir: Path, *, resume: bool, quiet: bool,  # type: ignore[no-untyped-def]
                      keep_failed: bool = False):
    """``runner.execute`` with a progress bar on stderr (or, quiet, the warnings alone); the run's record."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if prof is None:  # resume: the runner loads the recorded profile
        from abbench.profile import profile_from_dict
        from abbench.results import load_run

        rec, _ = load_run(run_dir)
        prof = profile_from_dict(rec.profile, where=f"{run_dir}/run.json")
    argv = sys.argv[:]

    def warn(ev) -> None:  # type: ignore[no-untyped-def]
        from rich.markup import escape

        console.print(f"[yellow]warning:[/] {escape(ev.message)}", highlight=False)

    if quiet:  # no progress display, but warnings (a skipped arm, a restarted service) still show
        return runner.execute(prof, run_dir, resume=resume, keep_failed=keep_failed, argv=argv,
                              observer=lambda ev: warn(ev) if ev.kind == "warning" else None)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[last]}"),
        console=console,
        transient=False,
    )
    task = progress.add_task("preparing", total=None, last="")

    def observe(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.kind == "sample" and ev.sample is not None:
            s = ev.sample
            last = (f"{s.arm} {s.prompt_id} ttft={s.ttft_s * 1e3:.1f} ms" if s.ok and s.ttft_s is not None
                    else f"{s.arm} {s.prompt_id} FAILED ({s.error_kind})")
            progress.update(task, completed=ev.done, total=ev.total, description="running", last=last)
        elif ev.kind == "service":
            progress.update(task, description=ev.message, completed=ev.done, total=ev.total or None)
        elif ev.kind == "prompts":
            progress.update(task, description=ev.message)
        elif ev.kind == "warning":
            warn(ev)

    with progress:
        return runner.execute(prof, run_dir, resume=resume, keep_failed=keep_failed, observer=observe, argv=argv)
