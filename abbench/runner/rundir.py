"""The run directory: refused before anything is built when it cannot take a new run
(:func:`check_run_dir_free`), created and locked with its log opened (:func:`open_log`), reopened for a resume
(:func:`load_for_resume`), removed when nothing was measured (:func:`discard_unmeasured`), and the command that
finishes a partial run (:func:`resume_hint`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path

from abbench.errors import ConfigError, ResultsError
from abbench.results import LOGS_DIR, RUN_FILE, SAMPLES_FILE, RunRecord, SampleLog, load_run, save_run
from abbench.runner.lock import LOCK_FILE, RunLock


def resume_hint(run_dir: Path) -> str:
    """How to finish a partial run: the exact command, its path quoted for the shell."""
    return f"resume it with `abbench run --resume {shlex.quote(str(run_dir))}`"


def discard_unmeasured(run_dir: Path) -> Path | None:
    """Remove a new run that ended before its first sample (a server that is not there, a service that never
    started, Ctrl-C while starting): a partial run that holds nothing would only become "the latest run" that
    ``report`` and ``gate`` pick. The logs of launched services stay (an error names them); returns their
    folder, or None when there is none and the run directory itself is gone."""
    for name in (RUN_FILE, SAMPLES_FILE, LOCK_FILE):
        (run_dir / name).unlink(missing_ok=True)
    logs = run_dir / LOGS_DIR
    try:
        if logs.is_dir() and any(logs.iterdir()):
            return logs
        logs.rmdir()
        run_dir.rmdir()
    except OSError:  # something else is there: leave it
        pass
    return None


def load_for_resume(run_dir: Path, lock: RunLock, warn: Callable[[str], None], *, keep_failed: bool) -> RunRecord:
    """The run in ``run_dir``, locked for resuming (the problems its files had are warned about): a partial run,
    or a complete one with failed samples to run again (not ``keep_failed``)."""
    if (run_dir / RUN_FILE).is_file():
        try:
            lock.acquire()
        except OSError as e:
            raise ResultsError(f"{run_dir}: cannot lock the run for resuming: {e}") from None
    existing, problems = load_run(run_dir)
    for problem in problems:
        warn(f"resuming {run_dir}: {problem}")
    failed = sum(1 for s in existing.samples if not s.ok)
    if existing.status == "complete" and (keep_failed or not failed):
        raise ResultsError(f"{run_dir}: this run is already complete; nothing to resume"
                           + (f" (its {failed} failed sample(s) are kept with --keep-failed)" if failed else ""))
    return existing


def open_log(run_dir: Path, record: RunRecord, lock: RunLock, *, resume: bool) -> SampleLog:
    """Create the run directory, take the lock (a new run), save run.json and open requests.jsonl."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / LOGS_DIR).mkdir(exist_ok=True)
        if not resume:
            lock.acquire()
        save_run(run_dir, record)
        return SampleLog(run_dir)
    except OSError as e:
        raise ConfigError(f"run directory {run_dir}: cannot write there ({e.strerror or e}); choose another "
                          "--out") from None


def check_run_dir_free(run_dir: Path) -> None:
    """Refuse, before any prompt is built, a ``--out`` that holds a run or that cannot become a directory (a file
    there, or a file or an unwritable folder on the way): the same errors opening the run would give later."""
    if (run_dir / "run.json").exists():
        raise ConfigError(f"--out {run_dir}: a run already exists there; choose another directory or use --resume")
    where = run_dir
    while not where.exists() and where.parent != where:
        where = where.parent  # the nearest part of the path that exists
    blocked = (f"{where} is a file" if not where.is_dir()
               else None if os.access(where, os.W_OK | os.X_OK) else f"{where} is not writable")
    if blocked:
        raise ConfigError(f"run directory {run_dir}: cannot write there ({blocked}); choose another --out")
