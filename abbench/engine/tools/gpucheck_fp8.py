"""Time what an FP8 expert bank costs on the device, one layer at full width: the copies, the dequantization
(``kernels.dequantize_fp8`` at several grid sizes, and the torch composition) alone, and beside the prefill's
grouped GEMM on another stream, as layer-major prefill runs them.

``python -m abbench.engine.tools.gpucheck_fp8 [--model qwen3-30b-a3b] [--tokens 2048] [--programs 0,8,16,32,64]``

For one layer of the preset's routed experts (random bf16 weights, quantized per row as ``bank.quantize_rows``):

- the host-to-device copy of the layer from page-locked memory, in the compute dtype and in FP8 with its scales;
- each dequantization alone (CUDA events, median of ``--repeats``), checked bit for bit against
  ``bank.dequantize_into``;
- the layer's grouped GEMM over ``--tokens`` routed tokens alone (``moe.moe_experts``, what a prefill chunk
  runs), and then the same GEMM with each dequantization launched beside it on a second stream: how much the GEMM
  slows down (the SMs the dequantization takes) and when the dequantization ends.

Prints a table; writes JSON with ``--out``; exits 1 when a dequantization disagrees. ``programs`` 0 is the
full grid (``DEQUANT_PROGRAMS`` None). On CPU it runs the torch composition at the tiny preset, for the tests:
its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from abbench.engine.config import PRESETS
from abbench.engine.models.bank import dequantize_into, quantize_rows
from abbench.engine.ops import kernels as dk
from abbench.engine.ops.moe import grouped_mm, looped_mm, moe_experts, probe_grouped_mm


def _ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of one call (CUDA events on the current stream; wall clock elsewhere), after one
    untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _beside(gemm: Callable[[], object], dequant: Callable[[], object], device: torch.device,
            repeats: int) -> tuple[float, float]:
    """(GEMM ms, dequantization ms) with the two launched together on two streams, medians."""
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    g_ms, d_ms = [], []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        side.wait_stream(main)
        ev[0].record(main)
        with torch.cuda.stream(side):
            ev[2].record(side)
            dequant()
            ev[3].record(side)
        gemm()
        ev[1].record(main)
        torch.cuda.synchronize(device)
        g_ms.append(ev[0].elapsed_time(ev[1]))
        d_ms.append(ev[2].elapsed_time(ev[3]))
    return statistics.median(g_ms[1:]), statistics.median(d_ms[1:])


def run(model: str, device: torch.device, dtype: torch.dtype, tokens: int, programs: list[int],
        repeats: int) -> tuple[bool, list[dict]]:
    cfg = PRESETS[model]
    E, H, inter, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up = (torch.randn(E, 2 * inter, H, generator=gen, device=device) * H ** -0.5).to(dtype)
    down = (torch.randn(E, H, inter, generator=gen, device=device) * inter ** -0.5).to(dtype)
    parts = [quantize_rows(w) for w in (gate_up, down)]  # [(q, scale)] on the device
    want = [dequantize_into(torch.empty_like(w), q, s) for w, (q, s) in zip((gate_up, down), parts)]
    rows: list[dict] = []
    ok = True

    def row(part: str, name: str, ms: float, nbytes: int = 0, **extra) -> None:
        rows.append({"part": part, "candidate": name, "ms": ms,
                     "gb_s": nbytes / ms / 1e6 if nbytes and ms > 0 else None, **extra})

    # copies from page-locked host memory
    pin = cuda
    host_bf16 = [w.cpu().pin_memory() if pin else w.cpu() for w in (gate_up, down)]
    host_fp8 = [t.cpu().pin_memory() if pin else t.cpu() for q, s in parts for t in (q, s)]
    dev_bf16 = [torch.empty_like(w) for w in (gate_up, down)]
    dev_fp8 = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in host_fp8]
    b_bf16 = sum(t.numel() * t.element_size() for t in host_bf16)
    b_fp8 = sum(t.numel() * t.element_size() for t in host_fp8)

    def copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)

    row("copy", f"H2D {str(dtype).removeprefix('torch.')} layer", _ms(lambda: copy(dev_bf16, host_bf16), device,
                                                                     repeats), b_bf16)
    row("copy", "H2D fp8 layer + row scales", _ms(lambda: copy(dev_fp8, host_fp8), device, repeats), b_fp8)

    # dequantizations alone
    outs = [torch.empty_like(w) for w in (gate_up, down)]
    out_bytes = sum(t.numel() * t.element_size() for t in outs) + b_fp8  # read fp8 + scales, write the dtype

    def torch_dequant() -> None:
        for o, (q, s) in zip(outs, parts):
            dequantize_into(o, q, s)

    candidates: list[tuple[str, Callable[[], None]]] = [("torch composition", torch_dequant)]
    if cuda and dk.have_triton():
        for p in programs:
            def fused(p: int = p) -> None:
                for o, (q, s) in zip(outs, parts):
                    dk.dequantize_fp8(o, q, s, programs=p or None)
            candidates.append((f"dequantize_fp8, {'full grid' if not p else f'{p} programs'}", fused))
    for name, fn in candidates:
        for o in outs:
            o.fill_(float("nan"))
        fn()
        agrees = all(torch.equal(o, w) for o, w in zip(outs, want))
        ok &= agrees
        row("dequantize", name, _ms(fn, device, repeats), out_bytes, agrees=agrees)

    # the grouped GEMM of a prefill chunk, alone and beside each dequantization
    mm = grouped_mm if probe_grouped_mm(device, dtype) else looped_mm
    h = torch.randn(tokens, H, generator=gen, device=device).to(dtype)
    top_ids = torch.stack([torch.randperm(E, generator=gen, device=device)[:k] for _ in range(tokens)])
    top_w = torch.softmax(torch.randn(tokens, k, generator=gen, device=device), -1).to(dtype)

    def gemm() -> None:
        moe_experts(h, top_w, top_ids, gate_up, down, mm=mm)

    alone = _ms(gemm, device, repeats)
    row("grouped GEMM", f"{tokens} tokens, alone", alone)
    if cuda:
        for name, fn in candidates:
            g, d = _beside(gemm, fn, device, repeats)
            row("GEMM + dequantize", name, g, gemm_slowdown=g / alone, dequant_ms=d)
    return ok, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m abbench.engine.tools.gpucheck_fp8", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="preset (default: qwen3-30b-a3b on cuda, tiny on cpu)")
    p.add_argument("--tokens", type=int, default=None, help="tokens of the prefill chunk (default 2048; 64 on cpu)")
    p.add_argument("--programs", default="0,8,16,32,64,132",
                   help="dequantize_fp8 grids to time, comma-separated; 0 = the full grid")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = args.model or ("qwen3-30b-a3b" if cuda else "tiny")
    tokens = args.tokens or (2048 if cuda else 64)
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.no_grad():
        ok, rows = run(model, device, dtype, tokens, [int(v) for v in args.programs.split(",")], args.repeats)
    print(f"{model}, {device}, {dtype}, triton: {dk.have_triton()}")
    print(f"{'part':<18} {'candidate':<36} {'ms':>9} {'GB/s':>8} {'GEMM x':>7} {'dequant ms':>10}")
    for r in rows:
        gbs = "-" if r["gb_s"] is None else f"{r['gb_s']:.1f}"
        slow = f"{r['gemm_slowdown']:.3f}" if "gemm_slowdown" in r else "-"
        dq = f"{r['dequant_ms']:.3f}" if "dequant_ms" in r else "-"
        print(f"{r['part']:<18} {r['candidate']:<36} {r['ms']:>9.3f} {gbs:>8} {slow:>7} {dq:>10}"
              + ("  DISAGREES" if r.get("agrees") is False else ""))
    if args.out:
        args.out.write_text(json.dumps({"model": model, "device": str(device), "tokens": tokens, "rows": rows},
                                       indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
