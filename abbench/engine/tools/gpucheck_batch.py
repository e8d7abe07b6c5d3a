"""The engine serving many requests at once, measured in one process against its floors: a batch of queued
prompts prefilled layer-major together, and decode with several sequences.

``python -m abbench.engine.tools.gpucheck_batch [--model qwen3-30b-a3b] [--prompts 4] [--tokens 32768]
[--decode-seqs 8] [--decode-prompt 4096] [--decode-tokens 64] [--budget GIB] [--repeats 3] [--out JSON]``

1. An offloaded engine (random weights, experts in host memory, ``--max-num-seqs`` the larger of ``--prompts`` and
   ``--decode-seqs``) prefills each of ``--prompts`` distinct prompts of ``--tokens`` tokens alone (layer-major),
   then all of them submitted together before the engine steps (one prefill batch), ``--repeats`` times each:
   the batch's time to its last first token, its windows and host-to-device bytes (one bank per window for the
   whole batch, against one per prompt alone), and every prompt's first ``--check-tokens`` greedy ids and
   logprobs against its solo run (bitwise).
2. Decode: one sequence of a ``--decode-prompt``-token prompt decodes ``--decode-tokens`` tokens alone, then
   ``--decode-seqs`` such sequences (distinct prompts) together: output tokens per second of the decode phase
   (first token to last) alone and together, and every sequence's ids against its solo run. With a slot cache,
   each way's step is put against its copy floor (its slot misses' H2D bytes a step over the measured bandwidth).
3. A resident engine (every expert on the device) prefills the same prompts one by one: the batch's floor is
   the larger of the copies (windows x bank bytes / the measured bandwidth) and the sum of the prompts'
   resident prefill times. The batch's time over that floor is the verdict (``--max-over-floor``, default 1.10).

Exit 1 when an id or logprob differs from its solo run, or the batch is over ``--max-over-floor`` x its floor.
``--prompts 0`` measures decode alone (no prefill batch, no resident engine); ``--router-skew`` concentrates the
random router's choices as trained routers do (the engine's option); ``--expert-dtype fp8`` and ``--slot-dtype``
are the engines' options (FP8 slots hold twice as many experts in a budget); ``--decode-prefetch`` the offloaded
engine's (the report counts the experts it copied, alone and together); ``--decode-prefetch both`` runs the
decode check without it and then with it on the one engine and reports the speedups; ``--profile`` profiles one
more decode after each check (alone and together, CUDA only): per step the GPU's busy and idle time, how many
kernels ran at once, and the prefetch's copy kernels and how much of their time other kernels ran beside them.
On CPU it runs the tiny preset in seconds (the tests run it there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from abbench.engine.config import EXPERT_DTYPES, SLOT_DTYPES, EngineConfig
from abbench.engine.contract import GenerateRequest
from abbench.engine.tools import release
from abbench.engine.tools.gpucheck_hybrid import merge_spans


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(vocab: int, n: int, tokens: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (tokens,), generator=gen).tolist() for _ in range(n)]


def run_together(engine, prompts: list[list[int]], max_tokens: int,
                 after_first: Callable[[], object] | None = None) -> tuple[list[dict], float]:
    """Submit every prompt before the engine steps, then step until all are done: per prompt its ids, logprobs,
    stats and first-token / last-token times (perf_counter); and the time the stepping started. ``after_first``
    is called once, between steps, as soon as every prompt has its first token (the decode's start)."""
    outs: list[list] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]

    def emit(i: int):
        def put(item) -> None:
            outs[i].append(item)
            times[i].append(time.perf_counter())
        return put

    for i, p in enumerate(prompts):
        engine.scheduler.submit(engine.resolve(GenerateRequest(p, max_tokens, ignore_eos=True,
                                                               prefill_mode="layer-major")), None, emit(i))
    _sync(engine.device)
    t0 = time.perf_counter()
    while engine.scheduler.busy:
        engine.scheduler.step()
        if after_first is not None and all(outs):
            after_first()
            after_first = None
    rows = []
    for out, ts in zip(outs, times, strict=True):
        if isinstance(out[-1], BaseException):
            raise out[-1]
        events, stats = out[:-1], out[-1].stats
        rows.append({"ids": [e.token_id for e in events], "logprobs": [e.logprob for e in events], "stats": stats,
                     "first": ts[0], "last": ts[-2]})
    return rows, t0


