"""Full-width checks of the engine on a GPU, run before a committed GPU run (not in CI: it needs CUDA).

``python -m abbench.engine.tools.gpucheck [--layers N] [--prompt-tokens T] [--out FILE.json]`` builds the
Qwen3-30B-A3B shape (hidden 2048, 128 experts top-8, real head and expert sizes; ``--preset`` picks another,
e.g. the ``qwen3.5-35b-a3b`` hybrid) with its first ``--layers`` layers and random bf16 weights, and checks what the unit tests check at tiny sizes, at the sizes where CUDA's limits bite:

1. ``torch._grouped_mm`` takes 1,023 groups and the engine's guard refuses 1,024 (what the raw kernel does
   with 1,024 is recorded too);
2. prefill: chunked, layer-major and demand give bitwise-equal logits on one prompt;
3. decode: the same greedy ids and bitwise-equal logits from resident experts and from the slot cache at
   top_k, an odd size, 7/8 and all experts per layer (below all, with the slot lookup and miss copies on the
   device and on the host: ``decode_misses``), with CUDA graphs and eagerly;
4. timing: decode step time per layer at the prompt's context, for the resident whole-step graph, eager
   decode, and the offloaded step at each slot budget with the misses handled on the host and on the device,
   with the bytes each step copied and step / (copies at the measured bandwidth + the resident step); scaled
   to the preset's full depth as tokens per second; and (CUDA) one layer's misses: the device-side copies'
   bandwidth against the host's copies, and the routed experts' kernels reading their misses from the host
   against the copy kernel followed by the experts' kernels (``fetch_bandwidth``).

It prints one table and writes every figure to ``--out`` (JSON). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

from abbench.engine.config import DECODE_ATTENTION, DECODE_EXPERTS, MAX_GROUPED_MM_GROUPS, PRESETS, EngineConfig
from abbench.engine.ops.moe import TooManyGroups, grouped_mm
from abbench.engine.runtime.engine import Engine
from abbench.engine.tools import release


def _groups_check(device: str) -> dict:
    dev = torch.device(device)
    x = torch.randn(MAX_GROUPED_MM_GROUPS * 2, 256, device=dev, dtype=torch.bfloat16)  # [M, K]
    out = {}
    for g in (MAX_GROUPED_MM_GROUPS, MAX_GROUPED_MM_GROUPS + 1):
        w = torch.randn(g, 128, 256, device=dev, dtype=torch.bfloat16)  # [G, N, K]
        offs = torch.arange(1, g + 1, device=dev, dtype=torch.int32) * 2  # [G]
        try:
            grouped_mm(x[: 2 * g], w, offs)
            _sync()
            out[f"guarded_{g}"] = "ran"
        except TooManyGroups as e:
            out[f"guarded_{g}"] = f"refused: {e}"
        try:
            torch._grouped_mm(x[: 2 * g], w.transpose(-2, -1), offs=offs)
            _sync()
            out[f"raw_{g}"] = "ran"
        except RuntimeError as e:
            out[f"raw_{g}"] = f"failed: {str(e).splitlines()[0][:120]}"
    out["ok"] = out[f"guarded_{MAX_GROUPED_MM_GROUPS}"] == "ran" and out[
        f"guarded_{MAX_GROUPED_MM_GROUPS + 1}"].startswith("refused")
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _engine(model, mode: str, **kw) -> Engine:
    """An engine of the check's shape; ``kw``: the device, decode kernels and whatever else differs."""
    return Engine(EngineConfig(model=model, weights="random:0", dtype="bfloat16", prefill_mode=mode,
                               chunk_tokens=2048, layer_major_window_tokens=65536, demand_max_tokens=256,
                               max_context=kw.pop("max_context"), bandwidth_probe_bytes=256 * 2**20,
                               **kw))


def _decode(engine: Engine, prompt: list[int], n: int, mode: str = "chunked") -> tuple[list[int], torch.Tensor]:
    engine.reset()
    events, _ = engine.run(prompt, n, ignore_eos=True, prefill_mode=mode)
    return [e.token_id for e in events], engine.decoder.logits.clone()


