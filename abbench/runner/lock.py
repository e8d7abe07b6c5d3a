"""The run's lock: :class:`RunLock`, an exclusive ``flock`` on ``run_dir/run.lock`` while a run executes (a
second ``abbench run --resume`` of the same directory fails at once). The run's signal handling is
:mod:`abbench.signals`."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from abbench.errors import ResultsError

LOCK_FILE = "run.lock"


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
