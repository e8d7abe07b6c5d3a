"""``abbench run``: an A/B experiment with a progress display (or, with ``--quiet``, warnings only), ending with
the gate's verdict line (with ``--concurrency``/``--rate`` or a ``[load]`` table, load levels instead of rounds).
Exit 0: every measured sample ok; 1: a measured sample failed; 2: a usage, service or
results error, or a run stopped before it is complete (the ``--resume`` command is named); 130: interrupted.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from abbench.cli.common import (RESULTS_ROOT, ProfileOpt, _fail, _parse_csv, _parse_engine_args, _parse_lengths,
                                _parse_rounds, console, out)
from abbench.cli.progress import finish, run_with_progress
from abbench.errors import AbbenchError, ConfigError


def run(
    profile: ProfileOpt = None,
    arms: Annotated[Optional[str], typer.Option(help="Comma-separated arms to run, in order (A,B). Default: all.")] = None,
    rounds: Annotated[Optional[str], typer.Option(
        metavar="N|auto", help="Rounds; arm order reverses every round. \"auto\": rounds go on until every declared "
        "ratio check (gate.checks) has a narrow interval: the profile's run.target_halfwidth and run.max_rounds, "
        "else 0.05 and 10.")] = None,
    lengths: Annotated[Optional[str], typer.Option(help="Fresh prompt lengths, e.g. 512,2k,4k.")] = None,
    concurrency: Annotated[Optional[str], typer.Option(
        metavar="N,N,...", help="Run load levels instead of sequential rounds: closed loop, N requests always in "
        "flight at each level, e.g. 1,4,16. Replaces the profile's [load] levels (its rates too, unless --rate is "
        "given); a profile without [load] gets one with its defaults (32 requests a level, 256-token prompts, "
        "each prompt also run alone as the parity reference). See docs/load.md.")] = None,
    rate: Annotated[Optional[str], typer.Option(
        metavar="R,R,...", help="Run load levels: open loop, requests/s arriving on a seeded Poisson schedule "
        "(the profile's [load] arrival and burstiness), sent on time however slow the server is, e.g. 2,8,inf "
        "(inf: every request at once). Replaces the profile's [load] levels as --concurrency does.")] = None,
    engine_args: Annotated[Optional[str], typer.Option(
        metavar="ARGS", help="Arguments added at the end of every arm's launch command, split like a shell line, "
        "e.g. --engine-args '--chunk-tokens 4096': one setting changed for every arm without editing the profile "
        "(the run records the commands it launched). Not for arms that attach to a running server.")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="The run directory to write (it must not hold a run). Default: results/<run-id>.")] = None,
    resume: Annotated[Optional[Path], typer.Option(
        help="Finish a partial run in this directory: the steps without a sample, and those whose sample failed.")] = None,
    keep_failed: Annotated[bool, typer.Option(
        "--keep-failed", help="With --resume: keep the failed samples instead of running their steps again.")] = False,
    report: Annotated[bool, typer.Option(help="Render the Markdown report when the run ends.")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check the profile on this machine and stop: build its prompts and plan, and check every "
        "arm's service as a run does before its first request (the program on the PATH; an attached server's "
        "health, cache reset, model and context; the vendored engine's device-memory plan on a GPU or under a "
        "budget, printed per arm: chunk length, fixed part, expert slots per layer). Launches no service, sends "
        "no measured request, writes no run. Exit 0 when all pass, 2 with the first failure.")] = False,
) -> None:
    """Run an A/B experiment: build exact prompts, drive every arm in ABBA rounds, record every sample as it
    finishes (results/<run-id>/), render the report, and end with the gate's verdict line (gate: PASS or FAIL,
    as abbench gate prints it). Every arm's service is checked before the first sample.

    Exit codes: 0 every measured sample ok; 1 a measured sample failed (--resume runs its step again); 2 a
    usage, service or results error, or a run stopped before it is complete (the --resume command is printed);
    130 interrupted (likewise).

    Examples:

    \b
      abbench run    # the default profile, cpu-tiny: three arms, two rounds, about a minute on 2 cores
      abbench run -p cpu-tiny-load                   # load levels: 1, 2 and 4 in flight, ABBA at each level
      abbench run -p cpu-tiny-load --concurrency 1,8 --rate 4,inf
      abbench run -p cpu-tiny-load --dry-run         # will every arm's service start here? nothing is launched

    A profile with a [load] table (or --concurrency/--rate) runs load levels only: per round, every prompt
    alone on each arm (the parity reference), then each level with the arms in the round's ABBA order; each
    cell is recorded as it ends (a --resume starts again at the level it stopped in).
    """
    from abbench import runner
    from abbench.profile import load_profile, parse_levels

    try:
        if resume is not None:
            if any(v is not None for v in (profile, arms, rounds, lengths, out_dir, concurrency, rate, engine_args)):
                raise ConfigError("--resume continues a run with its recorded profile; drop the other options")
            if dry_run:
                raise ConfigError("--dry-run checks a profile before a run; give it without --resume")
            prof = None
            run_dir = resume
        else:
            if keep_failed:
                raise ConfigError("--keep-failed applies to a resumed run; give it with --resume DIR")
            levels = {k: parse_levels(v, k) for k, v in (("concurrency", concurrency), ("rate", rate)) if v is not None}
            prof = load_profile(profile).with_overrides(arms=_parse_csv(arms, "--arms"), rounds=_parse_rounds(rounds),
                                                        lengths=_parse_lengths(lengths),
                                                        engine_args=_parse_engine_args(engine_args), **levels)
            if dry_run:
                _dry_run(runner, prof, quiet=quiet)
                return
            run_dir = out_dir or RESULTS_ROOT / runner.new_run_id(prof)
            runner.check_run_dir_free(run_dir)
        t0 = time.perf_counter()
        record = run_with_progress(runner, prof, run_dir, resume=resume is not None, quiet=quiet,
                                   keep_failed=keep_failed)
        finish(record, run_dir, time.perf_counter() - t0, report=report, what="run")
    except AbbenchError as e:
        _fail(e)
    except KeyboardInterrupt:  # outside the runner (it maps its own): loading the profile, the report
        console.print("[bold red]error:[/] interrupted", highlight=False)
        raise typer.Exit(130) from None


def _dry_run(runner, prof, *, quiet: bool) -> None:  # type: ignore[no-untyped-def]
    """``abbench run --dry-run``: the run's preflight in a scratch directory, removed again; its progress lines
    (quiet: the warnings alone), then one line saying it passed."""
    import tempfile

    from rich.markup import escape

    def observe(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.kind == "warning":
            console.print(f"[yellow]warning:[/] {escape(ev.message)}", highlight=False)
        elif not quiet:
            console.print(ev.message, highlight=False, markup=False)

    with tempfile.TemporaryDirectory(prefix="abbench-dry-run-") as scratch:
        runner.execute(prof, Path(scratch) / "run", observer=observe, check_only=True, argv=sys.argv[:])
    arms = ", ".join(a.name for a in prof.arms)
    out.print(f"dry run: {prof.name}: every arm's service passed the run's checks ({arms}); nothing was launched or "
              "measured", highlight=False)
