"""Helpers shared by the fault tests: profiles that launch tests/support/fakeserver.py as the engine service, a tiny
TOML writer (profiles go through the real CLI), the ``abbench`` command as a subprocess, and a way to find
every process a test started, whatever became of its parent.

Leftover detection: every service a test launches gets ``ABBENCH_TEST_MARK=<unique>`` in its environment
(``engine.env``); :func:`marked_processes` scans ``/proc`` for it, so a service that outlived abbench (or was
reparented to init) is found even though nobody holds its pid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
FAKESERVER = Path(__file__).resolve().with_name("fakeserver.py")
FAKE_ENGINES = Path(__file__).resolve().with_name("fake_engines.py")


def new_mark() -> str:
    return f"faults-{uuid.uuid4().hex[:12]}"


def fake_profile(mark: str, *, name: str = "faults", args: tuple[str, ...] = (), arms: list[dict] | None = None,
                 prompts: dict | None = None, request: dict | None = None, run: dict | None = None,
                 engine: dict | None = None) -> dict[str, Any]:
    """A small profile whose engine is tests/support/fakeserver.py counting tokens with the qwen3 vocabulary (so
    the harness's exact-length prompts match ``usage.prompt_tokens``)."""
    command = [sys.executable, str(FAKESERVER), "--port", "{port}", "--tokenizer", "qwen3", *args]
    return {
        "name": name,
        "tokenizer": {"source": "qwen3"},
        "prompts": {"lengths": [24], "per_length": 1, "warmup": 1, "warmup_tokens": 16, **(prompts or {})},
        "request": {"max_tokens": 4, "logprobs": 2, "timeout_s": 10, **(request or {})},
        "engine": {"command": command, "env": {"ABBENCH_TEST_MARK": mark}, "health_timeout_s": 15,
                   "stop_timeout_s": 5, **(engine or {})},
        "arms": arms or [{"name": "a"}],
        "run": {"rounds": 1, **(run or {})},
    }


# ------------------------------------------------------------------------------------------------ TOML


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for everything these profiles hold
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def to_toml(profile: dict[str, Any]) -> str:
    """TOML for a profile dict: top-level scalars, one table per section, ``[[arms]]``."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in profile.items() if not isinstance(v, (dict, list))
             or (isinstance(v, list) and not (v and isinstance(v[0], dict)))]
    for k, v in profile.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                lines += ["", f"[[{k}]]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in item.items()]
    return "\n".join(lines) + "\n"


def write_profile(path: Path, profile: dict[str, Any] | str) -> Path:
    path.write_text(profile if isinstance(profile, str) else to_toml(profile), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ processes


def abbench(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m abbench ARGS`` to completion; wide terminal so messages are not wrapped mid-word."""
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "abbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def abbench_popen(*args: str, cwd: Path, out: Path) -> subprocess.Popen[bytes]:
    """``python -m abbench ARGS`` in the background; stdout and stderr go to ``out`` (no pipe to fill)."""
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
    with open(out, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "abbench", *args], cwd=cwd, stdout=f,
                                stderr=subprocess.STDOUT, env=env)


def flat(text: str) -> str:
    """Whitespace collapsed (rich may still wrap long words)."""
    return " ".join(text.split())


def marked_processes(mark: str) -> list[psutil.Process]:
    """Running (not zombie) processes whose environment carries ``ABBENCH_TEST_MARK=mark``."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("ABBENCH_TEST_MARK") == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def assert_no_leftovers(mark: str, grace_s: float = 2.0) -> None:
    """No process of this test is left (a grace period for the kernel to finish an exit)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = marked_processes(mark)
        if not left:
            return
        if time.monotonic() > deadline:
            desc = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left]
            for p in left:  # do not leak into the next test
                try:
                    p.kill()
                except psutil.Error:
                    pass
            raise AssertionError(f"processes left behind: {desc}")
        time.sleep(0.05)


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def jsonl_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of requests.jsonl, parsed (fails on any line that is not JSON, torn ones included)."""
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "requests.jsonl does not end with a newline (torn last line)"
    return [json.loads(line) for line in data.splitlines() if line.strip()]
