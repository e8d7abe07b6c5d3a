"""Batched decode's attention-half kernels: B tokens of B sequences (each at its own position, each with its own
KV cache) through the projections, the q/k norms with RoPE and the cache write, and the attention, one kernel
launch each whatever the mix of positions (the positions, caches and split plans are read on the device, so one
compiled kernel and one CUDA graph serve every batch of a size).

Batch invariance by construction: every program of these kernels computes for one token from that token's
inputs alone (its row of x, its position, its cache, its split plan), in an order fixed by the kernel's constants,
so a token's result is bitwise the same whatever B is, whatever the other rows hold and wherever the other
tokens are: a sequence decoded in a batch gets the bits it gets decoded alone (through these same kernels with
B = 1). Deterministic (no atomics). Needs Triton (CUDA; on CPU only under ``TRITON_INTERPRET=1``).

- ``linear_rows(x, w)``: x [B, K] @ w[N, K].T as a GEMV per token (F.linear's contract; not its bits): BLOCK_N
  output rows a program, float32 accumulation over K in BLOCK_K blocks in K order (``_gate_up_act``'s sum),
  rounded once to x's dtype. A program per (token, row block), the token on program axis 0, so that the B
  programs of a row block run side by side and the weight tile the first reads is in L2 for the others.
- ``qk_norm_rope_store_rows(q, k, v, ...)``: per token the q/k norms, RoPE and K/V cache write of one decode
  token (``kernels.qk_norm_rope_store`` is its one-token case), each token at its own position writing into its
  own cache of the pooled cache [C, Hkv, S, D] (a layer's caches in one tensor: cache c's layer is ``pool[c]``).
- ``attention_rows(q, keys, values, pos, cache_idx, plan, ...)``: flash-decoding per token over its own cache up
  to its own position. Token b cuts its keys into the ranges of its own split plan (``split_plan`` of its KV
  bucket ``kv_len_for(pos, max_context)``), one program per (KV head, range, token) runs an online softmax
  over the range (``tl.dot`` with IEEE float32 products, float32 statistics, blocks past pos read nothing); a
  second kernel combines a head's ranges by summing them sequentially in range order (float32, the division
  correctly rounded), so the result depends on neither the grid's ``max_splits`` nor the other tokens.
  ``kernels.attention_split_kv`` is its one-token case; the decode_gqa contract, as it is.

A token's split plan depends on its bucket only, so its bits depend on (q, cache contents up to pos, bucket);
the caller's ``max_split`` (the largest split any bucket uses: ``split_plan(max_context)[1]``, since the split
grows with the bucket) and ``max_splits`` only bound the loops and the grid.

Checked under the interpreter on CPU (tests/engine/test_batch_attention.py, float32); not yet run compiled on
CUDA, so neither bfloat16's bits nor the speed have been seen there.
"""

from __future__ import annotations

from typing import Sequence

import torch


try:  # optional: CUDA builds of torch ship Triton; the CPU build does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third dimensions