def _time_steps(engine: Engine, prompt: list[int], n: int, fill_all: bool = False) -> dict:
    """Median decode step (s) over ``n`` steps after a prefill of ``prompt``, and H2D bytes per step.
    ``fill_all``: load every expert into its slot first (whole-step decode from then on)."""
    engine.reset()
    engine.run(prompt, 2, ignore_eos=True)  # prefill, capture graphs at this kv_len
    if fill_all:
        for layer in range(engine.model_config.num_hidden_layers):
            engine.store.decode_experts(layer, list(range(engine.model_config.num_experts)))
        assert engine.store.slots.complete
    times, pos, tok = [], len(prompt) + 1, 0
    h2d0 = engine.store.lifetime.h2d_bytes
    with engine._on_device():
        for i in range(n):
            _sync()
            t0 = time.perf_counter()
            logits = engine.decoder.step(tok, pos + i)
            tok = int(torch.argmax(logits))  # syncs
            times.append(time.perf_counter() - t0)
        engine.store.collect_decode_counts()  # the device-side lookups' misses (decode_misses "device")
    times.sort()
    return {"step_s": times[len(times) // 2], "h2d_bytes_per_step": (engine.store.lifetime.h2d_bytes - h2d0) / n,
            "mode": engine.decoder.mode}


def fetch_bandwidth(engine: Engine, trials: int = 5) -> list[dict]:
    """CUDA: the misses of one layer (layer 0), n = 1, 2, 4 and top_k missed experts of the k routed: GB/s
    (1e9 bytes/s) of the host's copies (``dma``: two per expert, as ``ExpertStore.decode_experts`` issues
    them) and of the copy kernel (``fetch``: ``reference_kernels.fetch_misses``, zero-copy reads of the
    registered host bank), and microseconds of the routed experts' kernels (``moe_one_token``) with every
    expert already in its slot (``moe_hits_us``: the compute alone), after the copy kernel
    (``fetch_then_moe_us``) and reading the misses from the host themselves (``fused_us``, the decode path's
    ``fetch``), whose bandwidth ``fused_gbps`` counts the bytes over the whole of its time. The best of
    ``trials`` timed repeats each, after a warm-up. ``equal``: the slots hold the bank's bits afterwards and
    the fused kernels' output is the copy-then-compute output's."""
    from abbench.engine.ops import kernels as decode_kernels
    from abbench.engine.tools import reference_kernels

    store, dev = engine.store, engine.device
    bank, slots, k = store.bank, store.slots, engine.model_config.num_experts_per_tok
    H = engine.model_config.hidden_size
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, H, generator=gen).to(dev, bank.gate_up[0].dtype)
    x = torch.randn(1, H, generator=gen).to(dev, bank.gate_up[0].dtype)
    w = torch.softmax(torch.randn(1, k, generator=gen), -1).to(dev)
    where = torch.arange(k, device=dev)
    rows = []
    for n in sorted({1, 2, 4, k}):
        experts = [3 * j % engine.model_config.num_experts for j in range(n)]
        src = torch.full((k,), -1, dtype=torch.int32, device=dev)
        src[:n] = torch.tensor(experts, dtype=torch.int32)
        gu, dn = slots.gate_up[0], slots.down[0]

        def dma() -> None:
            for j, e in enumerate(experts):
                gu[j].copy_(bank.gate_up[0][e], non_blocking=True)
                dn[j].copy_(bank.down[0][e], non_blocking=True)

        def fetch() -> None:
            reference_kernels.fetch_misses(src, where, bank.gate_up[0], bank.down[0], gu, dn)

        def moe(fused: bool) -> torch.Tensor:
            return decode_kernels.moe_one_token(h, w, where.view(1, -1), gu, dn, residual=x,
                                                fetch=(src, bank.gate_up[0], bank.down[0]) if fused else None)

        def timed(fn) -> float:
            fn()
            best = float("inf")
            for _ in range(trials):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                best = min(best, a.elapsed_time(b) / 1e3)
            return best

        def holds_bank() -> bool:
            return all(torch.equal(gu[j].cpu(), bank.gate_up[0][e]) and torch.equal(dn[j].cpu(), bank.down[0][e])
                       for j, e in enumerate(experts))

        moved = n * bank.expert_bytes
        row = {"experts": n, "bytes": moved, "dma_gbps": moved / timed(dma) / 1e9}
        gu.zero_(), dn.zero_()
        row["fetch_gbps"] = moved / timed(fetch) / 1e9
        row["fetch_equal"] = holds_bank()
        ref = moe(False)
        row["moe_hits_us"] = timed(lambda: moe(False)) * 1e6
        row["fetch_then_moe_us"] = timed(lambda: (fetch(), moe(False))) * 1e6
        gu.zero_(), dn.zero_()
        fused = timed(lambda: moe(True))
        row["fused_us"], row["fused_gbps"] = fused * 1e6, moved / fused / 1e9
        row["fused_equal"] = holds_bank() and bool(torch.equal(moe(True), ref))
        rows.append(row)
    store.flush_slots()
    return rows