def run_alone(engine, prompt: list[int], max_tokens: int) -> dict:
    return run_together(engine, [prompt], max_tokens)[0][0]


def prefill_check(engine, prompts: list[list[int]], check_tokens: int, repeats: int) -> dict:
    # untimed first: one prompt alone and the batch, so that every sequence cache's first sightings (lazy
    # initialisation, autotuning, each cache's prefill graphs: eager, then captured) are behind the timed runs
    engine.reset()
    run_alone(engine, prompts[0], 1)
    for _ in range(2):
        engine.reset()
        run_together(engine, prompts, 1)
    solo, solo_s = [], []
    for p in prompts:
        times = []
        for _ in range(repeats):
            engine.reset()
            row = run_alone(engine, p, check_tokens)
            times.append(row["stats"].first_token - row["stats"].prefill_start)
        solo.append(row)
        solo_s.append(statistics.median(times))
    batch_s, equal = [], True
    for _ in range(repeats):
        engine.reset()
        rows, t0 = run_together(engine, prompts, check_tokens)
        batch_s.append(max(r["first"] for r in rows) - t0)
        equal &= all(r["ids"] == s["ids"] and r["logprobs"] == s["logprobs"] for r, s in zip(rows, solo, strict=True))
    st = rows[0]["stats"]
    return {"solo_prefill_s": solo_s, "solo_h2d_bytes": [s["stats"].prefill_h2d_bytes for s in solo],
            "solo_windows": [s["stats"].n_windows for s in solo], "batch_s": batch_s,
            "batch_s_median": statistics.median(batch_s), "batch_windows": st.n_windows,
            "batch_h2d_bytes": st.prefill_h2d_bytes, "batch_prompts": st.prefill_batch,
            "ids_equal_solo": bool(equal)}


def decode_check(engine, prompts: list[list[int]], tokens: int) -> dict:
    """Decode alone and together (module docstring). With a slot cache, each way's step is also put against its
    copy floor: the step's host-to-device bytes (the slot misses' reads) over the engine's measured bandwidth."""
    engine.reset()
    pf0 = engine.store.prefetched
    alone = run_alone(engine, prompts[0], tokens)
    pf_alone = engine.store.prefetched - pf0
    alone_tps = (tokens - 1) / (alone["last"] - alone["first"])
    solo = [alone] + [run_alone(engine, p, tokens) for p in prompts[1:]]
    engine.reset()
    steps0, pf0 = dict(engine.decoder.steps), engine.store.prefetched
    rows, _ = run_together(engine, prompts, tokens)
    pf_together = engine.store.prefetched - pf0
    steps = {k: v - steps0.get(k, 0) for k, v in engine.decoder.steps.items()}  # how the decode steps ran
    start, end = max(r["first"] for r in rows), max(r["last"] for r in rows)
    # the decode phase: from the last first token (every sequence decoding) to the last token
    decoded = sum(sum(1 for _ in r["ids"]) - 1 for r in rows)
    together_tps = decoded / (end - min(r["first"] for r in rows))
    return {"alone_tokens_per_s": alone_tps, "together_tokens_per_s": together_tps,
            "ratio": together_tps / alone_tps, "sequences": len(prompts), "decode_start_spread_s": start - min(
                r["first"] for r in rows),
            "ids_equal_solo": all(r["ids"] == s["ids"] for r, s in zip(rows, solo, strict=True)),
            "decoder_steps_together": steps, "decode_kernels": engine.decoder.kernels,
            "decode_prefetch": engine.decoder.prefetch, "prefetched_alone": pf_alone,
            "prefetched_together": pf_together,
            "slot_misses_alone": alone["stats"].slot_misses,
            "slot_misses_together": [r["stats"].slot_misses for r in rows],
            **_copy_floor(alone, rows, tokens - 1, alone_tps, together_tps, engine.measured_h2d_gbps)}


