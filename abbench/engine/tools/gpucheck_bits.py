"""Does the engine give the same bits every time, and how far apart are two configurations?

``python -m abbench.engine.tools.gpucheck_bits [--model qwen3.5-35b-a3b] [--layers 8] [--tokens 4096,32768]
[--engines NAME:field=value,... ...] [--repeats 2] [--processes 2] [--autotune-cache on|off]``

For each engine (an ``EngineConfig`` over the preset's first ``--layers`` layers, random weights; ``NAME:`` then
``field=value`` pairs, e.g. ``resident-fp8:prefill_mode=resident,expert_dtype=fp8``), one random prompt per
length, ``--repeats`` greedy requests of ``--max-tokens`` each (the prefix cache flushed before each), with the
first output position's log-probabilities over the whole vocabulary (``full_logprobs``). It prints, per engine
and length:

- whether every repeat in the process gave the same row (a SHA-256 of its bytes) and the same ids;
- with ``--processes N``: the same in N processes of its own, one after another, each against the first;
- against the first engine (process 0, first repeat): the whole-vocabulary KL(first || this) in nats, the
  largest difference of a log-probability, the first id that differs and whether the top id is the same.

Separate processes can differ where one process cannot: Triton's autotuner times its candidate configs in a
process and keeps the fastest, and fla's gated delta rule kernels are autotuned (``abbench.engine.ops.gdn``).
fla keeps the choices in Triton's on-disk cache by default (``FLA_CACHE_RESULTS=1``), so later processes on a
machine reuse them. ``--autotune-cache on`` runs the processes with that cache (``FLA_CACHE_RESULTS=1``,
``TRITON_CACHE_AUTOTUNING=1``) in one fresh ``TRITON_CACHE_DIR`` for all of them, ``off`` without it (both 0:
each process tunes for itself); ``TRITON_PRINT_AUTOTUNING=1`` in the environment prints each process's picks.
The KL between two engines that should agree up to rounding (another chunk length: another summation order) is
the yardstick of a model's sensitivity: a random-weight model carries a small change further than a trained one.
``--depth N`` builds the preset with N layers (its layer kinds continued in their pattern) to see how that grows
with depth: on CPU the tiny hybrid's whole-vocabulary KL of FP8 experts grows with its layers (docs/fp8.md).

Writes every figure to ``--out`` (JSON). Exit status 1 when repeats or processes of one engine disagree, 2 when a
process fails.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from abbench.engine.config import PRESETS, EngineConfig
from abbench.engine.tools import release


def parse_engine(spec: str) -> tuple[str, dict]:
    """``NAME:field=value,field=value`` -> (NAME, {field: value}); values read as int, float, true/false or text.
    ValueError for a field ``EngineConfig`` does not have."""
    name, _, rest = spec.partition(":")
    fields = {}
    for pair in filter(None, rest.split(",")):
        key, eq, raw = pair.partition("=")
        if not eq or key not in EngineConfig.__dataclass_fields__:
            raise ValueError(f"engine {name!r}: {pair!r} is not FIELD=VALUE of an EngineConfig field")
        value: object = raw
        for conv in (int, float):
            try:
                value = conv(raw)
                break
            except ValueError:
                pass
        if raw in ("true", "false"):
            value = raw == "true"
        fields[key] = value
    if not name:
        raise ValueError(f"engine spec {spec!r} has no name")
    return name, fields


def deepen(mc, n: int):
    """``mc`` with ``n`` layers, its layer kinds continued in their pattern (random weights have no depth of their
    own): how far a model carries the same rounding as it gets deeper. ValueError for Qwen4-Exp (its PLE layers)."""
    import dataclasses

    if mc.is_qwen4:
        raise ValueError("--depth does not extend Qwen4-Exp (its PLE layers are a list of their own)")
    extra = {"layer_types": tuple(mc.layer_types[i % len(mc.layer_types)] for i in range(n))} if mc.is_hybrid else {}
    return dataclasses.replace(mc, num_hidden_layers=n, name=f"{mc.name}-{n}l", **extra)


def model_and_engines(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, list[tuple[str, dict]]]:
    """A check's ``--model`` (default: the hybrid on CUDA, its tiny preset on CPU) and parsed ``--engines``; the
    parser's error (exit 2) for an unknown preset or a bad spec."""
    model = args.model or ("qwen3.5-35b-a3b" if args.device == "cuda" else "qwen3.5-tiny")
    if model not in PRESETS:
        p.error(f"--model: one of {', '.join(PRESETS)}, got {model!r}")
    try:
        return model, [parse_engine(s) for s in args.engines]
    except ValueError as exc:
        p.error(str(exc))
        raise  # (p.error exits)


