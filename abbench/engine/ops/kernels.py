"""Decode's Triton kernels: one token through a layer in ~16 kernels instead of ~70 (``decode.Decoder`` picks
them: ``EngineConfig.decode_experts`` / ``decode_attention``, "auto" = these on CUDA where they apply).

On the H200 (results/20261201n-h200-decode-kernels) they took a resident Qwen3-30B-A3B decode step from 0.402 to
0.147 ms a layer at 32K; ``tools.gpucheck_decode_kernels`` times each against the engine's torch functions at full
width. Each follows its torch counterpart's roundings in the model dtype where that is cheap, with float32
accumulation; none is bitwise equal to it (other summation orders), and each is deterministic (no atomics).

- ``moe_tokens(h, top_w, top_ids, gate_up, down)``: the routed SwiGLU experts of B decode tokens, [B, H] ->
  [B, H], as four Triton kernels that read only the routed experts' rows (ids read on the device, so they
  capture in a CUDA graph): one program groups the (token, expert) pairs by expert (and, with a slot table,
  looks the batch's experts up once each); per expert and block of rows the gate and up rows, read once for
  all its tokens, give each token silu(gate) x up (float32 accumulation); the down projection likewise; a last
  kernel sums each token's k experts weighted by the router in a fixed order (deterministic: no atomics) and
  adds the residual. A token's sums never depend on the other tokens, so its bits are the same alone and in
  any batch (``max_tokens`` fixes the compiled sizes). ``moe_one_token`` is its one-token case. Needs Triton
  (CUDA; on CPU only under ``TRITON_INTERPRET=1``). Not bitwise equal to the grouped GEMM (another order).
- ``attention_split_kv(q, keys, values, pos, scale)``: one token's grouped-query attention as a flash-decoding
  kernel (Triton): the static bucket of keys is cut into ``NSPLITS`` ranges, one program per (KV head, range)
  runs an online softmax over the range's keys up to ``pos`` (read on the device: ranges past it do no work,
  so a step costs what the filled positions cost, and the graph of a bucket serves every position in it), all
  G query heads of the KV head at once (one ``tl.dot`` of [G, D] x [D, BLOCK_L]), float32 statistics; a second
  kernel combines the ranges. The decode_gqa contract, not its bits.
- ``rms_norm(x, weight, eps, residual=None, plus_one=False)``: ``model.rms_norm`` (or ``hybrid.zc_rms_norm``)
  as one kernel, optionally after the residual add (returning the sum too).
- ``qk_norm_rope_store(q, k, v, ...)``: the per-head q/k norms, RoPE at the device-held position and the K/V
  cache write of one decode token, one kernel.
- ``route_topk(logits, k, norm, dtype, bias, lookup)``: the router's softmax, top-k and renormalisation, one
  kernel; with ``lookup`` the same program looks the experts up in the decode slot cache's device-side table
  (``slot_assign``: the host LRU's policy), for offloaded decode with the misses on the device.
- ``moe_tokens``' ``lookup`` / ``host``: slot-cache misses read from the registered host bank (zero-copy over
  PCIe) by the experts' kernels, which compute with them and store them into their slots; from an FP8 bank
  they are read as float8 with their row scales and dequantized in the kernel (the same bits as the host's copy
  and dequantization).
- ``dequantize_fp8(out, q, scale, block)``: an FP8 bank's streamed experts into the compute dtype, one kernel,
  the same bits as ``bank.dequantize_into`` (``ExpertStore`` uses it on CUDA for every FP8 copy).

The batched decode step's attention half (Qwen3-MoE) is :mod:`abbench.engine.ops.batch_attention`.
The reference kernels no request runs (the lookup and the miss copy as kernels of their own, SDPA's decode
attention) are :mod:`abbench.engine.tools.reference_kernels`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from abbench.engine.ops.batch_attention import attention_rows, next_pow2, qk_norm_rope_store_rows, split_plan

try:  # optional: CUDA builds of torch ship Triton; the CPU build does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


def have_triton() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _group_experts(ids_ptr, given_src_ptr, slots_ptr, src_ptr, members_ptr, tok_counts_ptr, slot_of_ptr,
                       expert_of_ptr, stamp_ptr, tick_ptr, counts_ptr, P, K: tl.constexpr, PP: tl.constexpr,
                       M: tl.constexpr, LOOKUP: tl.constexpr, HAS_SRC: tl.constexpr, TOK_COUNTS: tl.constexpr,
                       S: tl.constexpr, SP: tl.constexpr, IDENTITY: tl.constexpr, STEP: tl.constexpr,
                       NEVER: tl.constexpr):
        p = tl.arange(0, PP)  # the routed (token, expert) pairs, token-major: pair p is token p // K's
        pm = p < P
        ids = tl.load(ids_ptr + p, mask=pm, other=0).to(tl.int32)
        same = (ids[:, None] == ids[None, :]) & pm[:, None] & pm[None, :]  # [PP, PP] routed to one expert
        before = same & (p[None, :] < p[:, None])  # (q, q'): an earlier pair q' of q's expert
        rank = tl.sum(before.to(tl.int32), axis=1)  # [PP] each pair's place among its expert's pairs
        lead = tl.min(tl.where(same, p[None, :], PP), axis=1)  # [PP] its expert's first pair
        first = pm & (rank == 0)
        for m in tl.static_range(M):  # members[q, m]: the m-th pair of q's expert if q leads it, else -1
            mem = tl.max(tl.where((lead[None, :] == p[:, None]) & (rank[None, :] == m) & pm[None, :],
                                  p[None, :], -1), axis=1)
            tl.store(members_ptr + p * M + m, mem, mask=pm)
        if LOOKUP:  # the batch's experts (each once, its first pair's lane) looked up in the slot table
            hit, miss = slot_assign(tl.where(first, ids, 0), first, slot_of_ptr, expert_of_ptr, stamp_ptr, tick_ptr,
                                    counts_ptr, slots_ptr, src_ptr, PP, PP, S, SP, IDENTITY, STEP, NEVER)
            if TOK_COUNTS:  # each lookup charged to the token of the expert's first pair
                b = tl.arange(0, M)
                on = (p // K)[None, :] == b[:, None]  # [M, PP]
                nh = tl.sum((on & hit[None, :]).to(tl.int64), axis=1)
                nm = tl.sum((on & miss[None, :]).to(tl.int64), axis=1)
                tl.store(tok_counts_ptr + 2 * b, tl.load(tok_counts_ptr + 2 * b) + nh)
                tl.store(tok_counts_ptr + 2 * b + 1, tl.load(tok_counts_ptr + 2 * b + 1) + nm)
        else:  # ids index the weights already (resident experts, or slots the host looked up)
            tl.store(slots_ptr + p, ids.to(tl.int64), mask=first)
            if HAS_SRC:
                tl.store(src_ptr + p, tl.load(given_src_ptr + p, mask=first, other=-1), mask=first)
            else:
                tl.store(src_ptr + p, tl.full([PP], -1, tl.int32), mask=first)

    @triton.jit
    def _gate_up_group(h_ptr, w_ptr, slots_ptr, src_ptr, members_ptr, out_ptr, host_ptr, scale_ptr, wscale_ptr,
                       H: tl.constexpr, I: tl.constexpr, K: tl.constexpr, M: tl.constexpr, stride_we, stride_wn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FETCH: tl.constexpr, FP8: tl.constexpr,
                       SLOT_FP8: tl.constexpr, VEC: tl.constexpr):
        p = tl.program_id(0)  # a routed pair; the first pair of each expert does its expert's work
        nb = tl.program_id(1)
        mi = tl.arange(0, M)
        mem = tl.load(members_ptr + p * M + mi)  # [M] the expert's pairs (p first), -1 past them
        if tl.load(members_ptr + p * M) == p:
            e = tl.load(slots_ptr + p).to(tl.int64)
            code = tl.load(src_ptr + p).to(tl.int64)  # -1: its slot; >= 0: a miss of that expert (read from
            # the host bank and left in the slot); <= -2: expert -code - 2 from the host bank (read only)
            hx = tl.where(code >= 0, code, -code - 2)
            rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            rmask = rows < I
            base = w_ptr + e * stride_we
            hq = host_ptr + tl.maximum(hx, 0) * stride_we
            if FP8:  # the host expert's row scales (float32, one per output row of gate and of up)
                # (a row mask and the scalar code are combined by tl.where, not &: the same mask, and Triton's
                # interpreter refuses the & of a block and a scalar as a mask)
                sm = tl.where(code != -1, rmask, False)
                at = tl.maximum(hx, 0) * 2 * I + rows
                sg = tl.load(scale_ptr + at, mask=sm, other=1.0)
                su = tl.load(scale_ptr + at + I, mask=sm, other=1.0)
            if SLOT_FP8:  # FP8 slots: the slot's row scales (a miss leaves the bank's there)
                wat = e * 2 * I + rows
                ssg = tl.load(wscale_ptr + wat, mask=tl.where(code == -1, rmask, False), other=1.0)
                ssu = tl.load(wscale_ptr + wat + I, mask=tl.where(code == -1, rmask, False), other=1.0)
                if FETCH:  # (a fetch into FP8 slots reads an FP8 bank: FP8 holds)
                    tl.store(wscale_ptr + wat, sg, mask=tl.where(code >= 0, rmask, False))
                    tl.store(wscale_ptr + wat + I, su, mask=tl.where(code >= 0, rmask, False))
                    ssg = tl.where(code == -1, ssg, sg)
                    ssu = tl.where(code == -1, ssu, su)
            dt = h_ptr.dtype.element_ty  # the compute dtype
            acc_g = tl.zeros([M, BLOCK_N], dtype=tl.float32)  # row j: pair mem[j]
            acc_u = tl.zeros([M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < H
                m = rmask[:, None] & cmask[None, :]
                # at most VEC columns a thread (16 bytes of the compute dtype): Triton lays a tile out by its
                # loads' width, and the row sums below follow the layout. float8 loads would otherwise take 16
                # a thread over 2 x 2 warps where bfloat16's take 8 over 1 x 4, and FP8 slots would sum in another
                # order than slots holding the same weights dequantized (results/20261206t: other ids at full
                # width; tests/engine/test_kernels_compile.py compares the layouts). On the offsets, not on cols:
                # a loop of one block folds k0 + arange into arange, and a hint on cols with it
                g_off = tl.max_contiguous(rows[:, None] * stride_wn + cols[None, :], [1, VEC])
                u_off = tl.max_contiguous((rows[:, None] + I) * stride_wn + cols[None, :], [1, VEC])
                # the tile is read once for every pair of the expert
                if SLOT_FP8:  # float8 from the slot or the host bank, dequantized as bank.dequantize_into
                    # does (q * scale in float32 rounded once to the compute dtype); a miss's float8 into its slot
                    if FETCH:
                        src_w = tl.where(code == -1, base, hq)
                    else:
                        src_w = base
                    qg = tl.load(src_w + g_off, mask=m, other=0.0)
                    qu = tl.load(src_w + u_off, mask=m, other=0.0)
                    if FETCH:
                        tl.store(base + g_off, qg, mask=tl.where(code >= 0, m, False))
                        tl.store(base + u_off, qu, mask=tl.where(code >= 0, m, False))
                    wg = (qg.to(tl.float32) * ssg[:, None]).to(dt)
                    wu = (qu.to(tl.float32) * ssu[:, None]).to(dt)
                elif FETCH:
                    if code != -1:  # from the host bank (as FP8: dequantized as bank.dequantize_into does,
                        # q * scale in float32 rounded once to the slots' dtype); a miss also into its slot
                        if FP8:
                            wg = (tl.load(hq + g_off, mask=m, other=0.0).to(tl.float32) * sg[:, None]).to(dt)
                            wu = (tl.load(hq + u_off, mask=m, other=0.0).to(tl.float32) * su[:, None]).to(dt)
                        else:
                            wg = tl.load(hq + g_off, mask=m, other=0.0)
                            wu = tl.load(hq + u_off, mask=m, other=0.0)
                        tl.store(base + g_off, wg, mask=tl.where(code >= 0, m, False))
                        tl.store(base + u_off, wu, mask=tl.where(code >= 0, m, False))
                    else:
                        wg = tl.load(base + g_off, mask=m, other=0.0)
                        wu = tl.load(base + u_off, mask=m, other=0.0)
                else:
                    wg = tl.load(base + g_off, mask=m, other=0.0)
                    wu = tl.load(base + u_off, mask=m, other=0.0)
                wgf = wg.to(tl.float32)
                wuf = wu.to(tl.float32)
                for j in tl.static_range(M):  # each pair's sums in the same order whatever the batch
                    q = tl.load(members_ptr + p * M + j)
                    if q >= 0:
                        x = tl.load(h_ptr + (q // K) * H + cols, mask=cmask, other=0.0).to(tl.float32)
                        acc_g = tl.where(mi[:, None] == j, acc_g + tl.sum(wgf * x[None, :], axis=1)[None, :], acc_g)
                        acc_u = tl.where(mi[:, None] == j, acc_u + tl.sum(wuf * x[None, :], axis=1)[None, :], acc_u)
            act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(out_ptr + mem[:, None] * I + rows[None, :], act, mask=(mem >= 0)[:, None] & rmask[None, :])

    @triton.jit
    def _down_group(a_ptr, w_ptr, slots_ptr, src_ptr, members_ptr, y_ptr, host_ptr, scale_ptr, wscale_ptr, h_ptr,
                    H: tl.constexpr, I: tl.constexpr, M: tl.constexpr, stride_we, stride_wn, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, FETCH: tl.constexpr, FP8: tl.constexpr, SLOT_FP8: tl.constexpr,
                    VEC: tl.constexpr):
        p = tl.program_id(0)  # as _gate_up_group: the expert's first pair does the work, for all its pairs
        nb = tl.program_id(1)
        mi = tl.arange(0, M)
        mem = tl.load(members_ptr + p * M + mi)
        if tl.load(members_ptr + p * M) == p:
            e = tl.load(slots_ptr + p).to(tl.int64)
            code = tl.load(src_ptr + p).to(tl.int64)
            hx = tl.where(code >= 0, code, -code - 2)
            rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            rmask = rows < H
            base = w_ptr + e * stride_we
            hq = host_ptr + tl.maximum(hx, 0) * stride_we
            if FP8:
                sd = tl.load(scale_ptr + tl.maximum(hx, 0) * H + rows, mask=tl.where(code != -1, rmask, False),
                             other=1.0)
            if SLOT_FP8:
                ssd = tl.load(wscale_ptr + e * H + rows, mask=tl.where(code == -1, rmask, False), other=1.0)
                if FETCH:
                    tl.store(wscale_ptr + e * H + rows, sd, mask=tl.where(code >= 0, rmask, False))
                    ssd = tl.where(code == -1, ssd, sd)
            dt = h_ptr.dtype.element_ty  # the compute dtype
            acc = tl.zeros([M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < I
                m = rmask[:, None] & cmask[None, :]
                off = tl.max_contiguous(rows[:, None] * stride_wn + cols[None, :], [1, VEC])  # as in _gate_up_group
                if SLOT_FP8:  # as in _gate_up_group
                    if FETCH:
                        src_w = tl.where(code == -1, base, hq)
                    else:
                        src_w = base
                    q = tl.load(src_w + off, mask=m, other=0.0)
                    if FETCH:
                        tl.store(base + off, q, mask=tl.where(code >= 0, m, False))
                    w = (q.to(tl.float32) * ssd[:, None]).to(dt)
                elif FETCH:
                    if code != -1:
                        if FP8:
                            w = (tl.load(hq + off, mask=m, other=0.0).to(tl.float32) * sd[:, None]).to(dt)
                        else:
                            w = tl.load(hq + off, mask=m, other=0.0)
                        tl.store(base + off, w, mask=tl.where(code >= 0, m, False))
                    else:
                        w = tl.load(base + off, mask=m, other=0.0)
                else:
                    w = tl.load(base + off, mask=m, other=0.0)
                wf = w.to(tl.float32)
                for j in tl.static_range(M):
                    q = tl.load(members_ptr + p * M + j)
                    if q >= 0:
                        a = tl.load(a_ptr + q * I + cols, mask=cmask, other=0.0)
                        acc = tl.where(mi[:, None] == j, acc + tl.sum(wf * a[None, :], axis=1)[None, :], acc)
            tl.store(y_ptr + mem[:, None] * H + rows[None, :], acc, mask=(mem >= 0)[:, None] & rmask[None, :])

    @triton.jit
    def _combine(y_ptr, tw_ptr, res_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_RES: tl.constexpr):
        b = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < H
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(0, K):  # the routed experts in routing order: a fixed summation order
            wj = tl.load(tw_ptr + b * K + j).to(tl.float32)
            total += wj * tl.load(y_ptr + (b * K + j) * H + rows, mask=rmask, other=0.0)
        y = total.to(out_ptr.dtype.element_ty)  # the experts' sum in the model dtype, as the grouped path's
        if HAS_RES:  # the residual x + y, rounded as torch's x + y
            r = tl.load(res_ptr + b * H + rows, mask=rmask, other=0.0).to(tl.float32)
            y = (r + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * H + rows, y, mask=rmask)


if triton is not None:
    @triton.jit
    def _fetch_rows(host_ptr, w_ptr, slots_ptr, src_ptr, members_ptr, scale_ptr, wscale_ptr, R: tl.constexpr,
                    C: tl.constexpr, M: tl.constexpr, stride_we, stride_wn, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr, FP8: tl.constexpr, SLOT_FP8: tl.constexpr, DEQUANT: tl.constexpr):
        p = tl.program_id(0)  # a predicted pair; the first pair of each expert copies it, if it was given a slot
        if tl.load(members_ptr + p * M) == p:
            code = tl.load(src_ptr + p).to(tl.int64)  # >= 0: a miss of that expert given a slot; else nothing
            if code >= 0:
                e = tl.load(slots_ptr + p).to(tl.int64)
                rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
                rmask = rows < R
                base = w_ptr + e * stride_we
                hq = host_ptr + code * stride_we
                if FP8:  # the bank's row scales: into FP8 slots as they are, or to dequantize with
                    sc = tl.load(scale_ptr + code * R + rows, mask=rmask, other=1.0)
                    if SLOT_FP8:
                        tl.store(wscale_ptr + e * R + rows, sc, mask=rmask)
                for c0 in range(0, C, BLOCK_C):
                    cols = c0 + tl.arange(0, BLOCK_C)
                    m = rmask[:, None] & (cols < C)[None, :]
                    off = rows[:, None] * stride_wn + cols[None, :]
                    w = tl.load(hq + off, mask=m, other=0.0)
                    if DEQUANT:  # as the experts' kernels' fetch: q * scale in float32, rounded once
                        w = (w.to(tl.float32) * sc[:, None]).to(w_ptr.dtype.element_ty)
                    tl.store(base + off, w, mask=m)


if triton is not None:
    @triton.jit
    def _dequant_fp8(q_ptr, s_ptr, out_ptr, NR, PROGRAMS, ITERS: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                     SR: tl.constexpr, SC: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):
        # q viewed as [N * R, C] in blocks of BLOCK_R rows; program p takes blocks p, p + PROGRAMS, ... (ITERS of
        # them; one past the last block is masked off by its rows)
        for it in range(0, ITERS):
            rows = (tl.program_id(0) + it * PROGRAMS) * BLOCK_R + tl.arange(0, BLOCK_R)
            n, r = rows // R, rows % R
            srow = (n * SR + r // BR).to(tl.int64) * SC  # where each row's scales start
            for c0 in range(0, C, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                m = (rows < NR)[:, None] & (cols < C)[None, :]
                at = rows.to(tl.int64)[:, None] * C + cols[None, :]
                scale = tl.load(s_ptr + srow[:, None] + (cols // BC)[None, :], mask=m, other=1.0)
                q = tl.load(q_ptr + at, mask=m, other=0.0).to(tl.float32)
                tl.store(out_ptr + at, (q * scale).to(out_ptr.dtype.element_ty), mask=m)


if triton is not None:
    @triton.jit
    def _rms_norm(x_ptr, a_ptr, w_ptr, sum_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                  ADD: tl.constexpr, PLUS_ONE: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        cm = c < N
        dt = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * N + c, mask=cm, other=0.0)
        if ADD:  # the residual sum first, rounded as torch's x + a, and written out
            x = (x.to(tl.float32) + tl.load(a_ptr + row * N + c, mask=cm, other=0.0).to(tl.float32)).to(dt)
            tl.store(sum_ptr + row * N + c, x, mask=cm)
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
        if PLUS_ONE:  # zero-centred: x / rms * (1 + w) in float32, then the model dtype
            y = (xf * r * (1.0 + w)).to(dt)
        else:  # x / rms in the model dtype, times w (model.rms_norm's roundings)
            y = (w * (xf * r).to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + row * N + c, y, mask=cm)

    @triton.jit
    def _route_topk(logits_ptr, bias_ptr, w_ptr, ids_ptr, slot_of_ptr, expert_of_ptr, stamp_ptr, tick_ptr,
                    counts_ptr, slots_ptr, src_ptr, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                    KP: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, LOOKUP: tl.constexpr,
                    S: tl.constexpr, SP: tl.constexpr, IDENTITY: tl.constexpr, STEP: tl.constexpr,
                    NEVER: tl.constexpr):
        row = tl.program_id(0)  # a token (a lookup: the one token)
        logits_ptr += row * E
        w_ptr += row * K
        ids_ptr += row * K
        e = tl.arange(0, EP)
        em = e < E
        lg = tl.load(logits_ptr + e, mask=em, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            lg += tl.load(bias_ptr + e, mask=em, other=0.0)
        p = tl.exp(lg - tl.max(lg, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(em, p, -1.0)
        kk = tl.arange(0, KP)
        vals = tl.zeros([KP], dtype=tl.float32)
        idx = tl.zeros([KP], dtype=tl.int64)
        for j in tl.static_range(K):  # the k largest in descending order; ties to the lowest expert id
            best = tl.max(p, axis=0)
            at = tl.min(tl.where(p == best, e, EP), axis=0)
            vals = tl.where(kk == j, best, vals)
            idx = tl.where(kk == j, at.to(tl.int64), idx)
            p = tl.where(e == at, -1.0, p)
        if NORM:
            vals = vals / tl.sum(vals, axis=0)
        km = kk < K
        tl.store(w_ptr + kk, vals.to(w_ptr.dtype.element_ty), mask=km)
        tl.store(ids_ptr + kk, idx, mask=km)
        if LOOKUP:  # the slot cache's lookup of these experts (assign_slots), in the same program
            slot_assign(tl.where(km, idx, 0).to(tl.int32), km, slot_of_ptr, expert_of_ptr, stamp_ptr, tick_ptr,
                    counts_ptr, slots_ptr, src_ptr, K, KP, S, SP, IDENTITY, STEP, NEVER)


if triton is not None:
    @triton.jit
    def slot_assign(ids, jm, slot_of_ptr, expert_of_ptr, stamp_ptr, tick_ptr, counts_ptr, slots_ptr, src_ptr,
                K: tl.constexpr, KP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, IDENTITY: tl.constexpr,
                STEP: tl.constexpr, NEVER: tl.constexpr):
        """assign_slots on distinct routed ids [KP] int32 (lanes masked off by jm); returns the (hit, miss) lane
        masks. A miss that finds every slot holding one of this lookup's experts (more experts than slots: a
        batch's) is left uncached: slot 0, src -2 - e (the experts' kernels read it from the host bank)."""
        j = tl.arange(0, KP)
        cur = tl.load(slot_of_ptr + ids, mask=jm, other=-1)  # [KP] each routed expert's slot, -1 if absent
        hit = jm & (cur >= 0)
        miss = jm & (cur < 0)
        s = tl.arange(0, SP)
        sm = s < S
        stamp = tl.load(stamp_ptr + s, mask=sm, other=NEVER)  # [SP] int64; padding is never the oldest
        owner = tl.load(expert_of_ptr + s, mask=sm, other=-1)  # [SP] the expert in each slot, -1 if free
        base = tl.load(tick_ptr) * STEP
        # ranks by expert id, hits first: the order in which the host cache (ExpertStore.decode_experts) touches
        lower = ids[None, :] < ids[:, None]  # [KP, KP] (j, j'): expert j' < expert j
        n_hit = tl.sum(hit.to(tl.int32), axis=0)
        rank_hit = tl.sum((lower & hit[None, :]).to(tl.int32), axis=1)  # [KP]
        rank_miss = tl.sum((lower & miss[None, :]).to(tl.int32), axis=1)  # [KP]
        at = hit[:, None] & (cur[:, None] == s[None, :])  # [KP, SP] the slots hits sit in
        touched = tl.max(at.to(tl.int32), axis=0) > 0  # [SP]
        stamp = tl.where(touched, tl.sum(tl.where(at, base + rank_hit[:, None], 0), axis=0), stamp)
        given = tl.full([KP], -1, tl.int32)  # the slot each miss gets
        evicted = tl.full([KP], -1, tl.int32)  # the expert it held before
        n_miss = tl.sum(miss.to(tl.int32), axis=0)
        for r in tl.static_range(K):  # misses in ascending expert order, each into the least recently used slot
            if r < n_miss:  # (a step's misses are few: the rest of the K rounds do nothing)
                sel = miss & (rank_miss == r)  # [KP] exactly one
                some = tl.sum(sel.to(tl.int32), axis=0) > 0
                e = tl.sum(tl.where(sel, ids, 0), axis=0)
                if IDENTITY:
                    victim = e
                    room = some
                else:
                    oldest = tl.min(stamp, axis=0)
                    victim = tl.min(tl.where(stamp == oldest, s, SP), axis=0)
                    # every slot already holds an expert of this lookup (more experts than slots: a batch's):
                    # this one is read from the host bank and not cached
                    room = some & (oldest < base)
                put = (s == victim) & room
                was = tl.sum(tl.where(put, owner, 0), axis=0)
                stamp = tl.where(put, base + n_hit + r, stamp)
                owner = tl.where(put, e, owner)
                given = tl.where(sel & room, victim, given)
                evicted = tl.where(sel & room, was, evicted)
        tl.store(stamp_ptr + s, stamp, mask=sm)
        tl.store(expert_of_ptr + s, owner, mask=sm)
        tl.store(slot_of_ptr + evicted, -1, mask=miss & (evicted >= 0))
        tl.store(slot_of_ptr + ids, given, mask=miss)  # (-1 for an expert left uncached: absent, as before)
        tl.store(slots_ptr + j, tl.where(hit, cur, tl.maximum(given, 0)).to(tl.int64), mask=jm)
        tl.store(src_ptr + j, tl.where(miss, tl.where(given >= 0, ids, -2 - ids), -1), mask=jm)
        tl.store(counts_ptr, tl.load(counts_ptr) + n_hit)
        tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + n_miss)
        return hit, miss



def attention_applies(head_dim: int) -> bool:
    """Whether ``attention_split_kv`` and ``qk_norm_rope_store`` take this head dimension: a power of two of
    at least 16 (``tl.dot``'s smallest tile)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def require_attention_kernels(setting: str, model_name: str, head_dim: int) -> None:
    """ValueError naming ``setting`` (an engine option set to "triton") where Triton's attention-half kernels
    cannot run: no Triton, or a head dimension ``attention_applies`` does not take."""
    if not have_triton():
        raise ValueError(f"{setting} 'triton' needs Triton (a CUDA build of torch ships it)")
    if not attention_applies(head_dim):
        raise ValueError(f"{setting} 'triton' needs a power-of-two head dimension of at least 16; "
                         f"{model_name} has {head_dim}")


def attention_split_kv(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, scale: float,
                       block_l: int = 64, max_splits: int = 64) -> torch.Tensor:
    """``model.decode_gqa``'s contract as a flash-decoding kernel (module docstring): q [Hq, 1, D] over keys,
    values [Hkv, L, D] (L: the static bucket; each [Hkv, L, D] view with a contiguous last dimension), the
    positions after ``pos`` (int64 [1] on the device) masked -> [Hq, 1, D] in q's dtype. The one-token case of
    ``batch_attention.attention_rows`` (the bucket's ``split_plan``), so the same bits as a batch's row."""
    if triton is None:
        raise RuntimeError("attention_split_kv needs Triton")
    hq, _, d = q.shape
    if keys.stride(-1) != 1 or values.stride() != keys.stride() or d & (d - 1) or d < 16:
        raise ValueError("attention_split_kv: K and V with one layout, a contiguous last dimension, and a "
                         "power-of-two head dimension of at least 16")
    nsplits, split = split_plan(keys.shape[1], block_l, max_splits)
    plan = _device_constant(q.device, (nsplits, split), torch.int32).view(1, 2)
    out = attention_rows(q.reshape(1, hq, d), keys[None], values[None], pos, _device_constant(q.device, (0,)),
                            plan, scale, split, block_l=block_l, max_splits=nsplits)
    return out.view(hq, 1, d)


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _device_constant(device: torch.device, values: tuple[int, ...], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small constant tensor on ``device``, made once (a CUDA graph captured later reads it where it is)."""
    key = (str(device), values, dtype)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             plus_one: bool = False):
    """``model.rms_norm`` (or, with ``plus_one``, ``hybrid.zc_rms_norm``) of x [T, N] as one kernel, a program
    per row. With ``residual`` [T, N] it normalises s = residual + x and returns (s, norm(s)): the residual
    add of a layer and the next norm in one kernel."""
    if triton is None:
        raise RuntimeError("rms_norm needs Triton")
    x = x.contiguous()
    T, N = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    _rms_norm[(T,)](x, x if residual is None else residual.contiguous(), weight, total, out, eps, N=N,
                    BLOCK=next_pow2(N), ADD=residual is not None, PLUS_ONE=plus_one)
    return out if residual is None else (total, out)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                       k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                       cache_k: torch.Tensor, cache_v: torch.Tensor, eps: float) -> torch.Tensor:
    """One decode token's per-head RMSNorm of q and k, rotary embedding at ``pos`` (int64 [1] on the device)
    and K/V cache write, as one kernel: q [1, Hq*D], k and v [1, Hkv*D] (the projections), the norms' weights
    [D], the rope tables [S, D], the layer's cache [Hkv, S, D] x2 (written at pos) -> q [Hq, 1, D]. The roundings
    of ``Model.decode_attention``'s torch ops, the norm's sum in another order. The one-token case of
    ``batch_attention.qk_norm_rope_store_rows``."""
    if triton is None:
        raise RuntimeError("qk_norm_rope_store needs Triton")
    hkv, _, d = cache_k.shape
    out = qk_norm_rope_store_rows(q.reshape(1, -1), k.reshape(1, -1), v.reshape(1, -1), q_norm, k_norm, cos, sin,
                                     pos, _device_constant(q.device, (0,)), cache_k[None], cache_v[None], eps)
    return out.view(-1, 1, d)


class SlotLookup(NamedTuple):
    """One layer's device-side slot table (``experts.DeviceSlotTable.layer``), as ``assign_slots`` takes it:
    slot_of [E] int32, expert_of [S] int32, stamp [S] int64, tick [1], counts [2], and the outputs slots [k]
    int64 and src [k] int32; ``identity``: expert e lives in slot e."""

    slot_of: torch.Tensor
    expert_of: torch.Tensor
    stamp: torch.Tensor
    tick: torch.Tensor
    counts: torch.Tensor
    slots: torch.Tensor
    src: torch.Tensor
    identity: bool


def route_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype,
               bias: torch.Tensor | None = None,
               lookup: SlotLookup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.route`` after its router matmul, a program (one warp) per token: logits [B, E] (+ ``bias`` [E]
    float32) -> softmax in float32 -> the top k in descending order (ties to the lowest expert id) ->
    renormalised when ``norm_topk_prob`` -> (weights [B, k] in ``dtype``, expert ids [B, k] int64). With
    ``lookup`` (one token), the same program then looks the k experts up in that slot table (``assign_slots``:
    the same policy and results)."""
    if triton is None:
        raise RuntimeError("route_topk needs Triton")
    n_tok, e = logits.shape
    if lookup is not None and n_tok != 1:
        raise ValueError("route_topk: a lookup takes one token")
    w = torch.empty(n_tok, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(n_tok, top_k, dtype=torch.long, device=logits.device)
    lg = logits.contiguous()
    t = lookup
    n_slots = 1 if t is None else check_slot_table(top_k, t.stamp.shape[0])
    args = (ids,) * 7 if t is None else (t.slot_of, t.expert_of, t.stamp, t.tick, t.counts, t.slots, t.src)
    _route_topk[(n_tok,)](lg, lg if bias is None else bias, w, ids, *args, E=e, EP=next_pow2(e), K=top_k,
                      KP=next_pow2(top_k), HAS_BIAS=bias is not None, NORM=norm_topk_prob, LOOKUP=t is not None,
                      S=n_slots, SP=next_pow2(n_slots), IDENTITY=t is not None and t.identity, STEP=STAMP_STEP,
                      NEVER=STAMP_NEVER, num_warps=1)
    return w, ids


STAMP_STEP = 256  # a slot's recency stamp: tick * STAMP_STEP + its rank within the step (top_k < STAMP_STEP)
STAMP_NEVER = 2**62  # padding slots' stamp: never the least recently used


def check_slot_table(k: int, s: int) -> int:
    """The slot count s of a table a top-``k`` lookup can use; ValueError otherwise."""
    if k >= STAMP_STEP or k > s:
        raise ValueError(f"assign_slots: top_k {k} must be < {STAMP_STEP} and <= the {s} slots")
    return s


DEQUANT_PROGRAMS: int | None = None  # dequantize_fp8's default grid: None, a program per 8 rows (see there)


if triton is not None:
    @triton.jit
    def _grouped_mm_fp8(x_ptr, xs_ptr, q_ptr, s_ptr, offs_ptr, tiles_ptr, y_ptr, N, K, G: tl.constexpr,
                        G_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        FP8_MATH: tl.constexpr):
        # program (m, n): the m-th row tile over all groups (group g owns tiles [tiles[g-1], tiles[g])), the n-th
        # column tile; programs past the last tile return
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        gi = tl.arange(0, G_POW2)
        tile_end = tl.load(tiles_ptr + gi, mask=gi < G, other=2147483647)  # [G_POW2] cumulative tiles
        g = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)  # the group whose tiles hold pid_m
        if g < G:
            first_tile = tl.load(tiles_ptr + g - 1, mask=g > 0, other=0)
            row0 = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
            row_end = tl.load(offs_ptr + g)
            rows = row0 + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output channels: rows of the expert's weight
            live_r, live_c = rows < row_end, cols < N
            w_base = q_ptr + g.to(tl.int64) * N * K
            scale = tl.load(s_ptr + g.to(tl.int64) * N + cols, mask=live_c, other=0.0)  # [BN] float32
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                live_k = ks < K
                a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
                            mask=live_r[:, None] & live_k[None, :], other=0.0)  # [BM, BK]
                w = tl.load(w_base + cols.to(tl.int64)[None, :] * K + ks[:, None],
                            mask=live_c[None, :] & live_k[:, None], other=0.0)  # [BK, BN] float8
                if not FP8_MATH:  # the weight as dequantize_fp8 writes it: float32 times its row's scale, rounded once
                    w = (w.to(tl.float32) * scale[None, :]).to(x_ptr.dtype.element_ty)
                acc = tl.dot(a, w, acc)  # FP8_MATH: float8 x float8 (the tensor cores' FP8 math), float32 sums
            if FP8_MATH:  # both scales after the sums: the row's activation scale and the channel's weight scale
                xs = tl.load(xs_ptr + rows, mask=live_r, other=0.0)  # [BM] float32
                acc = acc * xs[:, None] * scale[None, :]
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=live_r[:, None] & live_c[None, :])

    @triton.jit
    def _round_e4m3(v):
        # v (float32, |v| <= 448) rounded to the nearest float8 e4m3 value, ties to even, in float32 arithmetic,
        # so the conversion after it is exact (Triton's interpreter loses the carry where rounding up reaches the
        # next power of two: 125.3 became 64): torch's .to(float8_e4m3fn) bits, the sign of a zero included
        e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # the exponent of |v|
        e = tl.maximum(e, -6) - 3  # e4m3's step at that magnitude: 2^(e - 3), subnormals 2^-9
        step = ((e + 127) << 23).to(tl.float32, bitcast=True)
        big = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, ties to even
        r = tl.abs(((v / step + big) - big) * step)
        sign = v.to(tl.int32, bitcast=True) & -2147483648
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize_rows_fp8(x_ptr, q_ptr, s_ptr, K, BLOCK_K: tl.constexpr):
        # program r: row r of x [M, K] as float8 e4m3 with one float32 scale (its largest magnitude / 448, 1 for
        # an all-zero row), the values divided by it (IEEE division, as torch's): fp8.quantize_rows' rule and
        # bits
        r = tl.program_id(0).to(tl.int64)
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + r * K + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.div_rn(tl.max(amax, axis=0), 448.0)
        scale = tl.where(scale > 0, scale, 1.0)
        tl.store(s_ptr + r, scale)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + r * K + ks, mask=ks < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.div_rn(v, scale), -448.0), 448.0)
            tl.store(q_ptr + r * K + ks, _round_e4m3(q).to(tl.float8e4nv), mask=ks < K)


