"""Which test files execute which lines of ``abbench/``: a coverage map of the whole suite, for the mutation
audit's second stage (a mutant can only be caught by a test that runs its line, so "the whole suite" and
"every test file that runs the mutated line" catch the same mutants; the second costs minutes, not hours).

:func:`build` runs the whole suite once in the audit's copy under ``coverage`` with one dynamic context per
test (its node id), in the pytest processes and in every Python process they start (the copy gets a
``sitecustomize.py`` that starts coverage in a process whose environment names a coverage config, and a
pytest plugin that names the running test in the environment the test's subprocesses inherit): engine
services and ``python -m abbench`` runs are counted for the test that started them. The result maps each
source file (relative path) and line to the test files whose tests ran it; a whole file is kept, not one
test, because a module fixture started for the file's first test serves the others too.

Needs ``coverage`` (in the project's ``test`` extra). Lines run only in a process that was killed (SIGKILL)
are not seen; tests that read the source without running it (the import-structure test) are not in the map.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

RC = """[run]
parallel = True
source = abbench
sigterm = True
data_file = {data}
"""

SITECUSTOMIZE = '''"""Written by tests/audit/coverage_map.py into the audit's copy; removed when the map is built."""
import os

if os.environ.get("COVERAGE_PROCESS_START"):
    try:
        import coverage
    except ImportError:
        coverage = None
    if coverage is not None:
        coverage.process_startup()
        _cov = coverage.Coverage.current()
        _ctx = os.environ.get("ABBENCH_AUDIT_CONTEXT")
        if _cov is not None and _ctx:
            _cov.switch_context(_ctx)
'''

PLUGIN = '''"""Written by tests/audit/coverage_map.py: each test's node id is the coverage context of what it runs,
here and in the processes it starts."""
import os

import coverage
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    os.environ["ABBENCH_AUDIT_CONTEXT"] = item.nodeid
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(item.nodeid)
    yield
    os.environ.pop("ABBENCH_AUDIT_CONTEXT", None)
'''

HELPERS = ("sitecustomize.py", "audit_contexts.py", ".audit-coveragerc")

Map = dict[str, dict[int, list[str]]]


def build(copy: Path, env: dict[str, str], cmd: list[str], timeout: float) -> tuple[Map, str]:
    """Run ``cmd`` (the whole suite, from the copy) under coverage; returns the map and a line about the run."""
    import coverage

    data = copy / ".audit-coverage" / "cov"
    data.parent.mkdir(exist_ok=True)
    (copy / ".audit-coveragerc").write_text(RC.format(data=data), encoding="utf-8")
    (copy / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    (copy / "audit_contexts.py").write_text(PLUGIN, encoding="utf-8")
    run_env = {**env, "COVERAGE_PROCESS_START": str(copy / ".audit-coveragerc")}
    t0 = time.monotonic()
    try:
        res = subprocess.run([*cmd, "-p", "audit_contexts"], cwd=copy, env=run_env, capture_output=True, text=True,
                             timeout=timeout)
        tail = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
        subprocess.run([sys.executable, "-m", "coverage", "combine", "-q", f"--rcfile={copy / '.audit-coveragerc'}"],
                       cwd=copy, env=env, check=True, capture_output=True)
        cov_data = coverage.CoverageData(basename=str(data))
        cov_data.read()
        out: Map = {}
        root = str(copy) + os.sep
        for measured in cov_data.measured_files():
            if not measured.startswith(root):
                continue
            by_line = cov_data.contexts_by_lineno(measured)
            rel = measured[len(root):]
            out[rel] = {line: sorted({c.split("::")[0] for c in ctxs if c}) for line, ctxs in by_line.items()}
    finally:
        for name in HELPERS:
            (copy / name).unlink(missing_ok=True)
    return out, f"coverage map of the suite in {time.monotonic() - t0:.0f} s: {tail}"


def tests_for(cmap: Map, rel: str, lines: range) -> list[str]:
    """The test files that ran any of ``lines`` of ``rel``."""
    by_line = cmap.get(rel, {})
    return sorted({f for line in lines for f in by_line.get(line, [])})


def save(cmap: Map, path: Path) -> None:
    path.write_text(json.dumps({rel: {str(k): v for k, v in lines.items()} for rel, lines in cmap.items()}))


def load(path: Path) -> Map:
    raw = json.loads(path.read_text())
    return {rel: {int(k): v for k, v in lines.items()} for rel, lines in raw.items()}