def profile_decode(engine: Engine, prompt: list[int], n: int, top: int = 15) -> list[tuple[str, float, int]]:
    """CUDA: the kernels of ``n`` decode steps after a prefill of ``prompt`` (graphs replayed as the engine runs
    them), from the profiler's device activity: (kernel name, microseconds per step, launches per step), the
    ``top`` largest, and a last row 'all kernels' with the total; memory copies and sets included."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine.reset()
    engine.run(prompt, 2, ignore_eos=True)  # prefill, capture graphs at this kv_len
    pos, tok = len(prompt) + 1, 0
    with engine._on_device():
        engine.decoder.step(tok, pos)
        _sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(n):
                engine.decoder.step(tok, pos + 1 + i)
            _sync()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    rows = sorted(((name[:90], sum(v) / n, len(v) // n) for name, v in by_name.items()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return rows[:top] + [("all kernels", total, sum(r[2] for r in rows))]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m abbench.engine.tools.gpucheck", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="the shape (default: qwen3-30b-a3b)")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script itself")
    ap.add_argument("--profile-decode", action="store_true",
                    help="CUDA: also list the kernels of a resident decode step (graphs) and of the offloaded "
                         "one with the fewest slots, by time per step")
    ap.add_argument("--decode-experts", choices=DECODE_EXPERTS, default="auto",
                    help="decode's routed experts in every engine built here (EngineConfig.decode_experts; "
                    "default auto, as the engine's)")
    ap.add_argument("--decode-attention", choices=DECODE_ATTENTION, default="auto",
                    help="decode's attention in every engine built here (EngineConfig.decode_attention; default "
                    "auto, as the engine's)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpucheck needs CUDA", file=sys.stderr)
        return 2
    engine = functools.partial(_engine, device=args.device, decode_experts=args.decode_experts,
                               decode_attention=args.decode_attention)  # every engine built here
    model = PRESETS[args.preset].first_layers(args.layers, name=f"{args.preset}-{args.layers}l")
    ctx = args.prompt_tokens + 64
    prompt = torch.randint(0, model.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    report: dict = {"device": name, "torch": torch.__version__, "layers": args.layers,
                    "prompt_tokens": args.prompt_tokens, "groups": _groups_check(args.device)}
    ok = report["groups"]["ok"]

    resident = engine(model, "resident", max_context=ctx)
    ref_ids, ref_logits = _decode(resident, prompt, args.decode_tokens)
    eager_res = engine(model, "resident", max_context=ctx, decode_graphs=False)
    eager_ids, eager_logits = _decode(eager_res, prompt, args.decode_tokens)
    decode = {"resident_graphs_vs_eager": eager_ids == ref_ids and bool(torch.equal(eager_logits, ref_logits))}
    prefill = {}
    # top_k (every step misses), an odd size, one expert in 8 absent (about one miss a layer under uniform routing,
    # the regime of a budgeted service) and every expert
    e, k = model.num_experts, model.num_experts_per_tok
    for slots in sorted({k, min(37, e), max(k, e - e // 8), e}):
        eng = engine(model, "chunked", max_context=ctx, expert_slots_per_layer=slots)
        ids, logits = _decode(eng, prompt, args.decode_tokens)
        decode[f"slots_{slots}_vs_resident"] = ids == ref_ids and bool(torch.equal(logits, ref_logits))
        if slots < model.num_experts:  # the host's lookups and copies too (decode_misses "host")
            host = engine(model, "chunked", max_context=ctx, expert_slots_per_layer=slots, decode_misses="host")
            ids_h, logits_h = _decode(host, prompt, args.decode_tokens)
            decode[f"slots_{slots}_host_vs_resident"] = ids_h == ref_ids and bool(torch.equal(logits_h, ref_logits))
            if host.decoder.misses != eng.decoder.misses:  # both ways exist for these kernels: time both
                report[f"timing_offloaded_{slots}_slots_host"] = _time_steps(host, prompt, 24)
                report[f"timing_offloaded_{slots}_slots_device"] = _time_steps(eng, prompt, 24)
            del host
        if slots == model.num_experts_per_tok:
            if eng.decoder.misses == "device" and args.device != "cpu":
                report["fetch_bandwidth"] = fetch_bandwidth(eng)
            first = {}
            for mode in ("chunked", "layer-major", "demand"):
                eng.reset()
                events, stats = eng.run(prompt, 1, prefill_mode=mode)
                first[mode] = (events[0].token_id, stats.prefill_path, stats.prefill_h2d_bytes / eng.bank_bytes)
            prefill = {"first": first, "equal": len({v[0] for v in first.values()}) == 1}
            report["timing_offloaded_min_slots"] = _time_steps(eng, prompt, 24)
            if args.profile_decode and args.device != "cpu":
                report["profile_offloaded_min_slots"] = profile_decode(eng, prompt, 8)
        if slots == model.num_experts:  # every slot filled: whole-step graphs from there on
            report["timing_offloaded_all_cached"] = _time_steps(eng, prompt, 24, fill_all=True)
        del eng
        release(torch.cuda.is_available())
    report["timing_resident_graphs"] = _time_steps(resident, prompt, 24)
    if args.profile_decode and args.device != "cpu":
        report["profile_resident_graphs"] = profile_decode(resident, prompt, 8)
    report["timing_resident_eager"] = _time_steps(eager_res, prompt, 24)
    report["decode_equal"], report["prefill"] = decode, prefill
    ok = ok and all(decode.values()) and prefill.get("equal", False)
    report["ok"] = ok
    depth = PRESETS[args.preset].num_hidden_layers
    scale = depth / args.layers
    report["decode_kernels"] = resident.decoder.kernels  # as resolved ("auto": Triton's on CUDA where they apply)
    print(f"gpucheck on {report['device']} (torch {report['torch']}), {args.layers} full-width layers, "
          f"{args.prompt_tokens}-token context, decode kernels {report['decode_kernels']}")
    print(f"  grouped GEMM: {report['groups']}")
    print(f"  prefill first ids/paths/banks: {prefill.get('first')}")
    print(f"  decode equal: {decode}")
    cached = report["timing_resident_graphs"]["step_s"]
    gbps = resident.measured_h2d_gbps
    for k in ["timing_resident_graphs", "timing_resident_eager", "timing_offloaded_all_cached",
              "timing_offloaded_min_slots"] + sorted(k for k in report if k.startswith("timing_offloaded_")
                                                     and k.endswith(("_host", "_device"))):
        t = report.get(k)
        if t:
            # step / (the copies at the measured H2D bandwidth + the resident step): the offloaded decode's floor
            t["over_expected"] = t["step_s"] / (t["h2d_bytes_per_step"] / (gbps * 1e9) + cached)
            print(f"  {k:36s} {t['mode']:12s} {t['step_s'] * 1e3 / args.layers:7.3f} ms/layer  "
                  f"-> {depth} layers {1 / (t['step_s'] * scale):7.1f} tok/s  H2D/step "
                  f"{t['h2d_bytes_per_step'] / 1e6:8.1f} MB  step/expected {t['over_expected']:5.2f}")
    for row in report.get("fetch_bandwidth", []):
        print(f"  {row['experts']} missed experts of {model.num_experts_per_tok}: " + "  ".join(
            f"{k[:-5]} {v:5.1f} GB/s" for k, v in row.items() if k.endswith("_gbps")) + "  " + "  ".join(
            f"{k[:-3]} {v:6.1f} us" for k, v in row.items() if k.endswith("_us")))
        ok = ok and all(v for k, v in row.items() if k.endswith("_equal"))
    for k in ("profile_resident_graphs", "profile_offloaded_min_slots"):
        for name, us, launches in report.get(k, []):
            print(f"  {k:28s} {us:9.1f} us/step {launches:6d} launches/step  {name}")
    print("gpucheck:", "PASS" if ok else "FAIL")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
