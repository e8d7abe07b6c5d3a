"""Self-check of the hybrid (Qwen3.5/3.6-MoE) engine on one device: bitwise equality of the prefill modes and
the time of one Gated DeltaNet layer per chunk.

``python -m abbench.engine.tools.gpucheck_hybrid [--layers N] [--tokens T] [--chunk-tokens C] [--device D]``

On CUDA (the default when available) it builds the first ``--layers`` layers (default 8: 6 DeltaNet, 2 gated
attention) of the full ``qwen3.5-35b-a3b`` shape with random bf16 weights, prefills one random ``--tokens``
prompt (default 4096) in every mode (chunked, layer-major with windows of 2 chunks, demand, resident) after one
warm-up prefill (kernels and Triton autotuning settle on the shapes every mode then uses), and checks that the
logits, the attention layers' KV and the DeltaNet conv/recurrent states are bitwise equal to chunked. It then
times, per ``--chunk-tokens`` chunk (default 2048): one DeltaNet mixer (projections, conv, delta rule, gated
norm, out_proj), one whole DeltaNet layer with resident experts, and one gated-attention layer at the prompt's
last chunk. It prints a short table and exits 1 on any mismatch. On CPU it runs the ``qwen3.5-tiny`` shape
(default 300 tokens in 64-token chunks) in seconds, which is how the tests exercise it.

``--model qwen4-exp-tiny`` / ``qwen4-exp-half`` check Qwen4-Exp the same way (PLE layers kept within ``--layers``;
the indexer keys compared too).

``--no-prefill-graphs`` runs every prefill layer step eagerly (to compare with the CUDA graphs of full chunks'
fixed-shape steps, the default); ``--attention-batch 2`` adds layer-major with two chunks per attention call.

It reports which delta-rule implementation ran (``fla`` when flash-linear-attention imports on CUDA, else the
torch path) and the expert kernel.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from abbench.engine.config import PRESETS, EngineConfig
from abbench.engine.ops.dense import attention_backends
from abbench.engine.runtime.prefill import layer_major_loop, plan_chunks, plan_windows, prefill

MODES = ("chunked", "layer-major", "demand", "resident")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def merge_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """[start, end) intervals merged where they overlap or touch: sorted and disjoint."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def union_seconds(spans_us: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals given in microseconds, in seconds."""
    return sum(b - a for a, b in merge_spans(spans_us)) / 1e6