def _row(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").astype(np.float64)


def kl(ref: np.ndarray, other: np.ndarray) -> float:
    """KL(ref || other) in nats over the whole vocabulary, from two log-probability rows (float64)."""
    p = np.exp(ref)
    live = p > 0
    return max(float(np.sum(p[live] * (ref[live] - other[live]))), 0.0)


def run_process(model: str, layers: int | None, depth: int | None, lengths: list[int],
                engines: list[tuple[str, dict]], repeats: int, max_tokens: int, device: str,
                rows_dir: Path) -> list[dict]:
    """This process's requests (module docstring): one record per engine, length and repeat, each first repeat's
    row saved to ``rows_dir/NAME-LENGTH-0.npy``."""
    from abbench.engine.runtime.engine import Engine

    mc = PRESETS[model]
    if layers:
        mc = mc.first_layers(layers, name=f"{mc.name}-{layers}l")
    if depth:
        mc = deepen(mc, depth)
    cuda = device == "cuda"
    base = dict(model=mc, weights="random:0", device=device, dtype="bfloat16" if cuda else "float32",
                max_context=max(lengths) + max_tokens + 8, layer_major_window_tokens=max(max(lengths), 2048),
                bandwidth_probe_bytes=0)
    out = []
    for name, fields in engines:
        engine = Engine(EngineConfig(**{**base, **fields}))
        for n in lengths:
            prompt = torch.randint(10, mc.vocab_size - 10, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for r in range(repeats):
                engine.reset()
                events, stats = engine.run(prompt, max_tokens, full_logprobs=True)
                row = _row(stats.full_logprobs)
                if r == 0:  # the rows compared (``compare``); the others by their hash
                    np.save(rows_dir / f"{name}-{n}-{r}.npy", row)
                out.append({"engine": name, "tokens": n, "repeat": r, "path": stats.prefill_path,
                            "sha": hashlib.sha256(row.tobytes()).hexdigest()[:16],
                            "ids": [e.token_id for e in events]})
        del engine
        release(cuda)
    return out


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(processes: list[list[dict]], dirs: list[Path]) -> tuple[list[dict], bool]:
    """One line per engine and length: repeats and processes against process 0's first repeat, and that row
    against the first engine's; and whether every engine agreed with itself everywhere."""
    first = processes[0]
    engines = list(dict.fromkeys(r["engine"] for r in first))
    lines, ok = [], True
    for name in engines:
        for n in sorted({r["tokens"] for r in first if r["engine"] == name}):
            recs = [[r for r in p if r["engine"] == name and r["tokens"] == n] for p in processes]
            ref = recs[0][0]
            ref_row = np.load(dirs[0] / f"{name}-{n}-0.npy")
            in_process = all(r["sha"] == p[0]["sha"] and r["ids"] == p[0]["ids"] for p in recs for r in p)
            across = []
            for i, p in enumerate(recs[1:], 1):
                row = np.load(dirs[i] / f"{name}-{n}-0.npy")
                across.append({"same": p[0]["sha"] == ref["sha"], "ids_differ_at": _first_diff(ref["ids"], p[0]["ids"]),
                               "max_abs_diff": float(np.max(np.abs(row - ref_row))), "kl": kl(ref_row, row)})
            head = [r for r in first if r["engine"] == engines[0] and r["tokens"] == n and r["repeat"] == 0][0]
            head_row = np.load(dirs[0] / f"{engines[0]}-{n}-0.npy")
            same = in_process and all(a["same"] and a["ids_differ_at"] is None for a in across)
            ok &= same
            lines.append({"engine": name, "tokens": n, "path": ref["path"], "sha": ref["sha"], "ids": ref["ids"],
                          "repeats_same": in_process, "processes": across, "self_consistent": same,
                          "vs_first_engine": {"engine": engines[0], "kl": kl(head_row, ref_row),
                                              "max_abs_diff": float(np.max(np.abs(ref_row - head_row))),
                                              "ids_differ_at": _first_diff(head["ids"], ref["ids"]),
                                              "same_top": int(np.argmax(head_row)) == int(np.argmax(ref_row))}})
    return lines, ok


def _print(lines: list[dict]) -> None:
    print(f"{'engine':<22} {'tokens':>7} {'repeats':>8} {'processes':>10} {'max |d| proc':>12} "
          f"{'KL vs first':>11} {'max |d| first':>13} {'ids differ':>10} {'same top':>8}")
    for ln in lines:
        procs = ln["processes"]
        agree = "-" if not procs else f"{sum(a['same'] for a in procs) + 1}/{len(procs) + 1}"
        d = "-" if not procs else f"{max(a['max_abs_diff'] for a in procs):.3g}"
        v = ln["vs_first_engine"]
        print(f"{ln['engine']:<22} {ln['tokens']:>7} {'same' if ln['repeats_same'] else 'DIFFER':>8} {agree:>10} "
              f"{d:>12} {v['kl']:>11.3g} {v['max_abs_diff']:>13.3g} {str(v['ids_differ_at']):>10} "
              f"{str(v['same_top']):>8}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m abbench.engine.tools.gpucheck_bits",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="preset (default: qwen3.5-35b-a3b on cuda, qwen3.5-tiny on cpu)")
    p.add_argument("--layers", type=int, default=None, help="the preset's first N layers (default: all)")
    p.add_argument("--depth", type=int, default=None,
                   help="instead: the preset with N layers, its layer kinds continued in their pattern")
    p.add_argument("--tokens", default=None, help="prompt lengths, comma-separated (default 4096,32768; 256 on cpu)")
    p.add_argument("--engines", nargs="+", default=["resident:prefill_mode=resident"],
                   help="NAME:field=value,... (EngineConfig fields), in this order; the first is the yardstick")
    p.add_argument("--repeats", type=int, default=2, help="requests per engine and length in each process")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--processes", type=int, default=1, help="run it all in N processes of its own and compare them")
    p.add_argument("--autotune-cache", choices=("on", "off", "inherit"), default="inherit",
                   help="the processes' Triton autotuning cache (module docstring)")
    p.add_argument("--out", type=Path, default=None, help="write every figure as JSON")
    p.add_argument("--rows-dir", type=Path, default=None, help=argparse.SUPPRESS)  # one process's rows (internal)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    model, engines = model_and_engines(p, args)
    lengths = [int(v) for v in (args.tokens or ("4096,32768" if cuda else "256")).split(",")]
    if args.rows_dir is not None:  # a child: run, write the records, leave the comparing to the parent
        recs = run_process(model, args.layers, args.depth, lengths, engines, args.repeats, args.max_tokens,
                           args.device, args.rows_dir)
        (args.rows_dir / "records.json").write_text(json.dumps(recs))
        return 0
    with tempfile.TemporaryDirectory(prefix="gpucheck-bits-") as tmp:
        env = dict(os.environ)
        if args.autotune_cache != "inherit":
            env["FLA_CACHE_RESULTS"] = env["TRITON_CACHE_AUTOTUNING"] = "1" if args.autotune_cache == "on" else "0"
            env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton")
        dirs, processes = [], []
        for i in range(args.processes):
            d = Path(tmp) / f"p{i}"
            d.mkdir()
            child = [sys.executable, "-m", "abbench.engine.tools.gpucheck_bits", *(argv if argv is not None
                                                                                  else sys.argv[1:]),
                     "--rows-dir", str(d), "--device", args.device]
            print(f"process {i + 1}/{args.processes} ...", flush=True)
            if subprocess.run(child, env=env).returncode != 0:
                print(f"gpucheck_bits: process {i + 1} failed (its error is above)", file=sys.stderr)
                return 2
            dirs.append(d)
            processes.append(json.loads((d / "records.json").read_text()))
        lines, ok = compare(processes, dirs)
    print(f"{model} ({args.depth or args.layers or 'all'} layers), {args.device}, {args.processes} process(es), "
          f"{args.repeats} repeat(s), autotune cache {args.autotune_cache}")
    _print(lines)
    if args.out:
        args.out.write_text(json.dumps({"model": model, "layers": args.layers, "depth": args.depth,
                                        "device": args.device,
                                        "processes": args.processes, "repeats": args.repeats,
                                        "autotune_cache": args.autotune_cache, "engines": args.engines,
                                        "lines": lines, "self_consistent": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
