"""The run's lock and its signal handling.

* :class:`RunLock`: an exclusive ``flock`` on ``run_dir/run.lock`` while a run executes (a second
  ``abbench run --resume`` of the same directory fails at once).
* :func:`signals_as_interrupt`: SIGTERM becomes ``KeyboardInterrupt`` for the duration of a run.
* :func:`signals_deferred`: during teardown SIGINT/SIGTERM are noted, not raised.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from abbench.errors import ResultsError

LOCK_FILE = "run.lock"


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


class RunLock:
    """An exclusive ``flock`` on ``run_dir/run.lock`` held while a run executes, so a second ``abbench run
    --resume`` of the same directory fails at once instead of interleaving samples. The kernel drops the
    lock when the process dies, however it dies (a file left then is locked again by the next run); a run that
    ends removes the file."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        while True:
            fd = self._lock()
            try:  # the holder removes the file as it lets go: a lock on a file no longer there is no lock
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def _lock(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ResultsError(
                    f"{self.path.parent}: another abbench process{f' (pid {holder})' if holder else ''} is "
                    "running this run; wait for it to end (or stop it) before resuming"
                ) from None
            raise
        return fd

    def release(self) -> None:
        """Let go: the file is removed while the lock is still held (so a finished run keeps no ``run.lock``),
        then the descriptor is closed, which drops the flock."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(fd)