def gpu_compute_seconds(fn, device: torch.device) -> tuple[float, float]:
    """(seconds the GPU spent in kernels, wall seconds) of one ``fn()`` on CUDA, from the profiler's device
    activity (CUPTI): the union of kernel intervals on every stream; memory copies and sets are not compute."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - t0
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    return union_seconds(spans), wall


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m abbench.engine.tools.gpucheck_hybrid", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None,
                   help="hybrid preset (default: qwen3.5-35b-a3b on cuda, qwen3.5-tiny on cpu)")
    p.add_argument("--layers", type=int, default=None, help="first N layers (default 8 on cuda, all of tiny on cpu)")
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default 4096 on cuda, 300 on cpu)")
    p.add_argument("--chunk-tokens", type=int, default=None, help="a multiple of 64 (default 2048 on cuda, 64 on cpu)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated prefill modes to check and time (default: all of {', '.join(MODES)}); "
                        "chunked always runs once as the reference")
    p.add_argument("--mode-repeats", type=int, default=1,
                   help="prefills per mode (default 1); the table gives each mode's median wall time")
    p.add_argument("--gpu-busy", action="store_true",
                   help="CUDA: profile one more prefill per mode (kernel activity through the profiler) and give "
                        "the time the GPU spent computing (the union of kernel intervals, copies excluded) against "
                        "the wall time: near the wall time the GPU set the pace; the rest the GPU sat idle, waiting "
                        "for the host's launches or for streamed copies (the copy wait says how much for copies)")
    p.add_argument("--window-chunks", type=int, default=2,
                   help="chunks per layer-major window (default 2: several windows on a long prompt; a large value "
                        "puts a long prompt in one window, to compare layer-major with resident at full length)")
    p.add_argument("--no-prefill-graphs", dest="prefill_graphs", action="store_false",
                   help="run every prefill layer step eagerly (the engine's --no-prefill-graphs), to compare")
    p.add_argument("--attention-batch", type=int, default=1, metavar="K",
                   help="also run layer-major with K chunks per attention call (where bit-identical, up to "
                        "--attention-batch-max-context) and check it against chunked")
    p.add_argument("--attention-batch-max-context", type=int, default=None, metavar="TOKENS",
                   help="the engine's batching limit (default: the engine's)")
    p.add_argument("--attention-batch-positions", default=None, metavar="P1,P2,...",
                   help="time one attention call over --attention-batch adjacent chunks against one call per chunk "
                        "for groups starting at each position (the model's head shapes, random data; no model "
                        "is built beyond what the check needs), and check them bitwise equal")
    return p


def attention_batch_timing(mc, chunk: int, k: int, positions: list[int], device: torch.device, dtype: torch.dtype,
                           repeats: int) -> list[tuple[str, str]]:
    """Rows 'attention k=K at P': the joint call's time over the per-chunk calls' (median of ``repeats``), and
    whether every row is bitwise equal."""
    from abbench.engine.models.hybrid import causal_sdpa

    hq, hkv, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    scale, gqa, rows = d**-0.5, mc.num_attention_heads != mc.num_key_value_heads, []
    gen = torch.Generator(device="cpu").manual_seed(2)
    with torch.no_grad(), attention_backends():
        for s in positions:
            end = s + k * chunk
            q = torch.randn(hq, k * chunk, d, generator=gen).to(device, dtype)  # [Hq, kT, D]
            keys = torch.randn(hkv, end, d, generator=gen).to(device, dtype)  # [Hkv, S, D]
            values = torch.randn(hkv, end, d, generator=gen).to(device, dtype)  # [Hkv, S, D]
            joint = lambda: causal_sdpa(q, keys, values, scale, gqa)  # noqa: E731
            parts = lambda: [causal_sdpa(q[:, c * chunk:(c + 1) * chunk], keys[:, :s + (c + 1) * chunk],  # noqa: E731
                                         values[:, :s + (c + 1) * chunk], scale, gqa) for c in range(k)]
            same = all(torch.equal(joint()[:, :, c * chunk:(c + 1) * chunk], part) for c, part in enumerate(parts()))
            tj, tp = _timed(joint, device, repeats), _timed(parts, device, repeats)
            rows.append((f"attention k={k} at {s}", f"{'bitwise equal' if same else 'DIFFERS'}; joint {tj * 1e3:.3f} ms"
                                                    f" / per chunk {tp * 1e3:.3f} ms = {tj / tp:.3f}x"))
    return rows


def _build(args, p: argparse.ArgumentParser):
    """(engine, model config, tokens, chunk, window) for the parsed arguments."""
    from abbench.engine.runtime.engine import Engine

    cuda = args.device.startswith("cuda")
    preset = PRESETS[args.model or ("qwen3.5-35b-a3b" if cuda else "qwen3.5-tiny")]
    if not preset.is_hybrid:
        p.error(f"{preset.name} is not a hybrid preset")
    n_layers = min(args.layers or (8 if cuda else preset.num_hidden_layers), preset.num_hidden_layers)
    tokens = args.tokens or (4096 if cuda else 300)
    chunk = args.chunk_tokens or (2048 if cuda else 64)
    if args.window_chunks < 2:
        p.error("--window-chunks must be at least 2 (one chunk per window is the chunked path)")
    window = args.window_chunks * chunk
    mc = preset.first_layers(n_layers)
    knobs = {} if args.attention_batch_max_context is None else {
        "attention_batch_max_context": args.attention_batch_max_context}
    engine = Engine(EngineConfig(model=mc, weights="random:0", device=args.device, prefill_mode="resident",
                                 chunk_tokens=chunk, layer_major_window_tokens=window, demand_max_tokens=chunk,
                                 max_context=tokens + 64, bandwidth_probe_bytes=0, prefill_graphs=args.prefill_graphs,
                                 **knobs))
    return engine, mc, tokens, chunk, window


def _check_modes(args, engine, mc, tokens: int, chunk: int, window: int) -> tuple[bool, list[tuple[str, str]]]:
    """Every asked mode (and layer-major with --attention-batch) against chunked: bitwise, timed, GPU busy."""
    dev, model, kv, cuda = engine.device, engine.model, engine.kv, args.device.startswith("cuda")
    ids = torch.randint(0, mc.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).to(dev)

    def prefill_mode(mode: str, k: int = 1):
        engine.reset()
        engine.store.begin_request()
        t0 = time.perf_counter()
        logits, stats = prefill(engine.steps, engine.store, kv, ids, 0, mode, chunk_tokens=chunk,
                                window_tokens=window, demand_max_tokens=chunk, batching=engine._batching(k, chunk))
        _sync(dev)
        wall = time.perf_counter() - t0
        stats.copy_wait_s = engine.store.copy_stall_seconds()
        cache = [t[:, :tokens].clone() for t in kv.k + kv.v] + [t.clone() for t in kv.states()]
        cache += [t[:tokens].clone() for t in getattr(kv, "ik", [])]  # Qwen4-Exp's indexer keys
        return logits.clone(), stats, cache, wall

    def busy(fn) -> str:
        """', GPU computing X of Y s (Z%)' for one profiled run of fn (``--gpu-busy`` on CUDA), else ''."""
        if not (args.gpu_busy and cuda):
            return ""
        compute, wall = gpu_compute_seconds(fn, dev)
        return f", GPU computing {compute:.3f} of {wall:.3f} s ({100 * compute / wall:.0f}%)"

    prefill_mode("chunked")  # warm-up: kernels, autotuning, allocator
    prefill_mode("chunked")  # and, with prefill graphs, their capture
    ref_logits, _, ref_cache, _ = prefill_mode("chunked")
    modes = [(m.strip(), 1) for m in args.modes.split(",") if m.strip()]
    if args.attention_batch > 1:
        modes.append(("layer-major", args.attention_batch))
    ok, rows = True, []
    for mode, k in modes:
        walls = []
        if k > 1:
            prefill_mode(mode, k)  # the joint calls' own warm-up
        for _ in range(max(1, args.mode_repeats)):
            logits, stats, cache, wall = prefill_mode(mode, k)
            walls.append(wall)
            same = torch.equal(logits, ref_logits) and all(torch.equal(a, b)
                                                           for a, b in zip(cache, ref_cache, strict=True))
            ok &= same
        secs = sorted(walls)[len(walls) // 2]
        batch = (f", attention groups batched {stats.attention_batched}, fallbacks {stats.attention_fallbacks}"
                 if k > 1 else "")
        rows.append((f"prefill {mode}" + (f" k={k}" if k > 1 else ""),
                     f"{'bitwise equal' if same else 'DIFFERS'}; path {stats.path}, {stats.n_chunks} chunks, "
                     f"{stats.n_windows} windows, H2D {stats.h2d_bytes / 1e9:.2f} GB, {secs:.3f} s"
                     + (f", copy wait {stats.copy_wait_s:.3f} s" if stats.copy_wait_s is not None else "")
                     + f", graph replays {stats.graph_replays}" + batch
                     + busy(lambda m=mode, k=k: prefill_mode(m, k))))

    # the layer-major loop over the resident experts: the loop order without copies, to tell apart what the
    # order costs (host launch queue, parked activations) from what running beside the copies costs
    def layer_major_resident():
        engine.reset()
        windows = plan_windows(plan_chunks(0, tokens, chunk), args.window_chunks)
        weights = (engine.store.resident[layer] for _ in windows for layer in range(mc.num_hidden_layers))
        kv.write_tokens(0, ids)  # kept by the models that read token ids inside layers (Qwen4-Exp)
        t0 = time.perf_counter()
        with torch.no_grad(), attention_backends():
            logits = model.logits(layer_major_loop(engine.steps, weights, kv, ids, 0, windows)[-1:])
        _sync(dev)
        return logits, time.perf_counter() - t0

    if len(plan_chunks(0, tokens, chunk)) > 1:
        runs = [layer_major_resident() for _ in range(max(1, args.mode_repeats))]
        same = all(torch.equal(r[0], ref_logits) for r in runs)
        ok &= same
        secs = sorted(r[1] for r in runs)[len(runs) // 2]
        rows.append(("layer-major order, resident experts", f"{'bitwise equal' if same else 'DIFFERS'} (logits); "
                                                            f"{secs:.3f} s" + busy(layer_major_resident)))
    return ok, rows


def _time_pieces(args, engine, mc, tokens: int, chunk: int) -> list[tuple[str, str]]:
    """Per chunk: a DeltaNet mixer, a whole DeltaNet layer (resident experts), a gated-attention layer at the
    prompt's last chunk (its KV prefix written by the prefills before), all eager."""
    dev, model, kv = engine.device, engine.model, engine.kv
    lin, attn = mc.linear_layers[0], (mc.attention_layers[0] if mc.attention_layers else None)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(chunk, mc.stream_width, generator=g, device=dev, dtype=engine.dtype)  # [C, W] a layer's input
    xm = x[:, :mc.hidden_size].contiguous()  # [C, H] a mixer's input (W = hc x H for Qwen4-Exp's streams)
    i = kv.slot[lin]
    conv0, rec0 = kv.conv[i].clone(), kv.rec[i].clone()
    gate_up, down = engine.store.resident[lin]
    rows = []
    with torch.no_grad(), attention_backends():
        mixer_s = _timed(lambda: model.linear_mixer(lin, xm, conv0, rec0), dev, args.repeats)
        layer_s = _timed(lambda: model.moe_block(*model.attn_block(lin, x, kv, chunk), gate_up, down), dev,
                         args.repeats)
        rows.append((f"DeltaNet mixer / {chunk}-token chunk", f"{mixer_s * 1e3:.2f} ms"))
        rows.append((f"DeltaNet layer + MoE / {chunk}-token chunk", f"{layer_s * 1e3:.2f} ms"))
        if attn is not None:
            start = max(0, tokens - chunk) // 64 * 64
            a_gu, a_dn = engine.store.resident[attn]
            attn_s = _timed(lambda: model.moe_block(*model.attn_block(attn, x, kv, start), a_gu, a_dn), dev,
                            args.repeats)
            rows.append((f"attention layer + MoE / chunk at {start}", f"{attn_s * 1e3:.2f} ms"))
    return rows


