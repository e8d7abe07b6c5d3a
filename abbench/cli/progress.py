"""A run driven from the command line (``abbench run`` and ``abbench sweep``): the progress display while it runs
(:func:`run_with_progress`; with ``--quiet`` only the warnings) and its closing lines (:func:`finish`: samples,
failed ones by kind, the report, and exit 2 naming ``--resume`` for a run that is not complete).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from abbench.cli.common import _render_report, console
from abbench.errors import AbbenchError


def finish(record, run_dir: Path, seconds: float, *, report: bool, what: str) -> None:  # type: ignore[no-untyped-def]
    """Print how the run ended, render its report (``report``), and raise for a run that is not complete."""
    ok = sum(1 for s in record.samples if s.ok)
    console.print(f"{what} {record.status}: {len(record.samples)} samples ({ok} ok) in {seconds:.1f} s -> {run_dir}")
    kinds = Counter(s.error_kind or "error" for s in record.samples if not s.ok)
    if kinds:
        console.print(f"[yellow]note:[/] {sum(kinds.values())} failed sample(s): "
                      + ", ".join(f"{n} {k}" for k, n in kinds.most_common()), highlight=False)
    if report:
        _render_report(run_dir)
    if record.status != "complete":  # stopped by run.on_request_failure = stop: not a finished run
        from abbench.runner.rundir import resume_hint

        raise AbbenchError(f"the {what} is {record.status}: {record.status_reason}; {resume_hint(run_dir)}")


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