def _copy_floor(alone: dict, rows: list[dict], steps: int, alone_tps: float, together_tps: float,
                gbps: float) -> dict:
    """A decode step's time against its copy floor, alone and together: its H2D bytes (the decode's, over the
    ``steps`` steps; together, every sequence's share of the batched steps) over the measured bandwidth."""
    alone_b = alone["stats"].decode_h2d_bytes / steps
    together_b = sum(r["stats"].decode_h2d_bytes for r in rows) / steps
    out = {"decode_h2d_bytes_per_step_alone": alone_b, "decode_h2d_bytes_per_step_together": together_b,
           "step_s_alone": 1 / alone_tps, "step_s_together": len(rows) / together_tps}
    if gbps == gbps and gbps > 0 and alone_b and together_b:  # (NaN: no bandwidth probe; no misses: no floor)
        out.update(copy_floor_s_alone=alone_b / (gbps * 1e9), copy_floor_s_together=together_b / (gbps * 1e9))
        out.update(alone_over_copy_floor=out["step_s_alone"] / out["copy_floor_s_alone"],
                   together_over_copy_floor=out["step_s_together"] / out["copy_floor_s_together"])
    return out


def kernel_timeline(kernels: list[tuple[str, float, float]], steps: int, mark: str = "_fetch_rows") -> dict:
    """What the GPU did over ``steps`` decode steps, from its kernels' (name, start us, end us): per step, in ms,
    the span from the first kernel's start to the last one's end, the time any kernel ran (``busy``: the union),
    the kernels' summed time (over ``busy``: how many ran at once on average), the time no kernel ran inside the
    span (``idle``), and the kernels whose name holds ``mark`` (the prefetch's copies): their time and the part of
    it another kernel ran beside (``mark_overlapped``: 0 means the prefetch ran alone, in series with the
    step)."""
    if not kernels or steps < 1:
        return {"steps": steps, "kernels": len(kernels)}
    merged = merge_spans([(a, b) for _, a, b in kernels])
    busy = sum(b - a for a, b in merged)
    total = sum(b - a for _, a, b in kernels)
    span = max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)
    marked = merge_spans([(a, b) for n, a, b in kernels if mark in n])
    others = merge_spans([(a, b) for n, a, b in kernels if mark not in n])
    overlap, j = 0.0, 0
    for a, b in marked:  # both lists sorted and disjoint within themselves
        while j < len(others) and others[j][1] <= a:
            j += 1
        k = j
        while k < len(others) and others[k][0] < b:
            overlap += min(b, others[k][1]) - max(a, others[k][0])
            k += 1
    per = 1e3 * steps  # us over the run -> ms a step
    return {"steps": steps, "kernels": len(kernels), "span_ms": span / per, "busy_ms": busy / per,
            "kernel_sum_ms": total / per, "concurrency": total / busy if busy else 0.0,
            "idle_ms": (span - busy) / per, "mark": mark,
            "mark_ms": sum(b - a for a, b in marked) / per, "mark_overlapped_ms": overlap / per}


def profile_decode(engine, prompts: list[list[int]], tokens: int, top: int = 12) -> dict | None:
    """One alone decode of ``prompts[0]`` and one of all ``prompts`` together (``tokens`` tokens each, after the
    timed checks: graphs captured), the profiler's device activity on from the moment every sequence has its
    first token: ``kernel_timeline`` of the decode steps, the wall time a step took, and the ``top`` kernels by
    time a step. None off CUDA (no device activity to read)."""
    if engine.device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for way, batch in (("alone", prompts[:1]), ("together", prompts)):
        engine.reset()
        prof = profile(activities=[ProfilerActivity.CUDA])

        def start() -> None:
            _sync(engine.device)
            prof.start()

        rows, _ = run_together(engine, batch, tokens, after_first=start)
        _sync(engine.device)
        prof.stop()
        steps = tokens - 1
        wall = (max(r["last"] for r in rows) - max(r["first"] for r in rows)) / steps
        kern = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
        by_name: dict[str, float] = {}
        for n, a, b in kern:
            by_name[n[:80]] = by_name.get(n[:80], 0.0) + (b - a) / 1e3 / steps
        out[way] = {"wall_step_ms": wall * 1e3, **kernel_timeline(kern, steps),
                    "top_kernels_ms_per_step": sorted(by_name.items(), key=lambda kv: -kv[1])[:top]}
    return out