def run(argv: list[str] | None = None) -> tuple[bool, list[tuple[str, str]]]:
    """Run the check; returns (all modes bitwise equal, table rows (what, value))."""
    p = _parser()
    args = p.parse_args(argv)
    if not [m for m in args.modes.split(",") if m.strip()] or any(
            m.strip() not in MODES for m in args.modes.split(",") if m.strip()):
        p.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}, got {args.modes!r}")
    t0 = time.perf_counter()
    engine, mc, tokens, chunk, window = _build(args, p)
    build_s = time.perf_counter() - t0
    dev, cuda = engine.device, args.device.startswith("cuda")
    rows = [("device", f"{dev} ({torch.cuda.get_device_name(dev) if cuda else 'cpu'})"),
            ("model", f"{mc.name}: {len(mc.linear_layers)} DeltaNet + {len(mc.attention_layers)} attention layers, "
                      f"{engine.dtype}"),
            ("kernels", f"delta rule {engine.model.gdn_backend}, experts {engine.model.moe_kernel}, prefill steps "
                        f"{engine.prefill_graphs_mode}"),
            ("build", f"{build_s:.1f} s (bank {engine.bank_bytes / 1e9:.2f} GB)")]
    ok, mode_rows = _check_modes(args, engine, mc, tokens, chunk, window)
    rows += mode_rows + _time_pieces(args, engine, mc, tokens, chunk)
    engine.reset()
    if args.attention_batch_positions:
        positions = [int(v) for v in args.attention_batch_positions.split(",") if v.strip()]
        rows += attention_batch_timing(mc, chunk, max(2, args.attention_batch), positions, dev, engine.dtype,
                                       args.repeats)  # where it differs the engine falls back: reported only
    return ok, rows


def main(argv: list[str] | None = None) -> int:
    ok, rows = run(argv)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("PASS: every mode bitwise equal to chunked" if ok else "FAIL: some mode differs from chunked")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
