"""SIGINT and SIGTERM around the statements that must not be torn apart (no import of the package: the services
below the runner use it too).

* :func:`signals_as_interrupt`: SIGTERM becomes ``KeyboardInterrupt`` for the duration of a run.
* :func:`signals_deferred`: during teardown SIGINT/SIGTERM are noted, not raised.
* :func:`signals_held`: a few statements run whole; a signal meanwhile is raised as ``KeyboardInterrupt`` after them
  (a sample written to both files; a service's process started and registered for teardown).

Each is a no-op outside the main thread, where Python delivers no signal.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into KeyboardInterrupt in the main thread for the duration of a run. SIGINT
    gets a handler of our own too: a parent that ignores it (``nohup``, a shell's background job, some CI
    runners) passes SIG_IGN down, and Python then installs no KeyboardInterrupt handler, so Ctrl-C or
    ``kill -INT`` would be ignored and the run would go on to the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, handler)
    old_int = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


@contextmanager
def signals_deferred() -> Iterator[list[int]]:
    """While tearing down: SIGINT/SIGTERM are noted (in the yielded list), not raised, so a second Ctrl-C
    cannot abort the teardown half-way and leave an engine running or run.json unsaved."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def note(signum: int, frame: object) -> None:
        got.append(signum)

    old_int = signal.signal(signal.SIGINT, note)
    old_term = signal.signal(signal.SIGTERM, note)
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


@contextmanager
def signals_held() -> Iterator[None]:
    """A few statements that must not be split by SIGINT/SIGTERM (a sample written to requests.jsonl and
    kept for run.json): a signal meanwhile is held and raised as KeyboardInterrupt right after them."""
    with signals_deferred() as got:
        yield
    if got:
        raise KeyboardInterrupt(f"signal {got[0]}")