GROUPED_FP8_CONFIG = (128, 128, 64, 8, 3)
"""``grouped_mm_fp8``'s default launch for weight-only math ("bf16"): tile rows, output channels, reduction; warps;
pipeline stages. The fastest of ``GROUPED_FP8_CONFIGS`` on an H200 (results/20261205s-h200-fp8-gemm: 1.195 ms for a
2,048-token chunk of Qwen3-30B-A3B's layer, against 1.048 ms for torch's grouped GEMM over bf16 weights)."""
GROUPED_FP8_W8A8_CONFIG = (128, 256, 64, 8, 3)
"""The default launch for W8A8 math ("fp8"): the fastest of ``GROUPED_FP8_CONFIGS`` for it on an H100
(results/20261206a-h100-engine-checks: 1.303 ms for that chunk, against 1.518 ms at ``GROUPED_FP8_CONFIG`` and
1.376 ms for torch's grouped GEMM over bf16 weights there). The reduction tile is the same, so is each sum's order."""
GROUPED_FP8_CONFIGS = ((64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 128, 4, 3), (128, 256, 64, 8, 3),
                       (64, 64, 64, 4, 4), (128, 128, 128, 8, 3))
"""The launches ``tools.gpucheck_fp8`` times (1.195-1.390 ms for that chunk on the H200)."""


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous, any float dtype) as float8 e4m3 with one float32 scale per row: (q [M, K], scale
    [M]), ``fp8.quantize_rows``' rule and bits in one Triton kernel, a program per row."""
    if triton is None:
        raise RuntimeError("quantize_rows_fp8 needs Triton")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_fp8[(m,)](x, q, scale, k, BLOCK_K=min(1024, next_pow2(k)), num_warps=4)
    return q, scale


