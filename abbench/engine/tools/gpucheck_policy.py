"""Where demand loading stops paying, measured in one process: every offloaded prefill path and ``auto`` over a
grid of uncached suffix lengths after a cached prefix, under uniform and concentrated routing.

``python -m abbench.engine.tools.gpucheck_policy [--model qwen3-30b-a3b] [--prefix 16384] [--suffixes 64,...]
[--skews 0,1.2] [--repeats 3]``

For each router skew it builds an engine started with ``--prefill-mode auto`` (random weights, experts offloaded
to host memory), prefills the cached prefix once, then for every suffix length prefills the same suffix after
it in each mode (demand, chunked, layer-major, auto), ``--repeats`` times each after one warm-up, and checks that
every mode's logits are bitwise equal. It prints one table per skew: the median prefill time of each mode, the
fastest streamed-or-demand mode, what ``auto`` picked (and its estimate), auto's time over the fastest, and the
demand/streamed crossover bracketed by the grid (the last length where demand was faster and the first where
it was not; with the crossover interpolated in log length between them). Exit 1 when a mode differs or auto is
more than ``--auto-tolerance`` (default 1.05) slower than the fastest path at some length. On CPU it runs the
tiny preset in seconds (the tests run it there).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from abbench.engine.config import EngineConfig
from abbench.engine.ops.dense import attention_backends
from abbench.engine.tools import release

MODES = ("demand", "chunked", "layer-major", "auto")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def crossover(lengths: list[int], demand_s: list[float], streamed_s: list[float]) -> tuple[int, int, float] | None:
    """(last length where demand was faster, first where it was not, the log-interpolated crossing) where the
    sign of log(demand / streamed) first changes from negative to non-negative; None if it never does."""
    r = [math.log(d / s) for d, s in zip(demand_s, streamed_s, strict=True)]
    for i in range(1, len(r)):
        if r[i - 1] < 0 <= r[i]:
            x0, x1 = math.log(lengths[i - 1]), math.log(lengths[i])
            x = x0 + (x1 - x0) * (-r[i - 1]) / (r[i] - r[i - 1])
            return lengths[i - 1], lengths[i], math.exp(x)
    return None


def sweep(engine, prefix: int, suffixes: list[int], repeats: int) -> tuple[bool, list[dict]]:
    """(every mode bitwise equal, one row per suffix length)."""
    from abbench.engine.runtime.engine import Engine  # noqa: F401  (type only)

    mc, dev = engine.model_config, engine.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.vocab_size, (prefix + max(suffixes),), generator=gen).tolist()
    engine.reset()
    engine.run(ids[:prefix], 1, prefill_mode="layer-major")  # the cached prefix: KV [0, prefix)
    ok, rows = True, []
    chunk = engine.config.chunk_tokens
    for n in suffixes:
        suffix = ids[prefix:prefix + n]
        times: dict[str, float] = {}
        ref = None
        auto = None
        for mode in MODES:
            walls = []
            for i in range(repeats + 1):
                engine.store.begin_request()
                _sync(dev)
                t0 = time.perf_counter()
                logits, stats = engine._prefill(suffix, prefix, mode, None, chunk)
                _sync(dev)
                if i:
                    walls.append(time.perf_counter() - t0)
            times[mode] = sorted(walls)[len(walls) // 2]
            if mode == "auto":
                auto = stats.auto
            ref = logits.clone() if ref is None else ref
            ok &= torch.equal(logits, ref)
        fastest = min(("demand", "chunked", "layer-major"), key=lambda m: times[m])
        rows.append({"suffix": n, **{m: times[m] for m in MODES}, "fastest": fastest, "auto_path": auto["path"],
                     "auto_over_fastest": times["auto"] / times[fastest], "same": ok})
    return ok, rows


def main(argv: list[str] | None = None) -> int:
    from abbench.engine.runtime.engine import Engine

    p = argparse.ArgumentParser(prog="python -m abbench.engine.tools.gpucheck_policy", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="preset (default: qwen3-30b-a3b on cuda, tiny on cpu)")
    p.add_argument("--prefix", type=int, default=None, help="cached prefix tokens (default 16384 on cuda, 256 on cpu)")
    p.add_argument("--suffixes", default=None, help="comma-separated uncached suffix lengths (default 64..8192 on "
                   "cuda, 8..256 on cpu, doubling)")
    p.add_argument("--skews", default="0,1.2", help="router skews to sweep (default 0,1.2: uniform, concentrated)")
    p.add_argument("--chunk-tokens", type=int, default=None, help="default 2048 on cuda, 64 on cpu")
    p.add_argument("--gpu-memory-budget", type=float, default=None, metavar="GB", help="the engine's budget")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--auto-tolerance", type=float, default=1.05)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    prefix = args.prefix or (16384 if cuda else 256)
    suffixes = ([int(v) for v in args.suffixes.split(",")] if args.suffixes
                else [64 * 2**i for i in range(8)] if cuda else [8 * 2**i for i in range(6)])
    chunk = args.chunk_tokens or (2048 if cuda else 64)
    ok_all = True
    for skew in (float(v) for v in args.skews.split(",")):
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model=args.model or ("qwen3-30b-a3b" if cuda else "tiny"), weights="random:0",
                                     device=args.device, prefill_mode="auto", chunk_tokens=chunk,
                                     demand_max_tokens=chunk, layer_major_window_tokens=max(suffixes) + chunk,
                                     max_context=prefix + max(suffixes) + 64, router_skew=skew,
                                     gpu_memory_budget_gib=args.gpu_memory_budget))
        print(f"router skew {skew:g}: {engine.model_config.name}, {engine.device}, built in "
              f"{time.perf_counter() - t0:.1f} s; cost model {engine.policy}")
        with torch.no_grad(), attention_backends():
            ok, rows = sweep(engine, prefix, suffixes, args.repeats)
        print(f"{'suffix':>7} " + " ".join(f"{m:>12}" for m in MODES) + f" {'fastest':>12} {'auto picked':>12} "
              f"{'auto/fastest':>12}")
        for r in rows:
            print(f"{r['suffix']:>7} " + " ".join(f"{r[m] * 1e3:>9.1f} ms" for m in MODES)
                  + f" {r['fastest']:>12} {r['auto_path']:>12} {r['auto_over_fastest']:>12.3f}")
        lengths = [r["suffix"] for r in rows]
        streamed = [min(r["chunked"], r["layer-major"]) for r in rows]
        cross = crossover(lengths, [r["demand"] for r in rows], streamed)
        print("demand vs the faster streamed path: " + ("no crossover in the grid" if cross is None else
              f"demand faster up to {cross[0]}, not at {cross[1]}; crossing at ~{cross[2]:.0f} tokens "
              "(log-interpolated)"))
        worst = max(r["auto_over_fastest"] for r in rows)
        print(f"modes bitwise equal: {ok}; auto within {args.auto_tolerance:g}x of the fastest at every length: "
              f"{worst <= args.auto_tolerance} (worst {worst:.3f})")
        ok_all &= ok and worst <= args.auto_tolerance
        del engine
        release(cuda)
    print("PASS" if ok_all else "FAIL")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
