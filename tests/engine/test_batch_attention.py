"""Batched decode's attention-half kernels (abbench.engine.ops.batch_attention) are batch invariant by construction.

Each token's result is bitwise the one it gets alone (B = 1), whatever the other rows, caches and positions hold
(NaN included: never read), and within float32 noise of a float64 torch reference; the per-token q/k norm, rope
and cache write is ``qk_norm_rope_store``'s, bit for bit; the split plans are ``attention_split_kv``'s; the combine
sums a token's ranges in range order. Small shapes that the blocks do not divide, a few positions (and so split
plans) per batch. Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1 (float32 only there: the interpreter
rounds bfloat16 otherwise than compiled Triton); without it the kernel tests skip.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from abbench.engine.ops import batch_attention as ba  # noqa: E402
from abbench.engine.ops import kernels as dk  # noqa: E402
from abbench.engine.runtime.decode import kv_buckets, kv_len_for  # noqa: E402

DEVICE = torch.device(os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu"))


def _triton_runs_here() -> bool:
    return ba.have_triton() and (DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


_triton_only = pytest.mark.skipif("not _triton_runs_here()",
                                  reason="Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE.type != "cuda", reason="the interpreter rounds bfloat16 otherwise than compiled Triton"))]


def _ids(values, dtype=torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


# -- split plans ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_l,max_splits", [(64, 64), (16, 8), (32, 16)])
def test_split_plans_cover_the_bucket_in_whole_blocks_and_the_largest_bucket_has_the_largest_split(block_l,
                                                                                                  max_splits):
    """Every bucket a cache can use (kv_len_for's) is covered by its plan in whole blocks, and the split never
    shrinks as the bucket grows: the largest bucket's split bounds every token's (attention_rows' max_split)."""
    for max_context in (300, 1024, 5000, 40960, 131072):
        plans = [ba.split_plan(n, block_l, max_splits) for n in kv_buckets(max_context)]
        for n, (nsplits, split) in zip(kv_buckets(max_context), plans):
            assert 1 <= nsplits <= max_splits and nsplits & (nsplits - 1) == 0
            assert split % block_l == 0 and nsplits * split >= n  # (the last ranges may start past n)
        assert [s for _, s in plans] == sorted(s for _, s in plans)
        assert plans[-1] == ba.split_plan(max_context, block_l, max_splits)
    assert ba.split_plans([kv_len_for(p, 5000) for p in (0, 1500, 4999)], block_l, max_splits).tolist() == [
        list(ba.split_plan(n, block_l, max_splits)) for n in (1024, 2048, 5000)]


@pytest.mark.skipif(not ba.have_triton(), reason="attention_split_kv needs Triton (its launches are recorded here)")
@pytest.mark.parametrize("block_l,max_splits", [(64, 64), (16, 8), (32, 16)])
def test_attention_split_kv_is_a_row_of_attention_rows_at_its_buckets_plan(block_l, max_splits, monkeypatch):
    """The one-token kernel is attention_rows for one token with the bucket's split_plan, for lengths the blocks
    do and do not divide (its launches recorded instead of run: no kernel runs here)."""
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, grid, args, kw))

    monkeypatch.setattr(ba, "_attn_rows_split", Recorder("split"))
    monkeypatch.setattr(ba, "_attn_rows_combine", Recorder("combine"))
    for length in (1, 15, 16, 17, 64, 100, 300, 1024, 1500, 4096, 5000, 32768, 131072):
        launches.clear()
        keys = torch.zeros(1, length, 16)
        dk.attention_split_kv(torch.zeros(1, 1, 16), keys, keys, torch.zeros(1, dtype=torch.long), 0.25,
                              block_l=block_l, max_splits=max_splits)
        (_, grid, args, kw), (_, cgrid, cargs, _) = launches
        plan = ba.split_plan(length, block_l, max_splits)
        assert grid == (1, plan[0], 1) and kw["MAX_SPLIT"] == plan[1] and kw["BLOCK_L"] == block_l
        assert args[5].tolist() == [list(plan)]  # the plan the kernels read on the device


# -- linear_rows ---------------------------------------------------------------------------------------------------

