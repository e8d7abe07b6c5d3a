"""``abbench run``: an A/B experiment with a progress display (or, with ``--quiet``, warnings only); a run stopped
before it is complete exits 2 and names the ``--resume`` command.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer

from abbench.cli.common import (RESULTS_ROOT, ProfileOpt, _fail, _parse_csv, _parse_lengths, _parse_rounds,
                                _render_report, console)
from abbench.errors import AbbenchError, ConfigError



def run(
    profile: ProfileOpt = None,
    arms: Annotated[Optional[str], typer.Option(help="Comma-separated arms to run, in order (A,B). Default: all.")] = None,
    rounds: Annotated[Optional[str], typer.Option(
        metavar="N|auto", help="Rounds; arm order reverses every round. \"auto\": rounds go on until every declared "
        "ratio check (gate.checks) has a narrow interval: the profile's run.target_halfwidth and run.max_rounds, "
        "else 0.05 and 10.")] = None,
    lengths: Annotated[Optional[str], typer.Option(help="Fresh prompt lengths, e.g. 512,2k,4k.")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="The run directory to write (it must not hold a run). Default: results/<run-id>.")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Finish an interrupted run in this directory.")] = None,
    report: Annotated[bool, typer.Option(help="Render the Markdown report when the run ends.")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
) -> None:
    """Run an A/B experiment: build exact prompts, drive every arm in ABBA rounds, record every sample as it
    finishes (results/<run-id>/), and render the report. A run stopped before it is complete exits 2 and names
    the --resume command.

    Examples:

    \b
      abbench run    # the default profile, cpu-tiny: three arms, two rounds, about a minute on 2 cores
    """
    from abbench import runner
    from abbench.profile import load_profile

    try:
        if resume is not None:
            if any(v is not None for v in (profile, arms, rounds, lengths, out_dir)):
                raise ConfigError("--resume continues a run with its recorded profile; drop the other options")
            prof = None
            run_dir = resume
        else:
            prof = load_profile(profile).with_overrides(arms=_parse_csv(arms, "--arms"), rounds=_parse_rounds(rounds),
                                                        lengths=_parse_lengths(lengths))
            run_dir = out_dir or RESULTS_ROOT / runner.new_run_id(prof)
            runner.check_run_dir_free(run_dir)
        t0 = time.perf_counter()
        record = _run_with_progress(runner, prof, run_dir, resume=resume is not None, quiet=quiet)
        ok = sum(1 for s in record.samples if s.ok)
        console.print(f"run {record.status}: {len(record.samples)} samples ({ok} ok) in "
                      f"{time.perf_counter() - t0:.1f} s -> {run_dir}")
        kinds = Counter(s.error_kind or "error" for s in record.samples if not s.ok)
        if kinds:
            console.print(f"[yellow]note:[/] {sum(kinds.values())} failed sample(s): "
                          + ", ".join(f"{n} {k}" for k, n in kinds.most_common()), highlight=False)
        if report:
            _render_report(run_dir)
        if record.status != "complete":  # stopped by run.on_request_failure = stop: not a finished run
            raise AbbenchError(f"the run is {record.status}: {record.status_reason}; finish it with "
                               f"`abbench run --resume {run_dir}`")
    except AbbenchError as e:
        _fail(e)
    except KeyboardInterrupt:  # outside the runner (it maps its own): loading the profile, the report
        console.print("[bold red]error:[/] interrupted", highlight=False)
        raise typer.Exit(130) from None


def _run_with_progress(runner, prof, run_dir: Path, *, resume: bool, quiet: bool):  # type: ignore[no-untyped-def]
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
        return runner.execute(prof, run_dir, resume=resume, argv=argv,
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
        return runner.execute(prof, run_dir, resume=resume, observer=observe, argv=argv)