GROUPED_FP8_MATHS = ("bf16", "fp8")
"""``grouped_mm_fp8``'s arithmetic: "bf16", weight-only (each weight tile dequantized as ``dequantize_fp8`` writes
it, multiplied with x in x's dtype); "fp8", W8A8 (x quantized per row to e4m3 too, ``quantize_rows_fp8``, and
multiplied by the FP8 weights in the tensor cores' FP8 math, both scales applied to the float32 sums)."""


def grouped_mm_fp8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                   config: tuple[int, int, int, int, int] | None = None, math: str = "bf16") -> torch.Tensor:
    """``moe.grouped_mm`` over FP8 weights, dequantized in the GEMM's inner loop: x [M, K] (rows grouped by
    expert, ``offs`` [G] int32 the end row of each group), q [G, N, K] float8 e4m3 with row scales ``scale``
    [G, N] float32 (an FP8 bank's layout). Each weight tile is computed as ``dequantize_fp8`` writes it (float32
    times its scale, rounded once to x's dtype) and multiplied in x's dtype with float32 accumulation, so the
    weights are those of the dequantized layer; the sums' order is this kernel's own (not cuBLAS's bits). What it
    saves is the dequantization's pass over the layer (the FP8 values read and the bf16 weights written and read
    again). No host synchronisation: the row tiles of each group come from ``offs`` on the device. Returns
    [M, N] in x's dtype. ``math`` "fp8" (``GROUPED_FP8_MATHS``) quantizes x per row and multiplies FP8 by FP8
    instead: other numbers (the activations rounded to e4m3), twice the tensor cores' bf16 rate on Hopper.
    ``config``: the launch (None: ``GROUPED_FP8_CONFIG``, or ``GROUPED_FP8_W8A8_CONFIG`` for "fp8").
    The engine's prefill runs it with ``--fp8-dequant gemm`` / ``w8a8`` (``moe.fp8_grouped_mm``);
    ``tools.gpucheck_fp8`` times it against dequantization plus the grouped GEMM: on the H200 it is slower than
    torch's grouped GEMM by more than one pass saves once a layer has more than about 4 chunks
    (results/20261205s-h200-fp8-gemm)."""
    if triton is None:
        raise RuntimeError("grouped_mm_fp8 needs Triton")
    (m, k), (g, n, k2) = x.shape, q.shape
    if k2 != k or scale.shape != (g, n) or offs.shape != (g,) or q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"grouped_mm_fp8: x [M, K], q [G, N, K] float8_e4m3fn, scale [G, N], offs [G]; got "
                         f"{list(x.shape)}, {list(q.shape)} {q.dtype}, {list(scale.shape)}, {list(offs.shape)}")
    if not (x.is_contiguous() and q.is_contiguous() and scale.is_contiguous()):
        raise ValueError("grouped_mm_fp8: x, q and scale contiguous")
    if math not in GROUPED_FP8_MATHS:
        raise ValueError(f"grouped_mm_fp8: math must be one of {GROUPED_FP8_MATHS}, got {math!r}")
    bm, bn, bk, warps, stages = config or (GROUPED_FP8_W8A8_CONFIG if math == "fp8" else GROUPED_FP8_CONFIG)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or g == 0:
        return y
    xq, xs = quantize_rows_fp8(x) if math == "fp8" else (x, scale)  # (xs unread for bf16)
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))  # [G]
    tiles = torch.cumsum((counts + bm - 1) // bm, 0).to(torch.int32)  # [G] cumulative row tiles
    grid = (triton.cdiv(m, bm) + g, triton.cdiv(n, bn))  # at most one partial tile a group: enough programs
    _grouped_mm_fp8[grid](xq, xs, q, scale, offs, tiles, y, n, k, G=g, G_POW2=next_pow2(g), BLOCK_M=bm,
                          BLOCK_N=bn, BLOCK_K=bk, FP8_MATH=math == "fp8", num_warps=warps, num_stages=stages)
    return y


def dequantize_fp8(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None = None, programs: int | None = None) -> torch.Tensor:
    """``bank.dequantize_into(out, q, scale, block)`` as one kernel: float8 e4m3 q [N, R, C] times its float32
    scales (one per row: [N, R]; or one per ``block`` (br, bc): [N, ceil(R / br), ceil(C / bc)]), computed in
    float32 and rounded once to ``out``'s dtype, so the same bits. Reads each value once and writes it once,
    where the torch composition makes float32 temporaries (about 5x the memory traffic): the dequantization of
    a streamed FP8 layer then costs a small part of its copy. All on one CUDA device, contiguous. Returns out.

    ``programs`` (default ``DEQUANT_PROGRAMS``): at most that many programs, each looping over its share of the
    rows, so a dequantization on the copy stream leaves the other SMs to the compute beside it (it has a whole
    layer's copy time to finish); None: one program per 8 rows, done soonest. The grid does not change a value.
    With a limit, each distinct number of row blocks per program compiles once (a copy of a run of experts of a
    new length can compile again).
    ``tools.gpucheck_fp8`` times the choices."""
    if triton is None:
        raise RuntimeError("dequantize_fp8 needs Triton")
    n, rows, cols = q.shape
    if out.shape != q.shape or not (out.is_contiguous() and q.is_contiguous() and scale.is_contiguous()):
        raise ValueError("dequantize_fp8: out and q of one shape, all contiguous")
    if block is None:
        if scale.shape != (n, rows):
            raise ValueError(f"dequantize_fp8: row scales must be [{n}, {rows}], got {list(scale.shape)}")
        sr, sc, br, bc = rows, 1, 1, cols
    else:
        br, bc = block
        sr, sc = -(-rows // br), -(-cols // bc)
        if scale.shape != (n, sr, sc):
            raise ValueError(f"dequantize_fp8: block scales must be [{n}, {sr}, {sc}], got {list(scale.shape)}")
    programs = DEQUANT_PROGRAMS if programs is None else programs
    if out.numel():
        block_r, block_c = 8, 512
        blocks = triton.cdiv(n * rows, block_r)
        grid = (blocks if programs is None else max(1, min(programs, blocks)),)
        # ITERS is a constant of the compiled kernel: 1 on the full grid, whatever the copy's size
        _dequant_fp8[grid](q, scale, out, n * rows, grid[0], triton.cdiv(blocks, grid[0]), rows, cols, sr, sc, br,
                           bc, BLOCK_R=block_r, BLOCK_C=block_c)
    return out


class HostMapped:
    """A page-locked host tensor as a kernel argument: Triton's launcher takes any object with ``data_ptr()``
    and ``dtype`` and asks the driver for the pointer's device address, which for memory registered with
    ``cudaHostRegister`` is the host memory itself, read over PCIe (unified addressing)."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def moe_one_token(h: torch.Tensor, top_w: torch.Tensor, top_ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, block_n: int = 4, block_k: int = 1024,
                  residual: torch.Tensor | None = None,
                  fetch: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """``moe_tokens`` for one token h [1, H] whose routed ids [1, k] index the weights (resident experts, or the
    slots a lookup gave), with ``fetch`` = (src [k] int32, *host): the lookup's misses (src[j] the expert to read
    from the host bank and leave in slot top_ids[j], -1 for a hit) and the host bank (``moe_tokens``' ``host``).
    Returns [1, H] (residual + experts with ``residual``)."""
    if h.shape[0] != 1:
        raise ValueError("moe_one_token: one token")
    src, host = (None, None) if fetch is None else (fetch[0], fetch[1:])
    return moe_tokens(h, top_w, top_ids, gate_up, down, block_n=block_n, block_k=block_k, residual=residual,
                      host=host, src=src)


def _host_bank(host: tuple[torch.Tensor, ...], gate_up: torch.Tensor, down: torch.Tensor,
               who: str) -> tuple:
    """A fetch's host bank (``moe_tokens``' ``host``) checked against the slots it fills, and mapped for the
    kernels when the slots are on CUDA: (gate_up, down, gate_up_scale, down_scale); the scales are the values
    themselves (unread) without FP8. ValueError naming ``who`` for a bank the kernels cannot read."""
    fp8 = len(host) == 4
    host_gu, host_dn = host[:2]
    gu_scale, dn_scale = host[2:] if fp8 else (host_gu, host_dn)
    if not all(t.is_contiguous() for t in (host_gu, host_dn, gate_up, down)):
        raise ValueError(f"{who}: a fetch needs src [k] and contiguous expert blocks")
    if host_gu.shape[1:] != gate_up.shape[1:] or host_dn.shape[1:] != down.shape[1:]:
        raise ValueError(f"{who}: the host bank's experts must be shaped and typed as the slots' (or FP8 with row "
                         "scales)")
    if fp8:
        if host_gu.dtype != torch.float8_e4m3fn or host_dn.dtype != torch.float8_e4m3fn \
                or gu_scale.shape != host_gu.shape[:2] or dn_scale.shape != host_dn.shape[:2] \
                or gu_scale.dtype != torch.float32 or dn_scale.dtype != torch.float32 \
                or not (gu_scale.is_contiguous() and dn_scale.is_contiguous()):
            raise ValueError(f"{who}: an FP8 fetch needs float8 e4m3 experts and contiguous float32 row scales "
                             "[E, rows]")
    elif host_gu.dtype != gate_up.dtype or host_dn.dtype != down.dtype:
        raise ValueError(f"{who}: the host bank's experts must be shaped and typed as the slots' (or FP8 with row "
                         "scales)")
    if gate_up.is_cuda and not host_gu.is_cuda:
        host_gu, host_dn = HostMapped(host_gu), HostMapped(host_dn)
        if fp8:
            gu_scale, dn_scale = HostMapped(gu_scale), HostMapped(dn_scale)
    return host_gu, host_dn, gu_scale, dn_scale


def moe_tokens(h: torch.Tensor, top_w: torch.Tensor, top_ids: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, block_n: int = 4, block_k: int = 1024, residual: torch.Tensor | None = None,
               lookup: SlotLookup | None = None, host: tuple[torch.Tensor, ...] | None = None,
               src: torch.Tensor | None = None, max_tokens: int | None = None,
               token_counts: torch.Tensor | None = None,
               slot_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The routed SwiGLU experts of B decode tokens (module docstring), each token's result bitwise the same
    whatever the batch: h [B, H], top_w [B, k], top_ids [B, k] -> [B, H] in h's dtype (with ``residual`` [B, H]:
    residual + experts, rounded as torch's sum). Four kernels:

    1. one program groups the B x k routed (token, expert) pairs by expert (the first pair of each expert leads
       it) and, with ``lookup`` (a slot table's layer, ``experts.DeviceSlotTable.layer``), looks the batch's
       experts up once each (``slot_assign``: the host LRU's policy over the union; an expert that finds every
       slot taken by this batch's others is read from the host bank and not cached);
    2. per (expert, block of rows) the gate and up rows, read once (from the slot, or a miss from the host bank
       over PCIe and stored into its slot as it is read, an FP8 bank's dequantized on the way), each of its pairs
       summed over H in a fixed order, silu(gate) x up in float32;
    3. the down projection the same way, per pair;
    4. per token the k experts weighted by the router in routing order (no atomics), the residual added.
    A pair's sums never depend on which or how many other pairs share its expert, and ``max_tokens`` fixes every
    compile-time size of the arithmetic, so a token gives the same bits alone and in any batch of up to
    ``max_tokens`` (default B; a decoder passes its number of sequence caches). Kernel 1 computes no value: it is
    sized to the B x k pairs there are (its one program's work grows as their square; sized to ``max_tokens`` x k,
    one token's grouping took 27 us a layer with 8 caches, 10% of an offloaded step alone on an H100:
    ``results/20261205g-h100-batch-decode-profile``), one compiled variant per power of two of B x k.

    Without ``lookup``, top_ids index gate_up [G, 2I, H] / down [G, H, I] directly (resident experts, identity
    slots, or slots looked up by the host); ``src`` [B*k] int32 (with ``host``) marks the misses to read from the
    host bank and leave in their slots (the host's lookup's), -1 for a hit. With ``lookup``, top_ids are expert
    ids and gate_up / down the layer's slot block. ``host`` = (host_gate_up [E, 2I, H], host_down [E, H, I]) in
    the slots' dtype, or an FP8 bank's (float8 e4m3 values, then gate_up_scale [E, 2I], down_scale [E, H]
    float32 row scales), page-locked (registered when the slots are on CUDA: read zero-copy). ``token_counts``
    [max_tokens, 2] int64: each token's hits and misses are added there (each expert charged to the token of
    its first pair).

    ``slot_scales`` = (gate_up_scale [G, 2I], down_scale [G, H] float32): FP8 slots. gate_up / down then hold
    float8 e4m3 values, each row with its scale, and the kernels dequantize what they read (q * scale in
    float32, rounded once to h's dtype: the bits of a slot that held the dequantized weights); a miss from an
    FP8 bank (``host``, which must then be one) is left in its slot as the bank's float8 values and scales.
    Every way of reading the weights (resident, slots, misses from the host, FP8 slots or an FP8 bank's misses)
    sums in one order: a tile's layout is fixed by the compute dtype, not by what is loaded.

    ``out_dtype`` (default h's): float32 returns the experts' weighted sum before it is rounded (no residual
    then), where two ways of reading the same weights can be compared bit for bit."""
    if triton is None:
        raise RuntimeError("moe_tokens needs Triton")
    if out_dtype is not None and residual is not None and out_dtype != h.dtype:
        raise ValueError("moe_tokens: out_dtype other than h's is for the experts' sum alone (no residual)")
    if not (gate_up.stride(-1) == 1 and down.stride(-1) == 1):
        raise ValueError("moe_tokens: row-major expert weights")
    n_tok, H = h.shape
    G, two_i, _ = gate_up.shape
    inter, k = two_i // 2, top_ids.shape[1]
    max_tokens = n_tok if max_tokens is None else max_tokens
    if top_ids.shape[0] != n_tok or top_w.shape != top_ids.shape or not 1 <= n_tok <= max_tokens:
        raise ValueError(f"moe_tokens: h [B, H], top_w and top_ids [B, k] with 1 <= B <= max_tokens "
                         f"({max_tokens}); got {list(h.shape)}, {list(top_w.shape)}, {list(top_ids.shape)}")
    if src is not None and (lookup is not None or host is None or src.numel() != n_tok * k):
        raise ValueError("moe_tokens: src (a host lookup's misses) needs host, no lookup, and B*k entries")
    if lookup is not None and host is None:
        raise ValueError("moe_tokens: a lookup needs the host bank its misses are read from")
    fp8 = host is not None and len(host) == 4
    host_gu, host_dn, gu_scale, dn_scale = ((gate_up, down, gate_up, down) if host is None
                                            else _host_bank(host, gate_up, down, "moe_tokens"))
    slot_fp8 = slot_scales is not None
    if slot_fp8:
        sgu, sdn = slot_scales
        if gate_up.dtype != torch.float8_e4m3fn or down.dtype != torch.float8_e4m3fn \
                or sgu.shape != gate_up.shape[:2] or sdn.shape != down.shape[:2] \
                or sgu.dtype != torch.float32 or sdn.dtype != torch.float32 \
                or not (sgu.is_contiguous() and sdn.is_contiguous()) or (host is not None and not fp8):
            raise ValueError("moe_tokens: FP8 slots are float8 e4m3 weights with contiguous float32 row scales "
                             "[G, rows], and their misses come from an FP8 bank")
    else:
        sgu, sdn = gate_up, down  # (unread)
    n_pairs, mp = n_tok * k, next_pow2(max_tokens)
    dev = h.device
    ids = top_ids.reshape(-1).contiguous()  # [P] token-major
    slots = torch.empty(n_pairs, dtype=torch.long, device=dev)
    src_out = torch.empty(n_pairs, dtype=torch.int32, device=dev)
    members = torch.empty(n_pairs, mp, dtype=torch.int32, device=dev)  # [P, M]
    t = lookup
    n_slots = 1 if t is None else check_slot_table(k, t.stamp.shape[0])
    table = (ids,) * 5 if t is None else (t.slot_of, t.expert_of, t.stamp, t.tick, t.counts)
    if token_counts is not None and (t is None or token_counts.shape != (mp, 2)):
        raise ValueError(f"moe_tokens: token_counts [{mp}, 2] goes with a lookup")
    _group_experts[(1,)](ids, ids if src is None else src.reshape(-1).contiguous(), slots, src_out, members,
                         ids if token_counts is None else token_counts, *table, n_pairs, K=k,
                         PP=next_pow2(n_pairs), M=mp, LOOKUP=t is not None, HAS_SRC=src is not None,
                         TOK_COUNTS=token_counts is not None, S=n_slots, SP=next_pow2(n_slots),
                         IDENTITY=t is not None and t.identity, STEP=STAMP_STEP, NEVER=STAMP_NEVER, num_warps=4)
    act = torch.empty(n_pairs, inter, dtype=torch.float32, device=dev)  # [P, I]
    vec = max(1, 16 // h.element_size())  # the columns a thread reads of a compute-dtype row: the tiles' layout
    _gate_up_group[(n_pairs, triton.cdiv(inter, block_n))](h.contiguous(), gate_up, slots, src_out, members, act,
                                                           host_gu, gu_scale, sgu, H, inter, k, mp,
                                                           gate_up.stride(0), gate_up.stride(1), BLOCK_N=block_n,
                                                           BLOCK_K=block_k, FETCH=host is not None, FP8=fp8,
                                                           SLOT_FP8=slot_fp8, VEC=vec)
    ys = torch.empty(n_pairs, H, dtype=torch.float32, device=dev)  # [P, H] each pair's expert output
    _down_group[(n_pairs, triton.cdiv(H, block_n))](act, down, slots, src_out, members, ys, host_dn, dn_scale, sdn,
                                                    h, H, inter, mp, down.stride(0), down.stride(1), BLOCK_N=block_n,
                                                    BLOCK_K=block_k, FETCH=host is not None, FP8=fp8,
                                                    SLOT_FP8=slot_fp8, VEC=vec)
    out = torch.empty(n_tok, H, dtype=out_dtype or h.dtype, device=dev)
    tw = top_w.contiguous()  # [B, k], read as float32 in the kernel
    res = out if residual is None else residual.reshape(n_tok, H).contiguous()
    block = min(1024, next_pow2(H))
    _combine[(n_tok, triton.cdiv(H, block))](ys, tw, res, out, H, k, BLOCK=block, HAS_RES=residual is not None)
    return out  # [B, H]


class PrefetchBuffers(NamedTuple):
    """A prefetch's outputs, kept by its caller so a captured step reads fixed addresses (``prefetch_experts``):
    slots [P] int64, src [P] int32, members [P, M] int32 for P = max_tokens x k pairs, M = next_pow2(max_tokens)."""

    slots: torch.Tensor
    src: torch.Tensor
    members: torch.Tensor

    @classmethod
    def empty(cls, max_tokens: int, k: int, device: torch.device) -> PrefetchBuffers:
        mp = next_pow2(max_tokens)
        p = mp * k
        return cls(torch.zeros(p, dtype=torch.long, device=device), torch.full((p,), -1, dtype=torch.int32,
                                                                                device=device),
                   torch.full((p, mp), -1, dtype=torch.int32, device=device))


def prefetch_experts(top_ids: torch.Tensor, lookup: SlotLookup, host: tuple[torch.Tensor, ...], gate_up: torch.Tensor,
                     down: torch.Tensor, out: PrefetchBuffers, max_tokens: int,
                     token_counts: torch.Tensor | None = None,
                     slot_scales: tuple[torch.Tensor, torch.Tensor] | None = None, block_r: int = 8,
                     block_c: int = 512) -> None:
    """Bring experts a layer is predicted to route to into its slots ahead of its lookup: top_ids [B, k]
    (the layer's router applied early, ``Model.predict_experts``) looked up once each in the layer's slot table
    (``lookup``: ``DeviceSlotTable.prefetch_layer``, whose tick is the step's less one, so what this places is
    the newest of what the step's own lookup may evict, never protected from it; and whose counts are the
    prefetch's: already there, copied), and each one not there that got a slot copied from the host bank
    (``host``, as ``moe_tokens``' fetch: an FP8 bank's values and row scales into FP8 slots, or dequantized
    into compute-dtype slots with the same bits) into it. Outputs nothing else: the layer's lookup later in the
    step finds them as hits, and the values are the bank's wherever they sit, so the step's bits do not change.
    With ``token_counts`` [next_pow2(max_tokens), 2] each token's prefetched experts are added (already there,
    copied; each expert charged to its first pair's token)."""
    if triton is None:
        raise RuntimeError("prefetch_experts needs Triton")
    n_tok, k = top_ids.shape
    if not 1 <= n_tok <= max_tokens:
        raise ValueError(f"prefetch_experts: top_ids [B, k] with 1 <= B <= max_tokens ({max_tokens})")
    fp8 = len(host) == 4
    host_gu, host_dn, gu_scale, dn_scale = _host_bank(host, gate_up, down, "prefetch_experts")
    slot_fp8 = slot_scales is not None
    sgu, sdn = slot_scales if slot_fp8 else (gate_up, down)  # (unread without FP8 slots)
    mp, n_pairs = next_pow2(max_tokens), n_tok * k
    if out.members.shape != (mp * k, mp) or token_counts is not None and token_counts.shape != (mp, 2):
        raise ValueError("prefetch_experts: buffers for max_tokens x k pairs (PrefetchBuffers.empty), token_counts "
                         f"[{mp}, 2]")
    ids = top_ids.reshape(-1).contiguous()
    n_slots = check_slot_table(k, lookup.stamp.shape[0])
    _group_experts[(1,)](ids, ids, out.slots, out.src, out.members, ids if token_counts is None else token_counts,
                         lookup.slot_of, lookup.expert_of, lookup.stamp, lookup.tick, lookup.counts, n_pairs, K=k,
                         PP=next_pow2(n_pairs), M=mp, LOOKUP=True, HAS_SRC=False,
                         TOK_COUNTS=token_counts is not None, S=n_slots, SP=next_pow2(n_slots),
                         IDENTITY=lookup.identity, STEP=STAMP_STEP, NEVER=STAMP_NEVER, num_warps=4)
    dequant = fp8 and not slot_fp8
    _, two_i, hidden = gate_up.shape
    for src_w, w, scale, wscale, rows, cols in ((host_gu, gate_up, gu_scale, sgu, two_i, hidden),
                                                 (host_dn, down, dn_scale, sdn, hidden, two_i // 2)):
        _fetch_rows[(n_pairs, triton.cdiv(rows, block_r))](src_w, w, out.slots, out.src, out.members, scale, wscale,
                                                           rows, cols, mp, w.stride(0), w.stride(1), BLOCK_R=block_r,
                                                           BLOCK_C=block_c, FP8=fp8, SLOT_FP8=slot_fp8,
                                                           DEQUANT=dequant)
