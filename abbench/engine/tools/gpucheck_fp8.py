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
  slows down (the SMs the dequantization takes) and when the dequantization ends;
- ``kernels.grouped_mm_fp8``, a grouped GEMM that reads the FP8 values and row scales in its inner loop, over
  the same chunk (and whether it agrees with the GEMM over the dequantized layer): its time over the grouped
  GEMM's against one dequantization pass. Layer-major dequantizes a layer once and runs the GEMM once per chunk,
  so the kernel wins where a layer's chunks are fewer than ``break_even_chunks`` (8 at 16K, 16 at 32K in
  2,048-token chunks). The same launches in W8A8 (``math="fp8"``: the activations quantized per row, FP8 by FP8
  in the tensor cores), against ``moe.w8a8_reference``. The pass, in series on a saturated GPU, is what keeps an FP8 bank's 16K prefill over
  its floor (docs/fp8.md). Under ``TRITON_INTERPRET=1`` on CPU too (times meaningless).

Prints a table; writes JSON with ``--out``; exits 1 when a dequantization or ``grouped_mm_fp8`` disagrees.
``programs`` 0 is the full grid (``DEQUANT_PROGRAMS`` None). On CPU it runs the torch composition at the tiny
preset, for the tests: its times mean nothing.

``--prefill-tokens N`` instead profiles one whole prefill of N tokens, the model's first ``--layers`` layers
(8 on CUDA), on three engines: every expert resident (the floor), layer-major streaming a bank in the compute
dtype (bf16 on CUDA), and layer-major streaming an FP8 bank. After one untimed prefill (graphs captured), one
more under the profiler's device activity gives, per engine: the prefill's wall time, the time the GPU spent in
compute kernels (the union of their intervals, on every stream: dequantization and copies excluded), in copies
and in dequantization kernels, the compute stream's measured wait for copies (``copy_wait_s``, CUDA events),
and the largest kernels. Where the FP8 bank's prefill exceeds resident's (#46: 3-4 ms a layer at 16K and 32K),
this says whether the GPU computed longer (slower kernels beside the copies) or sat idle (waiting). At 16K and 8
layers the FP8 bank's prefill was no slower than resident's (results/20261205e-h200-decode-prefetch) while a
16 GiB service's was 3 ms a layer slower: ``--budget`` and ``--max-context`` give the streaming engines a
service's budget and caches, to see whether those make the difference. With them (48 layers, 16 GiB) the
excess appeared in one process on an H100 (results/20261205i). Each row's ``compute_stream`` (``stream_gaps``)
then says where the compute stream sat idle: with the host late to launch, or queued behind something on the
device; ``--trace-dir`` keeps the Chrome traces. The profiled prefill is host-bound (the GPU then has gaps), so
each engine also times ``--timed`` unprofiled prefills (``timed ms``): on the H200 the FP8 bank was at resident's
profiled and over it unprofiled (results/20261205j). ``--engines fp8,fp8:copy-dequant,resident`` compares where
the FP8 bank's layers are dequantized, in one process (results/20261205n: the same there; the service chose the
compute stream, 20261205p). ``--engines model-dtype,resident,resident:beside-copies`` puts resident's compute
beside a bank's worth of host-to-device copies: what is left of a streaming prefill's excess once its copies
are hidden (the report's "rest", 2-3% at 32K on both models) is either the DMA's effect on the kernels beside it
(then resident slows beside the copies too) or the streaming engine's own; ``resident:beside-d2h`` beside it
puts the same copies the link's other way (results/20261206e: the gaps between kernels lengthen beside
host-to-device copies; whether the direction matters says if the GPU's reads over the loaded link are why).
``--model qwen3.5-35b-a3b`` runs the hybrid.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gzip
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from abbench.engine.config import PRESETS
from abbench.engine.models.bank import dequantize_into, quantize_rows
from abbench.engine.ops import kernels as dk
from abbench.engine.ops.moe import Fp8Experts, grouped_mm, looped_mm, moe_experts, probe_grouped_mm, w8a8_reference
from abbench.engine.tools import release
from abbench.engine.tools.gpucheck_hybrid import merge_spans, union_seconds


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
    if dk.have_triton() and (cuda or os.environ.get("TRITON_INTERPRET") == "1"):  # no dequantization pass:
        # the GEMM reads FP8 values and their scales (grouped_mm_fp8)
        (gq, gs), (dq, ds) = parts

        def one_pass() -> None:
            for o, (q, sc) in zip(outs, parts):
                dk.dequantize_fp8(o, q, sc)

        pass_ms = _ms(one_pass, device, repeats)
        ref = moe_experts(h, top_w, top_ids, want[0], want[1], mm=mm).float()
        # W8A8's reference: torch's quantization of the activations and float32 sums of the FP8 products
        w8a8_ref = moe_experts(h, top_w, top_ids, Fp8Weights(gq, gs), Fp8Weights(dq, ds),
                               mm=lambda x, w, offs: w8a8_reference(x, Fp8Experts(w.q, w.scale, "fp8"), offs,
                                                                    mm)).float()
        configs = dk.GROUPED_FP8_CONFIGS if cuda else dk.GROUPED_FP8_CONFIGS[:1]
        for math, config in [("bf16", c) for c in configs] + [("fp8", c) for c in configs]:
            def fp8_mm(x: torch.Tensor, w: Fp8Weights, offs: torch.Tensor, config=config, math=math) -> torch.Tensor:
                return dk.grouped_mm_fp8(x, w.q, w.scale, offs, config, math=math)

            def fused_gemm(fp8_mm=fp8_mm) -> torch.Tensor:
                return moe_experts(h, top_w, top_ids, Fp8Weights(gq, gs), Fp8Weights(dq, ds), mm=fp8_mm)

            close = bool(torch.allclose(fused_gemm().float(), ref if math == "bf16" else w8a8_ref, rtol=5e-2,
                                        atol=5e-2))
            ok &= close
            # layer-major dequantizes a layer once and runs the GEMM once per chunk; grouped_mm_fp8 has no pass
            # but its own GEMM per chunk: it wins where a layer has fewer chunks than pass / (its GEMM - the GEMM)
            # (W8A8 also quantizes each chunk's activations, inside its time; its numbers are its own)
            fused = _ms(fused_gemm, device, repeats)
            kind = "FP8 layer's experts" if math == "bf16" else "W8A8 layer's experts"
            row(kind, f"grouped_mm_fp8 {'x'.join(map(str, config[:3]))}, {config[3]} warps, "
                f"{config[4]} stages", fused, agrees=close, config=list(config), math=math, over_gemm_ms=fused - alone,
                pass_ms=pass_ms, break_even_chunks=pass_ms / (fused - alone) if fused > alone else None)
    return ok, rows


class Fp8Weights(NamedTuple):
    """An FP8 layer's values and row scales where ``moe_experts`` expects a weight: it reads only ``shape``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def stream_gaps(events: list[dict], top: int = 8) -> dict:
    """Where the compute stream sat idle, from a profiler's Chrome trace events (``traceEvents``: device
    activity ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` with ``args.stream`` and ``args.correlation``, host
    ``cuda_runtime`` / ``cuda_driver`` calls with the same correlation: Triton launches through the driver). The
    compute stream is the one with the most kernel time. Each gap between two of its consecutive operations is
    split in two: ``host_late_s``, the part before the host's call that launched the next operation returned (the
    host was late: launches, Python, a blocking call), and ``queued_s``, the rest (the next operation was queued
    and waited on the device: an event from another stream, the copy stream's work). Also the host's runtime calls
    of 100 us or more, by name (``slow_calls``: count, seconds), the ``top`` gaps, and the host thread's own
    pace: ``host_calls_s`` (time inside runtime and driver calls), ``host_between_s`` (between them: Python, torch's
    dispatch) and ``launch_median_us`` (the median ``cudaLaunchKernel``). Times in seconds.

    Where a bank streams, the queued part is also split by what the link was doing: ``beside_copies`` and
    ``apart_from_copies`` hold (gaps, queued seconds) of the gaps that a copy over the link (host to device, or
    device to host for ``:beside-d2h``) on another stream
    overlapped for more / not more than half their length, so the queued time per gap in each says whether the
    copies lengthen the gaps between kernels (results/20261206e: the same queued total in resident beside a bank's
    copies as in layer-major). ``queued_by_launch`` holds (gaps, queued seconds) by the host call that launched
    the operation after the gap (``cudaGraphLaunch``: a kernel of a CUDA graph; ``cudaLaunchKernel``: eager)."""
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    calls = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")),
                   key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in calls if "correlation" in e.get("args", {})}
    by_stream: dict[object, list[dict]] = {}
    for e in dev:
        by_stream.setdefault(e["args"].get("stream"), []).append(e)
    out: dict = {"stream": None, "span_s": 0.0, "busy_s": 0.0, "host_late_s": 0.0, "queued_s": 0.0, "gaps": 0,
                 "top_gaps": [], "slow_calls": {}, "beside_copies": (0, 0.0), "apart_from_copies": (0, 0.0),
                 "queued_by_launch": {}}
    inside = sum(e["dur"] for e in calls)
    out.update(host_calls_s=inside / 1e6, host_between_s=0.0, launch_median_us=None)
    if calls:
        out["host_between_s"] = (calls[-1]["ts"] + calls[-1]["dur"] - calls[0]["ts"] - inside) / 1e6
        durs = [e["dur"] for e in calls if e["name"] == "cudaLaunchKernel"]
        out["launch_median_us"] = statistics.median(durs) if durs else None
    for e in launches.values():
        if e["dur"] >= 100:
            n, sec = out["slow_calls"].get(e["name"], (0, 0.0))
            out["slow_calls"][e["name"]] = (n + 1, sec + e["dur"] / 1e6)
    if not by_stream:
        return out
    stream = max(by_stream, key=lambda s: sum(e["dur"] for e in by_stream[s] if e["cat"] == "kernel"))
    ops = sorted(by_stream[stream], key=lambda e: e["ts"])
    out.update(stream=stream, span_s=(max(e["ts"] + e["dur"] for e in ops) - ops[0]["ts"]) / 1e6,
               busy_s=union_seconds([(e["ts"], e["ts"] + e["dur"]) for e in ops]))
    copies = merge_spans([(e["ts"], e["ts"] + e["dur"]) for s, es in by_stream.items() if s != stream for e in es
                          if e["cat"] == "gpu_memcpy" and ("HtoD" in e["name"] or "DtoH" in e["name"])])
    gaps = []
    end = ops[0]["ts"] + ops[0]["dur"]
    for e in ops[1:]:
        gap = e["ts"] - end
        if gap > 0:
            call = launches.get(e["args"].get("correlation"))
            late = 0.0 if call is None else min(gap, max(0.0, call["ts"] + call["dur"] - end))
            out["host_late_s"] += late / 1e6
            out["queued_s"] += (gap - late) / 1e6
            out["gaps"] += 1
            gaps.append((gap / 1e6, late / 1e6, e["name"][:60], None if call is None else call["name"]))
            side = "beside_copies" if 2 * _overlap(copies, end, e["ts"]) > gap else "apart_from_copies"
            n, sec = out[side]
            out[side] = (n + 1, sec + (gap - late) / 1e6)
            name = "?" if call is None else call["name"]
            n, sec = out["queued_by_launch"].get(name, (0, 0.0))
            out["queued_by_launch"][name] = (n + 1, sec + (gap - late) / 1e6)
        end = max(end, e["ts"] + e["dur"])
    out["top_gaps"] = sorted(gaps, reverse=True)[:top]
    return out


def _overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """How much of [a, b) the merged, ordered ``spans`` cover."""
    i = bisect.bisect_right(spans, (a, float("inf"))) - 1
    got = 0.0
    for s, e in spans[max(i, 0):]:
        if s >= b:
            break
        got += max(0.0, min(e, b) - max(s, a))
    return got


class BesideCopies:
    """A bank's worth of host-to-device copies on a stream of their own, from just before a prefill: what a
    streaming engine's link does, beside an engine that streams nothing (resident). One layer's bank (pinned)
    is copied into one device buffer ``layers`` times, one copy at a time, each waited for before the next is
    issued (a thread of its own), as a streaming engine issues its layers, so that the prefill's own small
    host-to-device copies wait behind one layer's copy at most. Issued all at once (until 20261206a), the copies
    and the prefill ran one after the other: 1,987 ms against resident's 944 on an H100, with one stream
    synchronize of 1,039 ms on the host before the compute began. On CPU the copies are host to host, in line
    (the plumbing only). ``to_host``: the same copies the other way, device to host (``:beside-d2h``): the same
    bytes, copy engines and host-memory traffic, the link's other direction. Beside it the GPU still reads its
    launches' commands from host memory over a link that the copies do not load, so if the gaps between kernels
    lengthen beside host-to-device copies (results/20261206e) and not beside these, the direction is the cause."""

    def __init__(self, engine, to_host: bool = False):
        cfg = engine.model_config
        self.to_host = to_host
        self.cuda = engine.device.type == "cuda"
        self.layers = cfg.num_hidden_layers
        elems = cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size  # one layer: gate, up, down
        self.host = torch.empty(elems, dtype=engine.dtype, pin_memory=self.cuda)
        self.dev = torch.empty(elems, dtype=engine.dtype, device=engine.device)
        self.stream = torch.cuda.Stream(engine.device) if self.cuda else None
        self.bytes = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _copy_layers(self) -> None:
        try:
            with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                for _ in range(self.layers):
                    if self.to_host:
                        self.host.copy_(self.dev, non_blocking=self.cuda)
                    else:
                        self.dev.copy_(self.host, non_blocking=self.cuda)
                    if self.cuda:
                        self.stream.synchronize()  # the next layer's copy after this one: one in the queue
        except BaseException as e:  # noqa: BLE001 - raised again by wait(), in the caller's thread
            self._error = e

    def issue(self) -> None:
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.dev.device))
            self._thread = threading.Thread(target=self._copy_layers, daemon=True)
            self._thread.start()
        else:
            self._copy_layers()
        self.bytes += self.layers * self.host.numel() * self.host.element_size()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self.cuda:
            torch.cuda.current_stream(self.dev.device).wait_stream(self.stream)


class BesideHostTraffic:
    """Host-memory traffic without the link: ``threads`` threads copying one layer's bank between two host
    buffers, back to back, from just before a prefill until it ends. Beside a resident prefill it says whether
    host-memory contention alone (what a bank's copy also causes: the DMA reads host memory) slows the prefill's
    host side or its kernels, where ``BesideCopies`` loads the link and host memory together. torch's copies
    release the GIL, so the engine's thread runs beside them. ``bytes``: bytes read by the copies."""

    def __init__(self, engine, threads: int = 2):
        cfg = engine.model_config
        elems = cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size  # one layer: gate, up, down
        self.pairs = [(torch.empty(elems, dtype=engine.dtype), torch.empty(elems, dtype=engine.dtype))
                      for _ in range(threads)]
        for a, b in self.pairs:
            a.zero_()
            b.zero_()
        self.bytes = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._copied = [0] * threads

    def _loop(self, i: int) -> None:
        src, dst = self.pairs[i]
        while True:  # at least one copy, however short the prefill
            dst.copy_(src)
            self._copied[i] += src.numel() * src.element_size()
            if self._stop.is_set():
                return

    def issue(self) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(len(self.pairs))]
        for t in self._threads:
            t.start()

    def wait(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.bytes, self._copied = self.bytes + sum(self._copied), [0] * len(self.pairs)


def profile_prefill(engine, prompt: list[int], top: int = 8, trace: Path | None = None, timed: int = 3,
                    beside: BesideCopies | BesideHostTraffic | None = None) -> dict:
    """One prefill of ``prompt`` (after an unprofiled one, whose prefill time is ``first_prefill_s``: the
    engine's first sighting of the length, lazy set-up included; and ``timed`` more, unprofiled, whose median is
    ``timed_prefill_s``: the profiler slows the host until the GPU has gaps, which can hide what only a saturated
    GPU shows) on ``engine``: its wall time, and on CUDA, from
    the profiler's device activity, the seconds of compute kernels (union over streams), copies (union), FP8
    dequantization kernels (sum), the compute stream's wait for copies (``copy_wait_s``) and the ``top`` kernels
    by total time. The keys are there on CPU too, None where the profiler has no device. ``beside``: each timed
    and the profiled prefill start with a bank's worth of copies on another stream (``BesideCopies``), whose
    bytes are ``beside_bytes``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    engine.reset()
    _, first = engine.run(prompt, 1, ignore_eos=True)  # unprofiled: lazy set-up, graphs captured
    engine.reset()
    times = []
    def run():
        if beside is not None:
            beside.issue()
        _, st = engine.run(prompt, 1, ignore_eos=True)
        if beside is not None:
            beside.wait()
        return st

    for _ in range(timed):
        st = run()
        engine.reset()
        times.append(st.prefill_end - st.prefill_start)
    out: dict = {"compute_busy_s": None, "copy_busy_s": None, "dequant_s": None, "top_kernels": None,
                 "compute_stream": None, "first_prefill_s": first.prefill_end - first.prefill_start,
                 "timed_prefill_s": statistics.median(times) if times else None}
    if not cuda:
        stats = run()
    else:
        torch.cuda.synchronize(engine.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            stats = run()
            torch.cuda.synchronize(engine.device)
        spans: dict[str, list[tuple[float, float]]] = {"copy": [], "dequant": [], "compute": [], "set": []}
        by_name: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            text = path.read_text()
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
            trace.write_bytes(gzip.compress(text.encode()))
        out["compute_stream"] = stream_gaps(json.loads(text)["traceEvents"])
        for e in prof.events():
            if e.device_type != DeviceType.CUDA:
                continue
            kind = ("copy" if e.name.startswith("Memcpy") else "set" if e.name.startswith("Memset")
                    else "dequant" if "dequant" in e.name else "compute")
            spans[kind].append((e.time_range.start, e.time_range.end))
            by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + (e.time_range.end - e.time_range.start) / 1e6
        out.update(compute_busy_s=union_seconds(spans["compute"]), copy_busy_s=union_seconds(spans["copy"]),
                   dequant_s=sum(b - a for a, b in spans["dequant"]) / 1e6,
                   top_kernels=sorted(by_name.items(), key=lambda kv: -kv[1])[:top])
    if beside is not None:
        out["beside_bytes"] = beside.bytes // (timed + 1)
    out.update(prefill_s=stats.prefill_end - stats.prefill_start, copy_wait_s=stats.copy_wait_s,
               prefill_h2d_bytes=stats.prefill_h2d_bytes, path=stats.prefill_path, windows=stats.n_windows)
    return out


ENGINES = ("resident", "model-dtype", "fp8")  # prefill_profiles' default engines, by their short names
KINDS = (*ENGINES, "resident-fp8")  # and the others --engines may name
VARIANTS = {"eager": (", no prefill graphs", {"prefill_graphs": False}),  # NAME:VARIANT in --engines
            "copy-dequant": (", dequantized on the copy stream", {"fp8_dequant": "copy"}),
            "gemm": (", FP8 in the GEMM", {"fp8_dequant": "gemm"}),
            "w8a8": (", W8A8 GEMM", {"fp8_dequant": "w8a8"}),
            "beside-copies": (", beside a bank's copies", {}),  # BesideCopies: the run, not the engine
            "beside-d2h": (", beside a bank's copies to the host", {}),  # BesideCopies(to_host=True)
            "beside-host": (", beside host-memory traffic", {}),  # BesideHostTraffic
            "moe-graphs": (", MoE halves from CUDA graphs", {}),  # Qwen3-MoE: the hybrid's MoE-half graphs
            "prefill-triton": (", Triton's prefill kernels", {"prefill_kernels": "triton"})}  # Qwen3-MoE


def prefill_profiles(model: str, layers: int | None, tokens: int, chunk: int, device: torch.device,
                     dtype: torch.dtype, budget_gib: float | None = None, max_context: int | None = None,
                     trace_dir: Path | None = None, engines: tuple[str, ...] = ENGINES, timed: int = 3) -> list[dict]:
    """``profile_prefill`` on the three engines of the module docstring (each built, profiled and dropped in
    turn; the whole prompt one layer-major window: each bank streamed once), each row named by its ``engine``.
    ``budget_gib`` and ``max_context``: the two streaming engines' ``--gpu-memory-budget`` and caches as a
    service has them (default: no budget, caches of the prompt's length). ``trace_dir``: each profiled prefill's
    Chrome trace there, gzipped (``resident.json.gz``, ``model-dtype.json.gz``, ``fp8.json.gz``). ``engines``:
    which of them (``ENGINES``' short names), in that order: one process's later engines run after the earlier
    ones' set-up and profiles, so the order is a variable of its own. A name may add variants (``VARIANTS``):
    ``:eager`` runs that engine without prefill graphs (``--no-prefill-graphs``), ``:copy-dequant`` dequantizes
    an FP8 bank's layers on the copy stream (``--fp8-dequant copy``), ``:gemm`` multiplies its values and
    scales in the grouped GEMM (``--fp8-dequant gemm``; ``:w8a8`` the same with the activations quantized too
    and FP8 math; with ``resident-fp8``, every expert resident in FP8, the floor of that arithmetic), to
    measure either in the same process;
    ``:beside-copies`` runs each prefill beside a bank's worth of host-to-device copies on another stream
    (``BesideCopies``: ``resident:beside-copies`` is resident's compute beside the link's traffic of a streaming
    engine, which says whether DMA into device memory slows the kernels: the "rest" of the report's breakdown);
    ``:beside-d2h`` beside the same copies from the device to the host (the link's other direction: whether
    the direction matters, which it would if the kernels' launches wait on commands read over a loaded link);
    ``:beside-host`` runs it beside host-memory traffic alone (``BesideHostTraffic``: two threads copying a layer's
    bank between host buffers), which tells host-memory contention from the link's. ``:moe-graphs`` replays
    every full chunk's MoE half from CUDA graphs where the model does not (Qwen3-MoE; ``steps.LayerSteps``, as
    the hybrid does): the MoE half's launches leave the host, so a prefill paced by the host's launches (the
    "rest" if the copies slow the host) would show it. Not counted by the memory plan: a check.
    ``:prefill-triton`` runs the attention half with Triton's fused kernels (``--prefill-kernels triton``; on Qwen3-MoE
    10 ops a chunk and layer instead of 55): whether fewer kernels leave the copies less to lengthen.
    ``timed``: unprofiled prefills per engine (``profile_prefill``)."""

    from abbench.engine.config import EngineConfig
    from abbench.engine.runtime.engine import Engine

    mc = PRESETS[model]
    if layers:
        mc = mc.first_layers(layers, name=f"{mc.name}-{layers}l")
    prompt = torch.randint(10, mc.vocab_size - 10, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    base = dict(model=mc, weights="random:0", device=str(device), dtype=str(dtype).removeprefix("torch."),
                chunk_tokens=chunk, max_context=tokens + 8, layer_major_window_tokens=-(-tokens // chunk) * chunk,
                bandwidth_probe_bytes=0, warm_decode_graphs=False)
    streaming = dict(prefill_mode="layer-major", gpu_memory_budget_gib=budget_gib,
                     **({} if max_context is None else {"max_context": max_context}))
    rows = []
    kinds = {"resident": ("resident", dict(prefill_mode="resident")),
             "model-dtype": ("layer-major, model-dtype bank", streaming),
             "fp8": ("layer-major, fp8 bank", dict(streaming, expert_dtype="fp8")),
             "resident-fp8": ("resident, fp8 bank", dict(prefill_mode="resident", expert_dtype="fp8"))}
    for short in engines:
        kind, *variants = short.split(":")
        name, extra = kinds[kind]
        for v in variants:
            name, extra = name + VARIANTS[v][0], {**extra, **VARIANTS[v][1]}
        engine = Engine(EngineConfig(**{**base, **extra}))
        if "moe-graphs" in variants and engine.device.type == "cuda" and engine.steps.graphs is None:
            engine.model.prefill_graph_moe = True
            engine.steps = engine._layer_steps()
        beside = (BesideCopies(engine) if "beside-copies" in variants
                  else BesideCopies(engine, to_host=True) if "beside-d2h" in variants
                  else BesideHostTraffic(engine) if "beside-host" in variants else None)
        with torch.no_grad():
            trace = None if trace_dir is None else trace_dir / f"{short.replace(':', '-')}.json.gz"
            rows.append({"engine": name, "prefill_graphs": engine.prefill_graphs_mode,
                         **profile_prefill(engine, prompt, trace=trace, timed=timed, beside=beside)})
        del engine, beside
        release(device.type == "cuda")
    return rows


def _print_profiles(rows: list[dict]) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    print(f"{'engine':<30} {'prefill ms':>10} {'compute':>9} {'copies':>9} {'dequant':>9} {'copy wait':>9} "
          f"{'first ms':>9} {'timed ms':>9}")
    for r in rows:
        print(f"{r['engine']:<30} {ms(r['prefill_s']):>10} {ms(r['compute_busy_s']):>9} {ms(r['copy_busy_s']):>9} "
              f"{ms(r['dequant_s']):>9} {ms(r['copy_wait_s']):>9} {ms(r['first_prefill_s']):>9} "
              f"{ms(r['timed_prefill_s']):>9}")
    for r in rows:
        for name, sec in r["top_kernels"] or []:
            print(f"  {r['engine']:<28} {sec * 1e3:9.1f} ms  {name}")
    for r in rows:
        g = r["compute_stream"]
        if g is None:
            continue
        print(f"{r['engine']}: compute stream span {g['span_s'] * 1e3:.1f} ms, busy {g['busy_s'] * 1e3:.1f}, "
              f"{g['gaps']} gaps: {g['host_late_s'] * 1e3:.1f} ms with the host late, {g['queued_s'] * 1e3:.1f} ms "
              f"queued; host {g['host_calls_s'] * 1e3:.1f} ms in CUDA calls, {g['host_between_s'] * 1e3:.1f} ms "
              f"between them, median launch {g['launch_median_us'] or 0:.1f} us")
        for side, what in (("beside_copies", "beside a copy"), ("apart_from_copies", "apart from copies")):
            n, sec = g[side]
            if n:
                print(f"    queued {what}: {n} gaps, {sec * 1e3:.1f} ms, {sec / n * 1e6:.2f} us a gap")
        for name, (n, sec) in sorted(g["queued_by_launch"].items(), key=lambda kv: -kv[1][1]):
            print(f"    queued before what {name} launched: {n} gaps, {sec * 1e3:.1f} ms, {sec / n * 1e6:.2f} us a gap")
        for gap, late, name, call in g["top_gaps"]:
            print(f"    gap {gap * 1e3:7.3f} ms (host late {late * 1e3:7.3f}) before {name} ({call})")
        for name, (n, sec) in sorted(g["slow_calls"].items(), key=lambda kv: -kv[1][1])[:6]:
            print(f"    host call >= 0.1 ms: {name} x{n}, {sec * 1e3:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m abbench.engine.tools.gpucheck_fp8", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="preset (default: qwen3-30b-a3b on cuda, tiny on cpu)")
    p.add_argument("--tokens", type=int, default=None, help="tokens of the prefill chunk (default 2048; 64 on cpu)")
    p.add_argument("--programs", default="0,8,16,32,64,132",
                   help="dequantize_fp8 grids to time, comma-separated; 0 = the full grid")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    p.add_argument("--prefill-tokens", type=int, default=0, metavar="N",
                   help="instead: profile one N-token prefill on resident, bf16-bank and FP8-bank engines")
    p.add_argument("--layers", type=int, default=None, help="--prefill-tokens: the first N layers (8 on cuda)")
    p.add_argument("--budget", type=float, default=None,
                   help="--prefill-tokens: the streaming engines' --gpu-memory-budget (GiB), as a service's")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"--prefill-tokens: which engines, in this order (of {', '.join(KINDS)}; "
                        "NAME:eager without prefill graphs, NAME:copy-dequant with FP8 layers dequantized on the copy "
                        "stream, NAME:gemm with FP8 multiplied in the grouped GEMM, NAME:w8a8 FP8 by FP8, "
                        "NAME:beside-copies with a bank's worth of host-to-device copies beside each prefill, "
                        "NAME:beside-d2h with the same copies device to host, "
                        "NAME:beside-host with host-memory traffic beside it, NAME:moe-graphs with the MoE halves "
                        "replayed from CUDA graphs where the model has none, NAME:prefill-triton with the attention "
                        "half's norms, rope, cache write and router top-k as Triton's fused kernels)")
    p.add_argument("--timed", type=int, default=3,
                   help="--prefill-tokens: unprofiled prefills per engine, timed (their median: 'timed ms')")
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="--prefill-tokens: keep each profiled prefill's Chrome trace there (gzipped)")
    p.add_argument("--max-context", type=int, default=None,
                   help="--prefill-tokens: the streaming engines' --max-context (default: the prompt's length)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = args.model or ("qwen3-30b-a3b" if cuda else "tiny")
    tokens = args.tokens or (2048 if cuda else 64)
    dtype = torch.bfloat16 if cuda else torch.float32
    engines = tuple(args.engines.split(","))
    if not engines or not all(e.split(":")[0] in KINDS and set(e.split(":")[1:]) <= set(VARIANTS) for e in engines):
        p.error(f"--engines: a comma-separated list of {', '.join(KINDS)}, each maybe with variants "
                f"(NAME:{', NAME:'.join(VARIANTS)}), got {args.engines!r}")
    if args.prefill_tokens:
        layers = args.layers if args.layers is not None else (8 if cuda else None)
        rows = prefill_profiles(model, layers, args.prefill_tokens, tokens, device, dtype, args.budget,
                                args.max_context, args.trace_dir, engines, args.timed)
        print(f"{model} ({layers or 'all'} layers), {device}, {dtype}, {args.prefill_tokens}-token prefill in "
              f"{tokens}-token chunks")
        _print_profiles(rows)
        if args.out:
            args.out.write_text(json.dumps({"model": model, "layers": layers, "device": str(device),
                                            "prefill_tokens": args.prefill_tokens, "chunk_tokens": tokens,
                                            "budget_gib": args.budget, "max_context": args.max_context,
                                            "rows": rows}, indent=1))
        return 0
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
