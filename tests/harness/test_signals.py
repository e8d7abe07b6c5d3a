"""SIGINT stops ``abbench run`` whoever started it.

A parent that ignores SIGINT (``nohup``, a shell's background job, some CI runners and job systems) hands
SIG_IGN down to its children, and Python then installs no KeyboardInterrupt handler: without a handler of
abbench's own, Ctrl-C or ``kill -INT`` would be ignored and the run would go on to the end. Each test
launches ``abbench run`` with SIGINT explicitly ignored or explicitly default in the child (so the result
does not depend on how pytest itself was started), waits for a marker (samples on disk), never a sleep,
then signals it: exit 130, a valid partial run, no service left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import faultkit as fk

RUN_FILE, SAMPLES_FILE = "run.json", "requests.jsonl"


def _launch(args: list[str], cwd: Path, out: Path, sigint: signal.Handlers) -> subprocess.Popen[bytes]:
    def child() -> None:  # runs in the child between fork and exec, as a parent's disposition would
        signal.signal(signal.SIGINT, sigint)

    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
    with open(out, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "abbench", *args], cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=child)


@pytest.mark.parametrize("parent", [signal.SIG_IGN, signal.SIG_DFL], ids=["parent-ignores-SIGINT", "parent-default"])
def test_sigint_stops_the_run_whatever_the_parent_did(tmp_path: Path, parent: signal.Handlers) -> None:
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, args=("--token-delay", "0.05"), arms=[{"name": "a"}, {"name": "b"}],
                           prompts={"per_length": 3}, run={"rounds": 2})
    toml = fk.write_profile(tmp_path / "p.toml", prof)
    run_dir = tmp_path / "run"
    out = tmp_path / "out.txt"
    proc = _launch(["run", "-p", str(toml), "--out", str(run_dir), "-q", "--no-report"], tmp_path, out, parent)
    try:
        jsonl = run_dir / SAMPLES_FILE
        fk.wait_for(lambda: jsonl.exists() and jsonl.read_bytes().count(b"\n") >= 3 or proc.poll() is not None,
                    timeout=120, what="three samples on disk")
        assert proc.poll() is None, out.read_text()
        assert fk.marked_processes(mark), "no service running at the moment of the signal"
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert rc == 130, text
    assert "interrupted" in fk.flat(text) and f"abbench run --resume {run_dir}" in fk.flat(text)
    fk.assert_no_leftovers(mark, grace_s=0.5)  # torn down before abbench exited
    raw = json.loads((run_dir / RUN_FILE).read_text())
    assert raw["status"] == "partial" and raw["status_reason"] == f"interrupted (signal {int(signal.SIGINT)})"
    lines = fk.jsonl_lines(jsonl)  # every line whole
    assert [x["step"] for x in lines] == [s["step"] for s in raw["samples"]]
    assert 3 <= len(lines) < len(raw["plan"])
    assert all(s["stopped_at"] is not None and s["exit_code"] is not None for s in raw["services"])