def _print_profile(label: str, prof: dict | None) -> None:
    if prof is None:
        print(f"profile{' ' + label if label else ''}: no device activity off CUDA", flush=True)
        return
    for way, p in prof.items():
        keys = ("wall_step_ms", "span_ms", "busy_ms", "kernel_sum_ms", "concurrency", "idle_ms", "mark_ms",
                "mark_overlapped_ms")
        print(f"profile{' ' + label if label else ''}, {way}:", {k: round(p[k], 3) for k in keys if k in p},
              flush=True)
        for name, ms in p["top_kernels_ms_per_step"]:
            print(f"    {ms:8.3f} ms  {name}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m abbench.engine.tools.gpucheck_batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--window-tokens", type=int, default=None, help="--layer-major-window-tokens")
    ap.add_argument("--check-tokens", type=int, default=8)
    ap.add_argument("--decode-seqs", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=None, help="the offloaded engine's --gpu-memory-budget (GiB)")
    ap.add_argument("--router-skew", type=float, default=0.0, help="the engines' --router-skew (random weights)")
    ap.add_argument("--expert-dtype", default="model", choices=EXPERT_DTYPES,
                    help="the engines' --expert-dtype (fp8: float8 expert banks)")
    ap.add_argument("--slot-dtype", default="auto", choices=SLOT_DTYPES,
                    help="the offloaded engine's --slot-dtype (fp8: twice the slots)")
    ap.add_argument("--decode-prefetch", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                    help="the offloaded engine's --decode-prefetch (each next layer's experts guessed and copied "
                    "ahead; the copies, wrong guesses included, count in the copy floor); 'both': the decode "
                    "check without it, then with it, on the one engine (default off; bare: on)")
    ap.add_argument("--profile", action="store_true",
                    help="after each decode check, profile one more decode alone and together (CUDA: the GPU's "
                    "kernels a step, how many ran at once, the prefetch's copies and what ran beside them)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-over-floor", type=float, default=1.10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from abbench.engine.runtime.engine import Engine

    seqs = max(args.prompts, args.decode_seqs, 1)
    # the sequences' KV is sized for what this check runs: --tokens only with a prefill batch (8 caches of 32K
    # positions would take the slot cache's room from a 4K decode check)
    ctx = max(args.tokens if args.prompts else 0, args.decode_prompt if args.decode_seqs else 0) + max(
        args.check_tokens if args.prompts else 0, args.decode_tokens if args.decode_seqs else 0)
    knobs = dict(model=args.model, device=args.device, chunk_tokens=args.chunk_tokens, max_context=ctx,
                 router_skew=args.router_skew, expert_dtype=args.expert_dtype,
                 bandwidth_probe_bytes=256 * 2**20 if args.device.startswith("cuda") else 0)
    if args.window_tokens:
        knobs["layer_major_window_tokens"] = args.window_tokens
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(**knobs, prefill_mode="layer-major", max_num_seqs=seqs,
                                 gpu_memory_budget_gib=args.budget, slot_dtype=args.slot_dtype,
                                 decode_prefetch=args.decode_prefetch != "off"))
    mc = engine.model_config
    report: dict = {"model": mc.name, "device": str(engine.device), "expert_format": engine.expert_format,
                    "slot_dtype": args.slot_dtype, "prompts": args.prompts, "tokens": args.tokens,
                    "chunk_tokens": args.chunk_tokens, "max_num_seqs": seqs, "max_context": ctx,
                    "budget_gib": args.budget,
                    "slots_per_layer": engine.slots_per_layer, "bank_bytes": engine.bank_bytes,
                    "measured_h2d_gbps": engine.measured_h2d_gbps, "startup_s": round(time.perf_counter() - t0, 1)}
    print(f"offloaded engine: {mc.name}, {seqs} sequences, {engine.slots_per_layer} slots/layer, "
          f"H2D {engine.measured_h2d_gbps:.1f} GB/s, start {report['startup_s']} s", flush=True)
    prompts = _prompts(mc.vocab_size, args.prompts, args.tokens, seed=1)
    if prompts:
        report["prefill"] = prefill_check(engine, prompts, args.check_tokens, args.repeats)
        print("prefill:", {k: v for k, v in report["prefill"].items()}, flush=True)
    if args.decode_seqs:
        decode_prompts = _prompts(mc.vocab_size, args.decode_seqs, args.decode_prompt, 2)
        if args.decode_prefetch == "both":  # without, then with, on the one engine (each way's own graphs)
            engine.set_decode_prefetch(False)
            report["decode_without_prefetch"] = decode_check(engine, decode_prompts, args.decode_tokens)
            print("decode without the prefetch:", report["decode_without_prefetch"], flush=True)
            if args.profile:
                report["profile_without_prefetch"] = profile_decode(engine, decode_prompts, args.decode_tokens)
                _print_profile("without the prefetch", report["profile_without_prefetch"])
            engine.set_decode_prefetch(True)
        report["decode"] = decode_check(engine, decode_prompts, args.decode_tokens)
        print("decode:", report["decode"], flush=True)
        if args.profile:
            report["profile"] = profile_decode(engine, decode_prompts, args.decode_tokens)
            _print_profile("with the prefetch" if engine.decoder.prefetch else "", report["profile"])
        if "decode_without_prefetch" in report:
            base, pf = report["decode_without_prefetch"], report["decode"]
            same = pf["ids_equal_solo"] and base["ids_equal_solo"]
            report["prefetch"] = {"alone_speedup": pf["alone_tokens_per_s"] / base["alone_tokens_per_s"],
                                  "together_speedup": pf["together_tokens_per_s"] / base["together_tokens_per_s"],
                                  "ids_equal": same}
            report["decode"]["ids_equal_solo"] = same
            print("prefetch:", report["prefetch"], flush=True)
    gbps = engine.measured_h2d_gbps
    if engine.device.type == "cuda":  # torch's peak over the whole check: every cache, graph pool and batch
        report["peak_device_gib"] = round(torch.cuda.max_memory_allocated(engine.device) / 2**30, 3)
    if not prompts:  # decode only: no floor to measure
        ok = report["decode"]["ids_equal_solo"]
        report["pass"] = bool(ok)
        print(f"decode only: {'PASS' if ok else 'FAIL'}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1, default=str)
        return 0 if ok else 1
    del engine
    release(args.device.startswith("cuda"))
    resident = Engine(EngineConfig(**knobs, prefill_mode="resident", max_num_seqs=1))
    res_s = []
    for p in prompts:
        times = []
        for _ in range(args.repeats):
            resident.reset()
            _, st = resident.run(p, 1, ignore_eos=True)
            times.append(st.first_token - st.prefill_start)
        res_s.append(statistics.median(times))
    pf = report["prefill"]
    copies_s = pf["batch_windows"] * report["bank_bytes"] / (gbps * 1e9) if gbps == gbps else 0.0
    floor = max(copies_s, sum(res_s))
    pf.update(resident_prefill_s=res_s, resident_sum_s=sum(res_s), copies_s=copies_s, floor_s=floor,
              batch_over_floor=pf["batch_s_median"] / floor,
              solo_sum_s=sum(pf["solo_prefill_s"]),
              batch_over_solo_sum=pf["batch_s_median"] / sum(pf["solo_prefill_s"]))
    ok = pf["ids_equal_solo"] and pf["batch_over_floor"] <= args.max_over_floor
    if "decode" in report:
        ok &= report["decode"]["ids_equal_solo"]
    report["pass"] = bool(ok)
    print(f"batch {pf['batch_s_median']:.3f} s over floor {floor:.3f} s (copies {copies_s:.3f}, resident sum "
          f"{sum(res_s):.3f}) = {pf['batch_over_floor']:.3f}x; alone one after another {pf['solo_sum_s']:.3f} s; "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