@_triton_only
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("blocks", [dict(block_n=4, block_k=32), dict(block_n=16, block_k=64), {}])
def test_linear_rows_gives_each_row_its_own_bits_whatever_the_batch(blocks, dtype):
    """A width (37) and depth (72) the blocks do not divide; each row bitwise what it is alone, unchanged when
    the other rows change (NaN included) or the rows are permuted; written into a strided ``out``; within float
    noise of float64."""
    gen = torch.Generator().manual_seed(7)
    B, N, K = 5, 37, 72
    x = torch.randn(B, K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) / 8).to(dtype).to(DEVICE)
    got = ba.linear_rows(x, w, **blocks)
    assert got.shape == (B, N) and got.dtype == dtype
    for b in range(B):
        assert torch.equal(got[b:b + 1], ba.linear_rows(x[b:b + 1], w, **blocks))
        other = torch.randn(B, K, generator=gen).to(dtype).to(DEVICE)
        other[(b + 1) % B] = float("nan")
        other[b] = x[b]
        assert torch.equal(ba.linear_rows(other, w, **blocks)[b], got[b])
    perm = torch.tensor([3, 0, 4, 2, 1])
    assert torch.equal(ba.linear_rows(x[perm], w, **blocks), got[perm])
    buf = torch.full((B, N + 3), -1.0, dtype=dtype, device=DEVICE)
    assert ba.linear_rows(x, w, out=buf[:, 1:N + 1], **blocks).data_ptr() == buf[:, 1].data_ptr()
    assert torch.equal(buf[:, 1:N + 1], got) and (buf[:, [0, N + 1, N + 2]] == -1).all()
    ref = (x.double() @ w.double().T).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, ref, **tol)
    with pytest.raises(ValueError, match="linear_rows"):
        ba.linear_rows(x, w[:, :8])


@_triton_only
def test_linear_rows_sums_the_k_blocks_in_k_order():
    """Products of mixed magnitudes, one per K block of 32 (within a block the sum is exact): each row is the
    float32 sum of its blocks in K order, which shows in the bits (1 + 2^25 - 2^25 is 0 in that order, 1 in
    the reverse one)."""
    K, big = 72, 2.0 ** 25
    x = torch.ones(2, K, device=DEVICE)
    w = torch.zeros(3, K)
    w[:, [5, 40, 70]] = torch.tensor([[1.0, big, -big], [-big, big, 1.0], [big, 1.0, -big]])
    got = ba.linear_rows(x, w.to(DEVICE), block_n=4, block_k=32)
    assert got.tolist() == [[0.0, 1.0, 0.0]] * 2


# -- q/k norms, rope, cache write ----------------------------------------------------------------------------------

