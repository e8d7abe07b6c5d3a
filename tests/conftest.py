"""Shared test setup.

Layout: ``tests/harness/`` tests the harness (everything outside ``abbench.engine``), ``tests/engine/`` the
vendored engine, and ``tests/support/`` holds what tests use but are not tests themselves: fake engines and
servers on loopback, the fault kit, helper processes. Tests import the support modules as a package
(``from tests.support import fake_engines``); this file makes the repository root importable for that,
wherever pytest is started from (``pyproject.toml`` sets ``pythonpath = ["."]`` for the usual case).

Order: the test files run longest first, by the seconds each took in a recorded run (``tests/durations.json``;
a file not in it counts as the median one); a file's own tests keep their order. With ``--dist loadfile``
and ``--no-loadscope-reorder`` (``pyproject.toml``) xdist hands the files to its workers in that order, so the
long end-to-end files start at once and the short ones fill in the gaps at the end instead of one long file
keeping a worker busy after the other ran out of work. ``--store-durations`` writes this run's seconds per file
into ``tests/durations.json`` (with xdist, from the reports the workers send back).

Workers: ``-n auto`` starts one more than there are cores (:func:`pytest_xdist_auto_num_workers`); each worker
(and every engine process it starts) computes on ``cores // workers`` threads, at least one
(``OMP_NUM_THREADS``, :func:`pytest_configure`), not on every core.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DURATIONS = Path(__file__).resolve().with_name("durations.json")
"""Seconds per test file (path from the repository root) in a recorded run of the whole suite."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true", default=False,
                     help=f"write the seconds each test file took in this run into {DURATIONS.relative_to(REPO)} "
                          "(the order the files run in: longest first)")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (``pyproject.toml``'s addopts): one worker more than cores. Many end-to-end tests spend part of
    their time waiting (a service starting, a timeout that must pass, a fake server's token delay); the extra
    worker fills those waits. On the idle 2-core machine the suite took 299 s with 3 workers against 345 s with 2,
    with the same CPU time (e295147); a second run with 3 took 344 s, its CPU time 16% higher."""
    return _cores() + 1


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker on a machine with no more cores than workers computes on one thread: torch's intra-op
    threads (OpenMP) default to every core, so N workers (and the engine processes they start, which inherit
    the variable) would each spin N threads on N cores, and a CPU test then took several times as long as it
    does alone. Set before anything imports torch; an ``OMP_NUM_THREADS`` already set is kept."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 0))
    if workers:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // workers)))


def file_costs() -> dict[str, float]:
    """``tests/durations.json``: test file -> seconds; empty where there is none or it cannot be read."""
    try:
        costs = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in costs.items()} if isinstance(costs, dict) else {}


def longest_first(items: list[pytest.Item], costs: dict[str, float]) -> list[pytest.Item]:
    """``items`` with their files in descending recorded seconds (a file not recorded: the median's); stable,
    so each file's tests stay together and in their order, and files of equal cost keep theirs."""
    if not costs:
        return items
    default = statistics.median(costs.values())

    def cost(item: pytest.Item) -> float:
        return -costs.get(_relpath(item), default)

    return sorted(items, key=cost)


def _relpath(item: pytest.Item) -> str:
    try:
        return Path(item.path).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(item.path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = longest_first(items, file_costs())


_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not config.getoption("store_durations") or hasattr(config, "workerinput"):
        return  # a worker's own reports also reach the controller, which writes the file
    recorded = {k: v for k, v in file_costs().items() if (REPO / k).is_file()}
    recorded.update({k: round(v, 1) for k, v in _seconds.items()})
    DURATIONS.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


@pytest.fixture(autouse=True)
def _signal_handlers_kept():
    """A test leaves SIGINT's and SIGTERM's handlers as it found them: a handler left behind (an interrupted
    run's, a test's own) changes what a later test in the same worker sees of a signal (asyncio's runner, for one,
    takes SIGINT only where Python's default handler is in place)."""
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    left = {s.name: h for s, h in ((s, signal.getsignal(s)) for s in before) if h is not before[s]}
    for s, h in before.items():
        signal.signal(s, h)
    assert not left, f"the test left signal handlers behind: {left}"
