"""Time the candidate decode kernels (``decode_kernels``) against the engine's own, one layer at full width.

``python -m abbench.engine.tools.gpucheck_decode_kernels [--model qwen3-30b-a3b] [--contexts 4096,32768,131072]``

For one token of the preset's shape, with random weights and cache:

- the routed experts: the engine's ``moe_experts`` (two ``torch._grouped_mm`` over all E groups) against
  ``moe_one_token`` (Triton, the k routed experts only), where Triton runs;
- the attention at each context (the cache filled up to it, the token at its last position, the bucket equal
  to it): the engine's ``decode_gqa`` (two batched matmuls and a float32 softmax) against the split-KV Triton
  kernel (also with the position at half the bucket), SDPA with an additive mask over the same static bucket,
  and SDPA over exactly the filled positions (no mask, one shape per position);
- the batched decode step's kernels at each ``--batch`` size B, where Triton runs: ``moe_tokens`` over B tokens'
  random routes (each expert read once; floor: the union's bytes) against B ``moe_one_token`` calls, the q
  projection as ``linear_rows`` against ``F.linear``, and ``attention_rows`` over B caches at the longest context
  against B ``attention_split_kv`` calls.

Each candidate is checked against the engine's function (largest difference relative to the largest value,
``--tolerance``) and timed: on CUDA as the median of ``--replays`` replays of a CUDA graph of one call (so launch
costs are what a decode step's graph pays), with SDPA's kernels limited as the engine limits them, against the memory floor (bytes read / ``--bandwidth``); on CPU
eagerly (that runs the same code at a tiny shape, for the tests; its times mean nothing). Prints a table; writes
JSON with ``--out``; exits 1 when a candidate disagrees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from abbench.engine.ops import kernels as dk
from abbench.engine.tools import reference_kernels as rk
from abbench.engine.runtime.graphs import GraphCache
from abbench.engine.config import PRESETS
from abbench.engine.ops.dense import attention_backends, decode_gqa
from abbench.engine.ops.moe import grouped_mm, looped_mm, moe_experts, probe_grouped_mm


def _time_us(fn: Callable[[], torch.Tensor], device: torch.device, replays: int) -> float:
    """Median microseconds of one call: CUDA graph replays on CUDA, eager calls elsewhere."""
    if device.type != "cuda":
        times = []
        for _ in range(max(3, min(replays, 10))):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    graphs, key = GraphCache(device), ("candidate",)
    for _ in range(3):  # eager (compiles, autotunes, allocates), captured and replayed, replayed
        graphs.run(key, fn)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graphs.run(key, fn)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _rel_diff(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.float(), got.float()
    return float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-30))


def run(model: str, device: torch.device, dtype: torch.dtype, contexts: list[int], replays: int,
        bandwidth: float, tolerance: float, moe_blocks: list[tuple[int, int]] = ((16, 256),),
        batch: list[int] = ()) -> tuple[bool, list[dict]]:
    cfg = PRESETS[model]
    E, H, inter, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict] = []
    ok = True
    mm = grouped_mm if probe_grouped_mm(device, dtype) else looped_mm

    def row(part: str, name: str, us: float, floor_bytes: int, diff: float | None) -> None:
        nonlocal ok
        agree = diff is None or diff <= tolerance
        ok &= agree
        rows.append({"part": part, "candidate": name, "us": round(us, 2), "floor_us": round(floor_bytes / bandwidth * 1e6, 2),
                     "rel_diff": diff, "agrees": agree})

    # -- the routed experts of one token
    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    gate_up = randn(E, 2 * inter, H, scale=H ** -0.5)  # [E, 2I, H]
    down = randn(E, H, inter, scale=inter ** -0.5)  # [E, H, I]
    h = randn(1, H)  # [1, H]
    ids = torch.randperm(E, generator=gen, device=device)[:k].view(1, k)  # [1, k] distinct experts
    w = torch.softmax(torch.randn(1, k, generator=gen, device=device), dim=-1).to(dtype)  # [1, k]
    expert_bytes = 3 * H * inter * gate_up.element_size()
    ref = moe_experts(h, w, ids, gate_up, down, mm)
    row("experts", "engine: grouped GEMM over E groups" if mm is grouped_mm else "engine: per-expert loop",
        _time_us(lambda: moe_experts(h, w, ids, gate_up, down, mm), device, replays), k * expert_bytes, None)
    for bn, bk in moe_blocks if dk.have_triton() else ():
        got = dk.moe_one_token(h, w, ids, gate_up, down, block_n=bn, block_k=bk)
        row("experts", f"triton: k routed experts (GEMV), blocks {bn}x{bk}",
            _time_us(lambda: dk.moe_one_token(h, w, ids, gate_up, down, block_n=bn, block_k=bk), device, replays),
            k * expert_bytes, _rel_diff(ref, got))
    del gate_up, down

    # -- attention of one token at each context
    max_len = max(contexts)
    keys, values = randn(hkv, max_len, d), randn(hkv, max_len, d)  # [Hkv, L, D] each
    q = randn(hq, 1, d)  # [Hq, 1, D]
    scale = d ** -0.5
    for n in contexts:
        pos = torch.tensor([n - 1], device=device)
        kv_bytes = 2 * hkv * n * d * keys.element_size()
        kn, vn = keys[:, :n], values[:, :n]
        hidden = torch.arange(n, device=device) > pos
        ref = decode_gqa(q, kn, vn, hidden, scale)
        row(f"attention {n}", "engine: bmm + float32 softmax, masked bucket",
            _time_us(lambda: decode_gqa(q, kn, vn, torch.arange(n, device=device) > pos, scale), device, replays),
            kv_bytes, None)
        if dk.have_triton():
            row(f"attention {n}", "triton: split-KV flash decoding over the bucket",
                _time_us(lambda: dk.attention_split_kv(q, kn, vn, pos, scale), device, replays), kv_bytes,
                _rel_diff(ref, dk.attention_split_kv(q, kn, vn, pos, scale)))
            half = torch.tensor([n // 2], device=device)  # the bucket half filled: work should halve
            row(f"attention {n}", "triton: split-KV, position at half the bucket",
                _time_us(lambda: dk.attention_split_kv(q, kn, vn, half, scale), device, replays), kv_bytes // 2,
                _rel_diff(decode_gqa(q, kn, vn, torch.arange(n, device=device) > half, scale),
                          dk.attention_split_kv(q, kn, vn, half, scale)))
        row(f"attention {n}", "sdpa: mask over the bucket",
            _time_us(lambda: rk.attention_sdpa(q, kn, vn, pos, scale), device, replays), kv_bytes,
            _rel_diff(ref, rk.attention_sdpa(q, kn, vn, pos, scale)))
        row(f"attention {n}", "sdpa: exactly the filled positions (no graph in a step)",
            _time_us(lambda: rk.attention_sdpa_exact(q, keys, values, n, scale), device, replays), kv_bytes,
            _rel_diff(ref, rk.attention_sdpa_exact(q, keys, values, n, scale)))
    for b in batch if dk.have_triton() else ():
        rows_b = _batched(cfg, device, dtype, b, max(batch), contexts, replays, randn, gen)
        for part, name, us, floor_bytes, diff in rows_b:
            row(part, name, us, floor_bytes, diff)
    return ok, rows


def _batched(cfg, device: torch.device, dtype: torch.dtype, b: int, max_tokens: int, contexts: list[int],
             replays: int, randn, gen) -> list[tuple]:
    """The batched decode step's kernels for ``b`` tokens (module docstring): each against ``b`` one-token calls of
    the kernel a solo step used before them, on the same inputs (the largest difference from those)."""
    from abbench.engine.ops import batch_attention as ba

    E, H, inter, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = []
    gate_up = randn(E, 2 * inter, H, scale=H ** -0.5)
    down = randn(E, H, inter, scale=inter ** -0.5)
    h = randn(b, H)
    ids = torch.stack([torch.randperm(E, generator=gen, device=device)[:k] for _ in range(b)])  # [B, k]
    w = torch.softmax(torch.randn(b, k, generator=gen, device=device), dim=-1).to(dtype)
    union = len(set(ids.flatten().tolist()))
    expert_bytes = 3 * H * inter * gate_up.element_size()
    one = torch.cat([dk.moe_one_token(h[i:i + 1], w[i:i + 1], ids[i:i + 1], gate_up, down) for i in range(b)])
    out.append((f"experts, {b} tokens", f"triton: {b} x moe_one_token",
                _time_us(lambda: [dk.moe_one_token(h[i:i + 1], w[i:i + 1], ids[i:i + 1], gate_up, down)
                                  for i in range(b)], device, replays), b * k * expert_bytes, None))
    out.append((f"experts, {b} tokens", f"triton: moe_tokens ({union} experts, each read once)",
                _time_us(lambda: dk.moe_tokens(h, w, ids, gate_up, down, max_tokens=max_tokens), device, replays),
                union * expert_bytes, _rel_diff(one, dk.moe_tokens(h, w, ids, gate_up, down, max_tokens=max_tokens))))
    del gate_up, down
    wq = randn(hq * d, H, scale=H ** -0.5)  # the q projection, the largest of a layer's attention weights
    ref = torch.nn.functional.linear(h, wq)
    out.append((f"q projection, {b} tokens", "torch: F.linear [B, H]",
                _time_us(lambda: torch.nn.functional.linear(h, wq), device, replays), wq.numel() * wq.element_size(),
                None))
    out.append((f"q projection, {b} tokens", "triton: linear_rows (a GEMV per token)",
                _time_us(lambda: ba.linear_rows(h, wq), device, replays), wq.numel() * wq.element_size(),
                _rel_diff(ref, ba.linear_rows(h, wq))))
    n = max(contexts)
    keys, values = randn(b, hkv, n, d), randn(b, hkv, n, d)  # b caches, the tokens at their last position
    q = randn(b, hq, d)
    pos = torch.full((b,), n - 1, device=device)
    index = torch.arange(b, device=device)
    plan = ba.split_plans([n] * b, device=device)
    split_max = ba.split_plan(n)[1]
    scale = d ** -0.5
    single = torch.cat([dk.attention_split_kv(q[i].view(hq, 1, d), keys[i], values[i], pos[i:i + 1], scale)
                        .view(1, hq, d) for i in range(b)])
    kv_bytes = b * 2 * hkv * n * d * keys.element_size()
    out.append((f"attention {n}, {b} tokens", f"triton: {b} x attention_split_kv",
                _time_us(lambda: [dk.attention_split_kv(q[i].view(hq, 1, d), keys[i], values[i], pos[i:i + 1], scale)
                                  for i in range(b)], device, replays), kv_bytes, None))
    out.append((f"attention {n}, {b} tokens", "triton: attention_rows (each its own cache)",
                _time_us(lambda: ba.attention_rows(q, keys, values, pos, index, plan, scale, split_max), device,
                         replays), kv_bytes,
                _rel_diff(single, ba.attention_rows(q, keys, values, pos, index, plan, scale, split_max))))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m abbench.engine.tools.gpucheck_decode_kernels",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="preset (default: qwen3-30b-a3b on cuda, tiny on cpu)")
    p.add_argument("--contexts", default=None, help="comma-separated KV lengths (default 4096,32768,131072 on "
                   "cuda, 64,256 on cpu)")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--moe-blocks", default="4x1024", help="Triton experts: comma-separated BLOCK_NxBLOCK_K tiles")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s of the memory floor (H200 HBM3e)")
    p.add_argument("--tolerance", type=float, default=2e-2, help="largest relative difference a candidate may have")
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated token counts for the batched decode step's "
                   "kernels (each against as many one-token calls; '' for none)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = args.model or ("qwen3-30b-a3b" if cuda else "tiny")
    contexts = [int(v) for v in args.contexts.split(",")] if args.contexts else (
        [4096, 32768, 131072] if cuda else [64, 256])
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.no_grad(), attention_backends():  # SDPA's kernels as the engine allows them
        blocks = [tuple(int(v) for v in b.split("x")) for b in args.moe_blocks.split(",")]
        batch = [int(v) for v in args.batch.split(",") if v.strip()]
        ok, rows = run(model, device, dtype, contexts, args.replays, args.bandwidth, args.tolerance, blocks, batch)
    print(f"{model}, {device}, {dtype}, triton: {dk.have_triton()}")
    print(f"{'part':<24} {'candidate':<60} {'us':>9} {'floor us':>9} {'x floor':>8} {'rel diff':>9}")
    for r in rows:
        x = r["us"] / r["floor_us"] if r["floor_us"] else float("nan")
        diff = "-" if r["rel_diff"] is None else f"{r['rel_diff']:.1e}"
        print(f"{r['part']:<24} {r['candidate']:<60} {r['us']:>9.1f} {r['floor_us']:>9.1f} {x:>8.2f} {diff:>9}"
              + ("" if r["agrees"] else "  DISAGREES"))
    if args.out:
        args.out.write_text(json.dumps({"model": model, "device": str(device), "rows": rows}, indent=1))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
