"""The run lock (abbench.runner.lock.RunLock): one process holds a run at a time, a run that ends keeps no
``run.lock``, and a file left by a process that died is locked again by the next one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from abbench.errors import ResultsError
from abbench.runner.lock import LOCK_FILE, RunLock


def test_a_released_lock_leaves_no_file_and_a_held_one_refuses_a_second(tmp_path: Path) -> None:
    first = RunLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).read_text() == str(os.getpid())
    with pytest.raises(ResultsError, match=f"another abbench process \\(pid {os.getpid()}\\) is running this run"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    again = RunLock(tmp_path).acquire()  # free again
    again.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_file_left_by_a_dead_holder_is_locked_again(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text("999999")  # a process killed while holding it: the kernel dropped its flock
    lock = RunLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).read_text() == str(os.getpid())
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
