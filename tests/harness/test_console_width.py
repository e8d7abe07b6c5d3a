"""Piped output is not wrapped at 80 columns: with stdout/stderr not a terminal and ``COLUMNS`` unset, a long
message stays on one line (grep and CI logs read it whole); ``COLUMNS`` still sets the width."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _compare_refused(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "abbench", "compare", "results/readme-cpu-tiny",
                           "results/cpu-tiny-auto"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def test_a_long_error_is_one_line_when_piped() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    res = _compare_refused(env)
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and len(lines[0]) > 120, res.stderr
    assert lines[0].startswith("error: the runs are of different profiles") and lines[0].endswith("report)")


def test_columns_still_sets_the_width() -> None:
    res = _compare_refused({**os.environ, "COLUMNS": "60"})
    assert res.returncode == 2 and max(len(x) for x in res.stderr.splitlines()) <= 60, res.stderr