def have_triton() -> bool:
    return triton is not None


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def split_plan(kv_len: int, block_l: int = 64, max_splits: int = 64) -> tuple[int, int]:
    """(nsplits, split) of a decode step over a KV bucket of ``kv_len`` positions: nsplits = min(max_splits,
    next_pow2(ceil(L / block_l))) ranges of split positions each, split = ceil(L / nsplits) rounded up to whole
    blocks (nsplits * split >= L)."""
    if kv_len < 1 or block_l < 1 or max_splits < 1:
        raise ValueError("split_plan: a positive length, block and split count")
    nsplits = min(max_splits, next_pow2(-(-kv_len // block_l)))
    split = -(-kv_len // nsplits)
    return nsplits, -(-split // block_l) * block_l


def split_plans(kv_lens: Sequence[int], block_l: int = 64, max_splits: int = 64,
                device: torch.device | str | None = None) -> torch.Tensor:
    """The plans of a batch's tokens (each one's ``split_plan`` of its KV bucket) as ``attention_rows`` reads
    them: int32 [B, 2] (nsplits, split) on ``device``."""
    return torch.tensor([split_plan(n, block_l, max_splits) for n in kv_lens], dtype=torch.int32,
                        device=device).reshape(len(kv_lens), 2)


if triton is not None:
    @triton.jit
    def _linear_rows(x_ptr, w_ptr, out_ptr, N, stride_xb, stride_wn, stride_ob, K: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        b = tl.program_id(0)  # token: the programs launched together share the weight tile
        nb = tl.program_id(1)  # block of output rows
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        x_row = x_ptr + b.to(tl.int64) * stride_xb
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K in order: a fixed summation order
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < K
            x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)  # [BLOCK_K]
            w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _qk_norm_rope_store_rows(q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, cidx_ptr, kc_ptr,
                                 vc_ptr, qout_ptr, stride_kc, stride_kh, stride_kl, eps, HQ: tl.constexpr,
                                 HKV: tl.constexpr, D: tl.constexpr):
        pid = tl.program_id(0)  # query heads, then KV heads
        b = tl.program_id(1)  # token
        d = tl.arange(0, D)
        # the roundings of Model.decode_attention's torch ops, at this token's rows
        partner = (d + D // 2) % D  # rotate_half's source index, negated in the first half
        sign = tl.where(d < D // 2, -1.0, 1.0)
        dt = qout_ptr.dtype.element_ty
        pos = tl.load(pos_ptr + b).to(tl.int64)
        cos = tl.load(cos_ptr + pos * D + d).to(tl.float32)
        sin = tl.load(sin_ptr + pos * D + d).to(tl.float32)
        if pid < HQ:
            src = q_ptr + (b * HQ + pid) * D
            wp = qn_ptr
        else:
            src = k_ptr + (b * HKV + pid - HQ) * D
            wp = kn_ptr
        x = tl.load(src + d).to(tl.float32)
        xp = tl.load(src + partner).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        n = (tl.load(wp + d).to(tl.float32) * (x * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n_p = (tl.load(wp + partner).to(tl.float32) * (xp * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        # q * cos + rotate_half(q) * sin, each product and the sum rounded as torch's
        y = ((n * cos).to(dt).to(tl.float32) + (sign * n_p * sin).to(dt).to(tl.float32)).to(dt)
        if pid < HQ:
            tl.store(qout_ptr + (b * HQ + pid) * D + d, y)
        else:
            hk = pid - HQ
            c = tl.load(cidx_ptr + b).to(tl.int64)  # this token's cache in the pool
            at = c * stride_kc + hk * stride_kh + pos * stride_kl + d
            tl.store(kc_ptr + at, y)
            tl.store(vc_ptr + at, tl.load(v_ptr + (b * HKV + hk) * D + d))

    @triton.jit
    def _attn_rows_split(q_ptr, k_ptr, v_ptr, pos_ptr, cidx_ptr, plan_ptr, m_ptr, l_ptr, acc_ptr, stride_kc,
                         stride_kh, stride_kl, scale, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                         D: tl.constexpr, MAX_SPLIT: tl.constexpr, BLOCK_L: tl.constexpr,
                         MAX_SPLITS: tl.constexpr):
        hk = tl.program_id(0)
        sp = tl.program_id(1)  # this token's range sp of its nsplits
        b = tl.program_id(2)  # token
        nsplits = tl.load(plan_ptr + 2 * b)
        split = tl.load(plan_ptr + 2 * b + 1)  # positions a range, whole blocks, <= MAX_SPLIT
        n = tl.load(pos_ptr + b).to(tl.int32) + 1  # keys [0, n) are visible
        start = sp * split
        if (sp < nsplits) & (start < n):  # a range of the plan that holds visible keys; the others do nothing
            c = tl.load(cidx_ptr + b).to(tl.int64)
            kb = k_ptr + c * stride_kc + hk * stride_kh  # this token's cache, this KV head: [S, D]
            vb = v_ptr + c * stride_kc + hk * stride_kh
            g = tl.arange(0, GP)
            d = tl.arange(0, D)
            gmask = g < G
            q = tl.load(q_ptr + ((b * HKV + hk) * G + g)[:, None] * D + d[None, :], mask=gmask[:, None],
                        other=0.0)  # [GP, D] the KV head's query heads
            # the online softmax over [start, start + split), positions after pos unread
            m = tl.full([GP], float("-inf"), dtype=tl.float32)
            lsum = tl.zeros([GP], dtype=tl.float32)
            acc = tl.zeros([GP, D], dtype=tl.float32)
            for l0 in range(0, MAX_SPLIT, BLOCK_L):
                if (l0 < split) & (start + l0 < n):  # this token's range only; blocks past pos read nothing
                    offs = start + l0 + tl.arange(0, BLOCK_L)
                    valid = offs < n
                    kv_off = offs[:, None] * stride_kl + d[None, :]
                    k = tl.load(kb + kv_off, mask=valid[:, None], other=0.0)  # [BLOCK_L, D]
                    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GP, BLOCK_L] float32; no TF32
                    s = tl.where(valid[None, :], s, float("-inf"))
                    m_new = tl.maximum(m, tl.max(s, axis=1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    p = tl.exp(s - m_safe[:, None])
                    alpha = tl.exp(m - m_safe)
                    v = tl.load(vb + kv_off, mask=valid[:, None], other=0.0)  # [BLOCK_L, D]
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                    lsum = lsum * alpha + tl.sum(p, axis=1)
                    m = m_new
            row = ((b * HKV + hk) * MAX_SPLITS + sp) * G + g  # [GP] scratch rows [B, Hkv, MAX_SPLITS, G]
            tl.store(m_ptr + row, m, mask=gmask)
            tl.store(l_ptr + row, lsum, mask=gmask)
            tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])

    @triton.jit
    def _attn_rows_combine(m_ptr, l_ptr, acc_ptr, pos_ptr, plan_ptr, out_ptr, HQ: tl.constexpr,
                           HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, MAX_SPLITS: tl.constexpr):
        h = tl.program_id(0)  # query head
        b = tl.program_id(1)  # token
        hk = h // G
        d = tl.arange(0, D)
        nsplits = tl.load(plan_ptr + 2 * b)
        split = tl.load(plan_ptr + 2 * b + 1)
        n = tl.load(pos_ptr + b).to(tl.int32) + 1
        row0 = (b * HKV + hk) * MAX_SPLITS * G + h % G  # range 0's row of this head; range sp's: row0 + sp * G
        # range 0 always holds key 0; the ranges the split kernel skipped (past nsplits or past pos) are unwritten
        # and never read
        big = tl.load(m_ptr + row0)
        for sp in range(1, MAX_SPLITS):
            if (sp < nsplits) & (sp * split < n):
                big = tl.maximum(big, tl.load(m_ptr + row0 + sp * G))
        w = tl.exp(tl.load(m_ptr + row0) - big)
        num = w * tl.load(acc_ptr + row0 * D + d)  # [D]
        den = w * tl.load(l_ptr + row0)
        for sp in range(1, MAX_SPLITS):  # in range order, one at a time: the order is the plan's alone
            if (sp < nsplits) & (sp * split < n):
                row = row0 + sp * G
                w = tl.exp(tl.load(m_ptr + row) - big)
                num += w * tl.load(acc_ptr + row * D + d)
                den += w * tl.load(l_ptr + row)
        out = tl.math.div_rn(num, tl.broadcast_to(den, (D,)))  # correctly rounded, whatever the compiler's `/`
        tl.store(out_ptr + (b * HQ + h) * D + d, out.to(out_ptr.dtype.element_ty))


def _need_triton(name: str) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs Triton")


def linear_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, block_n: int = 4,
                block_k: int = 1024) -> torch.Tensor:
    """x [B, K] @ w.T for w [N, K] (nn.Linear's layout) -> [B, N] in x's dtype (or into ``out`` [B, N], its
    rows contiguous), a GEMV per token (module docstring): row b's bits depend on x[b] and w alone."""
    _need_triton("linear_rows")
    B, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"linear_rows: x [B, K] and w [N, K] with contiguous rows, got {list(x.shape)} and "
                         f"{list(w.shape)}")
    if out is None:
        out = torch.empty(B, N, dtype=x.dtype, device=x.device)
    elif out.shape != (B, N) or out.stride(-1) != 1:
        raise ValueError(f"linear_rows: out must be [{B}, {N}] with contiguous rows")
    blocks = triton.cdiv(N, block_n)
    if blocks > MAX_GRID_Y:
        raise ValueError(f"linear_rows: {blocks} row blocks of {block_n} exceed the grid's {MAX_GRID_Y}; a "
                         "larger block_n")
    if B and N:
        _linear_rows[(B, blocks)](x, w, out, N, x.stride(0), w.stride(0), out.stride(0), K=K, BLOCK_N=block_n,
                                  BLOCK_K=block_k)
    return out


def qk_norm_rope_store_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                            k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                            cache_idx: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                            eps: float) -> torch.Tensor:
    """The q/k norms, RoPE and cache writes of B decode tokens in one kernel (grid (Hq + Hkv, B)): q [B, Hq*D],
    k and v [B, Hkv*D] (the projections), the norms' weights [D], the rope tables [S, D], pos and cache_idx int64
    [B] on the device, the layer's pooled caches [C, Hkv, S, D] x2 -> q [B, Hq, D]; token b's K and V are written
    at (cache_idx[b], :, pos[b]). Per token the bits of the call for it alone. The tokens' (cache, position)
    pairs must differ (one token a sequence a step)."""
    _need_triton("qk_norm_rope_store_rows")
    _, hkv, _, d = cache_k.shape
    B = q.shape[0]
    hq = q.shape[-1] // d
    if (d & (d - 1) or cos.stride() != (d, 1) or sin.stride() != (d, 1) or cache_k.stride(-1) != 1
            or cache_v.stride() != cache_k.stride()):
        raise ValueError("qk_norm_rope_store_rows: a power-of-two head dimension, [S, D] rope tables, K and V "
                         "caches with one layout and a contiguous last dimension")
    if q.shape != (B, hq * d) or k.shape != (B, hkv * d) or v.shape != (B, hkv * d) or pos.shape != (B,) \
            or cache_idx.shape != (B,):
        raise ValueError("qk_norm_rope_store_rows: q [B, Hq*D], k and v [B, Hkv*D], pos and cache_idx [B]")
    q_out = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    if B:
        _qk_norm_rope_store_rows[(hq + hkv, B)](q.contiguous(), k.contiguous(), v.contiguous(), q_norm, k_norm,
                                                cos, sin, pos, cache_idx, cache_k, cache_v, q_out,
                                                cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), eps, HQ=hq,
                                                HKV=hkv, D=d)
    return q_out


def combine_splits(m: torch.Tensor, lsum: torch.Tensor, acc: torch.Tensor, pos: torch.Tensor, plan: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """``attention_rows``' second kernel alone: each token's ranges' statistics m, lsum [B, Hkv, S, G] and
    acc [B, Hkv, S, G, D] (float32; S = the grid's max_splits; range sp of token b read only where
    sp < plan[b, 0] and sp * plan[b, 1] <= pos[b]) -> out [B, Hkv * G, D]: sum_sp w_sp acc_sp / sum_sp w_sp l_sp,
    w_sp = exp(m_sp - max m), both sums in float32 one range at a time in range order. Returns out."""
    _need_triton("combine_splits")
    B, hkv, max_splits, g = m.shape
    d = acc.shape[-1]
    if lsum.shape != m.shape or acc.shape != (*m.shape, d) or out.shape != (B, hkv * g, d) or not all(
            t.is_contiguous() for t in (m, lsum, acc, out)) or plan.shape != (B, 2) or plan.dtype != torch.int32 \
            or pos.shape != (B,):
        raise ValueError("combine_splits: contiguous m, lsum [B, Hkv, S, G], acc [B, Hkv, S, G, D], out "
                         "[B, Hkv*G, D], pos [B] and an int32 plan [B, 2]")
    if B:
        _attn_rows_combine[(hkv * g, B)](m, lsum, acc, pos, plan, out, HQ=hkv * g, HKV=hkv, G=g, D=d,
                                         MAX_SPLITS=max_splits)
    return out


def attention_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                   cache_idx: torch.Tensor, plan: torch.Tensor, scale: float, max_split: int, block_l: int = 64,
                   max_splits: int = 64) -> torch.Tensor:
    """B tokens' grouped-query attention, each over its own cache up to its own position (module docstring):
    q [B, Hq, D] over the pooled caches keys, values [C, Hkv, S, D] (one layout, a contiguous last dimension;
    query head h reads KV head h // (Hq/Hkv)), token b reading cache cache_idx[b] at positions [0, pos[b]]
    (pos, cache_idx int64 [B] on the device) in the ranges of its plan[b] = (nsplits, split) (int32 [B, 2] on
    the device, ``split_plan`` of its bucket with this ``block_l`` and at most this ``max_splits``; split <=
    ``max_split``, a multiple of block_l: ``split_plan(max_context, block_l, max_splits)[1]``) -> [B, Hq, D] in
    q's dtype. Token b's bits are those of the call for it alone (B = 1) whatever the other tokens. A plan past
    ``max_split`` or ``max_splits`` would lose keys: it is the caller's (``split_plans`` builds them). Scratch:
    float32 [B, Hkv, max_splits, G, D] and two [B, Hkv, max_splits, G] a call (B = 8, Hkv = 4, 64 ranges, G = 8,
    D = 128: 8 MiB)."""
    _need_triton("attention_rows")
    B, hq, d = q.shape
    _, hkv, _, _ = keys.shape
    if keys.stride(-1) != 1 or values.stride() != keys.stride() or values.shape != keys.shape or d & (d - 1) \
            or d < 16 or keys.shape[-1] != d or hq % hkv:
        raise ValueError("attention_rows: K and V [C, Hkv, S, D] with one layout, a contiguous last dimension, "
                         "and a power-of-two head dimension of at least 16 shared with q [B, Hq, D]")
    if pos.shape != (B,) or cache_idx.shape != (B,) or plan.shape != (B, 2) or plan.dtype != torch.int32:
        raise ValueError("attention_rows: pos and cache_idx [B], plan int32 [B, 2]")
    if max_split % block_l or max_split < block_l:
        raise ValueError(f"attention_rows: max_split {max_split} must be whole blocks of {block_l}")
    if not 1 <= max_splits <= MAX_GRID_Y or B > MAX_GRID_Y:
        raise ValueError(f"attention_rows: 1 to {MAX_GRID_Y} ranges and tokens (the grid's limit)")
    g = hq // hkv
    gp = max(16, next_pow2(g))  # tl.dot takes at least 16 rows
    f32 = dict(dtype=torch.float32, device=q.device)
    m = torch.empty(B, hkv, max_splits, g, **f32)  # ranges a plan skips stay unwritten and unread
    lsum = torch.empty(B, hkv, max_splits, g, **f32)
    acc = torch.empty(B, hkv, max_splits, g, d, **f32)
    out = torch.empty(B, hq, d, dtype=q.dtype, device=q.device)
    if B:
        _attn_rows_split[(hkv, max_splits, B)](q.contiguous(), keys, values, pos, cache_idx, plan, m, lsum, acc,
                                               keys.stride(0), keys.stride(1), keys.stride(2), scale, HKV=hkv, G=g,
                                               GP=gp, D=d, MAX_SPLIT=max_split, BLOCK_L=block_l,
                                               MAX_SPLITS=max_splits)
        combine_splits(m, lsum, acc, pos, plan, out)
    return out