@_triton_only
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("d", [16, 32])
def test_qk_norm_rope_store_rows_is_qk_norm_rope_store_per_token(d, dtype):
    """Three tokens at the first, a middle and the last position of three caches of one pool (two of them the
    same cache): q and the pool bitwise what qk_norm_rope_store gives token by token on pool[c], and only the
    tokens' (cache, position) rows written."""
    from abbench.engine.ops.dense import rope_tables

    hq, hkv, C, S = 8, 2, 3, 40
    gen = torch.Generator().manual_seed(d)
    pos, cidx = [0, 17, 39], [2, 0, 2]
    B = len(pos)
    q, k, v = (torch.randn(B, n * d, generator=gen).to(dtype).to(DEVICE) for n in (hq, hkv, hkv))
    qn, kn = (torch.randn(d, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    cos, sin = rope_tables(d, 10000.0, S, DEVICE, dtype)
    pool_k, pool_v = (torch.randn(C, hkv, S, d, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    ref_k, ref_v, before_k, before_v = pool_k.clone(), pool_v.clone(), pool_k.clone(), pool_v.clone()
    got = ba.qk_norm_rope_store_rows(q, k, v, qn, kn, cos, sin, _ids(pos), _ids(cidx), pool_k, pool_v, 1e-6)
    assert got.shape == (B, hq, d) and got.dtype == dtype
    for b, (p, c) in enumerate(zip(pos, cidx)):
        alone = dk.qk_norm_rope_store(q[b:b + 1], k[b:b + 1], v[b:b + 1], qn, kn, cos, sin, _ids([p]), ref_k[c],
                                      ref_v[c], 1e-6)  # [Hq, 1, D]
        assert torch.equal(got[b], alone[:, 0])
    assert torch.equal(pool_k, ref_k) and torch.equal(pool_v, ref_v)
    written = torch.zeros(C, S, dtype=torch.bool)
    written[cidx, pos] = True
    kept = ~written.to(DEVICE)  # [C, S]
    assert torch.equal(pool_k.transpose(1, 2)[kept], before_k.transpose(1, 2)[kept])
    assert torch.equal(pool_v.transpose(1, 2)[kept], before_v.transpose(1, 2)[kept])
    for b, (p, c) in enumerate(zip(pos, cidx)):
        assert torch.equal(pool_v[c, :, p], v[b].view(hkv, d))
        assert not torch.equal(pool_k[c, :, p], before_k[c, :, p])


# -- attention -----------------------------------------------------------------------------------------------------

BLOCK_L, MAX_SPLITS = 16, 8


def _bucket(pos: int, length: int) -> int:
    """kv_len_for with a 32-position floor: small buckets, so that the tokens' split plans differ."""
    return min(max(32, 1 << pos.bit_length()), length)


def _plans(pos: list[int], length: int) -> torch.Tensor:
    return ba.split_plans([_bucket(p, length) for p in pos], BLOCK_L, MAX_SPLITS, DEVICE)


def _attend(q, pool_k, pool_v, pos, cidx, scale, max_split, max_splits=MAX_SPLITS):
    return ba.attention_rows(q, pool_k, pool_v, _ids(pos), _ids(cidx), _plans(pos, pool_k.shape[2]), scale,
                             max_split, block_l=BLOCK_L, max_splits=max_splits)


def _reference(q, pool_k, pool_v, pos, cidx, scale) -> torch.Tensor:
    """Grouped-query attention in float64: query head h reads KV head h // (Hq/Hkv), keys [0, pos] visible."""
    B, hq, d = q.shape
    hkv = pool_k.shape[1]
    out = []
    for b in range(B):
        keys, values = pool_k[cidx[b], :, :pos[b] + 1].double(), pool_v[cidx[b], :, :pos[b] + 1].double()
        qg = q[b].double().view(hkv, hq // hkv, d)  # [Hkv, G, D]
        p = torch.softmax(qg @ keys.transpose(1, 2) * scale, dim=-1)  # [Hkv, G, n]
        out.append((p @ values).reshape(hq, d))
    return torch.stack(out)


@_triton_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter on the other tokens' NaN caches
@pytest.mark.parametrize("shape", [(8, 2, 16, 300, [0, 31, 100, 200, 299], [3, 1, 4, 0, 2]),
                                   (16, 4, 32, 130, [129, 5, 64], [1, 2, 0])])
def test_attention_rows_gives_each_token_its_own_bits_whatever_the_batch(shape):
    """Tokens at the first position, inside a bucket, and at the last position of a cache no block divides,
    each with its own cache and its own split plan (1 to 8 ranges of 16 to 48 positions; GQA with 4 query
    heads a KV head): each token bitwise what it gets alone, and unchanged when every other token's query,
    cache and position (so plan) changes and everything it must not read (its own cache past pos, the others'
    caches) is NaN; unchanged on a wider grid and a longer max_split; within float noise of float64."""
    hq, hkv, d, S, pos, cidx = shape
    gen = torch.Generator().manual_seed(S)
    B, C, scale = len(pos), max(cidx) + 1, d ** -0.5
    max_split = ba.split_plan(S, BLOCK_L, MAX_SPLITS)[1]
    assert len({tuple(p) for p in _plans(pos, S).tolist()}) >= 2  # the tokens' plans differ
    q = torch.randn(B, hq, d, generator=gen).to(DEVICE)
    pool_k, pool_v = (torch.randn(C, hkv, S, d, generator=gen).to(DEVICE) for _ in range(2))
    got = _attend(q, pool_k, pool_v, pos, cidx, scale, max_split)
    assert got.shape == (B, hq, d) and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), _reference(q, pool_k, pool_v, pos, cidx, scale), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(_attend(q, pool_k, pool_v, pos, cidx, scale, 2 * max_split, 2 * MAX_SPLITS), got)
    for b in range(B):
        assert torch.equal(_attend(q[b:b + 1], pool_k, pool_v, pos[b:b + 1], cidx[b:b + 1], scale, max_split),
                           got[b:b + 1])
        q2 = torch.full_like(q, float("nan"))
        q2[b] = q[b]
        k2, v2 = torch.full_like(pool_k, float("nan")), torch.full_like(pool_v, float("nan"))
        k2[cidx[b], :, :pos[b] + 1] = pool_k[cidx[b], :, :pos[b] + 1]
        v2[cidx[b], :, :pos[b] + 1] = pool_v[cidx[b], :, :pos[b] + 1]
        pos2 = [pos[b] if i == b else int(torch.randint(0, S, (1,), generator=gen)) for i in range(B)]
        assert torch.equal(_attend(q2, k2, v2, pos2, cidx, scale, max_split)[b], got[b])


@_triton_only
def test_attention_rows_refuses_what_it_cannot_run():
    q, pool = torch.zeros(2, 8, 16, device=DEVICE), torch.zeros(2, 2, 64, 16, device=DEVICE)
    plan = _plans([3, 40], 64)
    with pytest.raises(ValueError, match="whole blocks"):
        ba.attention_rows(q, pool, pool, _ids([3, 40]), _ids([0, 1]), plan, 0.25, 40, block_l=BLOCK_L)
    with pytest.raises(ValueError, match="int32"):
        ba.attention_rows(q, pool, pool, _ids([3, 40]), _ids([0, 1]), plan.long(), 0.25, 32, block_l=BLOCK_L)
    with pytest.raises(ValueError, match="power-of-two head dimension"):
        ba.attention_rows(q[..., :12], pool[..., :12], pool[..., :12], _ids([3, 40]), _ids([0, 1]), plan, 0.25, 32,
                          block_l=BLOCK_L)


@_triton_only
def test_the_combine_sums_a_tokens_ranges_one_at_a_time_in_range_order():
    """Ranges of equal maxima (each weighs exp(0) = 1, exactly) with sums of mixed magnitudes, where the order
    of the float32 additions shows in the bits: each head's output is the sequential sum over the token's ranges
    in range order, numerator and denominator, divided once; ranges past the plan or past pos (NaN) unread."""
    gen = torch.Generator().manual_seed(11)
    B, hkv, g, d, n = 3, 2, 4, 16, MAX_SPLITS
    pos, plan = [127, 40, 299], [(8, 16), (4, 16), (8, 48)]  # 8, 3 and 7 ranges hold visible keys
    live = [sum(1 for sp in range(ns) if sp * sl <= p) for p, (ns, sl) in zip(pos, plan)]
    assert live == [8, 3, 7]
    m = torch.full((B, hkv, n, g), float("nan"))
    scale = 2.0 ** torch.randint(-12, 12, (B, hkv, n, g, 1), generator=gen)
    acc = torch.randn(B, hkv, n, g, d, generator=gen) * scale
    lsum = torch.rand(B, hkv, n, g, generator=gen) * scale[..., 0] + 1.0
    for b in range(B):
        m[b, :, :live[b]] = 0.0
        acc[b, :, live[b]:] = float("nan")
        lsum[b, :, live[b]:] = float("nan")
    out = torch.empty(B, hkv * g, d, device=DEVICE)
    ba.combine_splits(m.to(DEVICE), lsum.to(DEVICE), acc.to(DEVICE), _ids(pos), _ids(plan, torch.int32), out)
    want = torch.empty(B, hkv, g, d)
    for b in range(B):
        num, den = acc[b, :, 0].clone(), lsum[b, :, 0].clone()  # [Hkv, G, D], [Hkv, G] float32
        for sp in range(1, live[b]):
            num, den = num + acc[b, :, sp], den + lsum[b, :, sp]
        want[b] = num / den[..., None]
    assert torch.equal(out.cpu(), want.view(B, hkv * g, d))
