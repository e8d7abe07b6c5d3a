"""Launch llama.cpp's ``llama-server`` on the GGUF of the vendored engine's own weights (a profile's command).

    {python} -m abbench.peers.llamacpp_serve --model tiny --weights random:0 --dtype float32 \\
        -- --host 127.0.0.1 --port {port} -np 1 ...        # everything after -- goes to llama-server

Contract
--------
* The binary is ``$ABBENCH_LLAMA_SERVER`` (a path), else ``llama-server`` on ``PATH``; neither is an error
  (exit 2) naming the variable and the recipe (:mod:`abbench.peers.llamacpp_build`).
* The GGUF is ``--gguf PATH`` if given, else :func:`gguf_cache_path` (under ``$ABBENCH_CACHE_DIR`` or
  ``~/.cache/abbench``, named by model, weights, dtype, device type and exporter version), exported with
  :func:`abbench.peers.gguf_export.export_gguf` on first use under a file lock (a big model is better
  exported beforehand with ``abbench export-gguf``, which writes the same path when ``--out`` is left out).
* It prints one ``abbench-peer:`` JSON line (binary, its build record, the GGUF, the library directories it
  added) to stdout, then replaces itself with ``llama-server -m GGUF ARGS...`` (``os.execve``: the service's
  process is the server). For a CUDA build (its record says ``cuda``) the running Python's CUDA wheel library
  directories go ahead of ``LD_LIBRARY_PATH`` (:func:`_library_env`): a CUDA server built on another machine
  links ``libcudart``/``libcublas`` dynamically and finds torch's own copies.
* :func:`describe` is what the run's fingerprint records for such a command (``peers``): the binary, its
  build record (``llama-server.build.json``: llama.cpp commit, CMake flags, compilers) and the GGUF's
  identity; also for a plain ``llama-server`` command.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from abbench.peers.wrapper import parse_recorded, split_passthrough

__all__ = ["SERVER_ENV", "describe", "gguf_cache_path", "main", "resolve_server"]

SERVER_ENV = "ABBENCH_LLAMA_SERVER"
MODULE = "abbench.peers.llamacpp_serve"


def resolve_server() -> str | None:
    """The llama-server binary: $ABBENCH_LLAMA_SERVER if set (and executable), else llama-server on PATH."""
    env = os.environ.get(SERVER_ENV)
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    return shutil.which("llama-server")


def gguf_cache_path(model: str, weights: str, dtype: str, device: str) -> Path:
    from abbench.peers.gguf_export import EXPORTER_VERSION
    from abbench.tokenizers import default_cache_dir

    dev = device.split(":", 1)[0]
    name = f"{model}-{weights.replace(':', '')}-{dtype}-{dev}-v{EXPORTER_VERSION}.gguf"
    return default_cache_dir() / "gguf" / name


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                 description="Start llama-server on the GGUF of the vendored engine's random "
                                             "weights (exported on first use); arguments after -- go to llama-server.")
    ap.add_argument("--model", required=True, help="the engine's preset (e.g. tiny, qwen3-30b-a3b-half)")
    ap.add_argument("--weights", default="random:0", help="random:SEED (default random:0)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="device the weights are drawn on (cpu or cuda): the one the "
                                                    "vendored engine runs on")
    ap.add_argument("--gguf", type=Path, default=None, help="use this GGUF instead of the cache path")
    ap.add_argument("--print-gguf-path", action="store_true", help="print the GGUF path and exit")
    return ap


def _gguf_path(args: argparse.Namespace) -> Path:
    return args.gguf or gguf_cache_path(args.model, args.weights, args.dtype, args.device)


def _ensure_gguf(args: argparse.Namespace) -> Path:
    path = _gguf_path(args)
    if path.is_file() or args.gguf is not None:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            from abbench.peers.gguf_export import export_gguf

            print(f"abbench-peer: exporting {path}", file=sys.stderr, flush=True)
            export_gguf(args.model, path, weights=args.weights, dtype=args.dtype, device=args.device)
    return path


def _gguf_identity(path: Path) -> dict[str, Any]:
    """The abbench.* provenance keys of a GGUF (reads its metadata only)."""
    out: dict[str, Any] = {"path": str(path)}
    try:
        from gguf import GGUFReader

        r = GGUFReader(str(path))
        for name, field in r.fields.items():
            if name.startswith("abbench.") or name in ("general.architecture", "general.file_type"):
                out[name] = field.contents()
    except Exception as e:  # an unreadable file is recorded as such, never raised from a fingerprint
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def describe(argv: list[str]) -> dict[str, Any] | None:
    """What a run records about a llama.cpp service command (None if ``argv`` is not one)."""
    from abbench.peers.llamacpp_build import read_build_info

    if MODULE in argv:
        args, error = parse_recorded(argv, MODULE, _parser())
        if args is None:
            return error
        binary = resolve_server()
        gguf = _gguf_path(args)
        return {"llama_server": binary, "build": read_build_info(binary) if binary else None,
                "gguf": _gguf_identity(gguf) if gguf.is_file() else {"path": str(gguf), "exists": False}}
    if argv and os.path.basename(argv[0]) == "llama-server":
        binary = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0])
        return {"llama_server": binary, "build": read_build_info(binary) if binary else None}
    return None


def main(argv: list[str] | None = None) -> int:
    own, server_args = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(own)
    if args.print_gguf_path:
        print(_gguf_path(args))
        return 0
    binary = resolve_server()
    if binary is None:
        where = os.environ.get(SERVER_ENV)
        print(f"error: no llama-server: {SERVER_ENV}={where!r} is not an executable file" if where else
              f"error: no llama-server on PATH and {SERVER_ENV} is unset; build one with "
              "python -m abbench.peers.llamacpp_build (see docs/llamacpp.md)", file=sys.stderr)
        return 2
    gguf = _ensure_gguf(args)
    if not gguf.is_file():
        print(f"error: GGUF {gguf} does not exist", file=sys.stderr)
        return 2
    from abbench.peers.llamacpp_build import read_build_info

    build = read_build_info(binary)
    env, added = _library_env(build)
    print("abbench-peer: " + json.dumps({"llama_server": binary, "build": build, "gguf": _gguf_identity(gguf),
                                         "ld_library_path_added": added}), flush=True)
    os.execve(binary, [binary, "-m", str(gguf), *server_args], env)
    return 0  # not reached


def _library_env(build: dict | None) -> tuple[dict[str, str], list[str]]:
    """The server's environment: for a CUDA build, the running Python's CUDA wheel library directories
    (``libcudart``, ``libcublas``: :func:`abbench.peers.llamacpp_cuda.runtime_library_dirs`) ahead of
    ``LD_LIBRARY_PATH``, so a binary built elsewhere finds the ones torch uses here. Returns (env, added)."""
    from abbench.peers.llamacpp_cuda import runtime_library_dirs, with_library_dirs

    if not (build or {}).get("cuda"):
        return dict(os.environ), []
    return with_library_dirs(dict(os.environ), runtime_library_dirs())


if __name__ == "__main__":
    sys.exit(main())
