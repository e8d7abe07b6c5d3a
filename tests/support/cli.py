"""``abbench ARGS`` in the test's own process (typer's ``CliRunner``), answered in the shape of
``subprocess.run``'s result: ``returncode``, ``stdout``, ``stderr``.

For the commands that read results and write reports (report, gate, compare, diff, export, ...) and for runs
refused before anything starts: the test is about what the command says and writes, not about a process of its
own. In-process, such a call costs no interpreter start-up and no second import of pandas, matplotlib and the
tokenizer (2-4 s a call on a loaded 2-core machine). Tests about the process itself (signals, exit of a killed
run, a child that must not outlive it, what a fresh interpreter imports) keep ``python -m abbench`` in a
subprocess (:func:`tests.support.faultkit.abbench`).

Like the subprocess helpers, the terminal is 400 columns wide with no colour, the working directory is ``cwd``
for the call, and an exception the CLI did not handle is a non-zero exit whose traceback is in ``stderr``.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner


@dataclass
class Result:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would have answered."""
    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def abbench(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> Result:
    """Run ``abbench ARGS`` in this process, from ``cwd`` (this process's directory is restored after)."""
    from abbench.cli import app

    chdir = contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext()
    with chdir:
        r = CliRunner().invoke(app, list(args), env={"COLUMNS": "400", "NO_COLOR": "1", **(env or {})})
    stderr = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        stderr += "".join(traceback.format_exception(r.exception))
    return Result(["abbench", *args], r.exit_code, r.stdout, stderr)
