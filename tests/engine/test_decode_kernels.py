"""Candidate decode kernels (abbench.engine.ops.kernels) agree with the engine's own functions.

The SDPA attention variants are checked here on every machine, at positions that mask most of the bucket, none
of it, and one key; the Triton one-token experts where Triton is installed (CUDA builds of torch; on CPU only
under TRITON_INTERPRET=1), at sizes the blocks do not divide. ``gpucheck_decode_kernels`` runs end to end.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from abbench.engine.ops import kernels as dk  # noqa: E402
from abbench.engine.tools import reference_kernels as rk  # noqa: E402
from abbench.engine.config import PRESETS  # noqa: E402
from abbench.engine.tools.gpucheck_decode_kernels import main  # noqa: E402
from abbench.engine.ops.dense import decode_gqa  # noqa: E402
from abbench.engine.ops.moe import looped_mm, moe_experts  # noqa: E402

DEVICE = torch.device(os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu"))


def _triton_runs_here() -> bool:
    return dk.have_triton() and (DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def _slow_when_interpreted(test):
    """A whole-engine test runs every Triton program in Python under TRITON_INTERPRET=1 (8-20 minutes on CPU,
    past the suite's 600 s timeout): 40 minutes there; the suite's timeout elsewhere."""
    return pytest.mark.timeout(2400)(test) if os.environ.get("TRITON_INTERPRET") == "1" else test


@pytest.mark.parametrize("pos", [0, 1, 37, 63])
def test_sdpa_attention_equals_the_engines_over_the_bucket_and_exactly(pos: int):
    gen = torch.Generator().manual_seed(pos)
    hq, hkv, d, length = 8, 2, 16, 64
    q = torch.randn(hq, 1, d, generator=gen).to(DEVICE)
    keys, values = torch.randn(hkv, length, d, generator=gen).to(DEVICE), torch.randn(hkv, length, d, generator=gen).to(DEVICE)
    at = torch.tensor([pos], device=DEVICE)
    ref = decode_gqa(q, keys, values, torch.arange(length, device=DEVICE) > at, d ** -0.5)
    torch.testing.assert_close(rk.attention_sdpa(q, keys, values, at, d ** -0.5), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rk.attention_sdpa_exact(q, keys, values, pos + 1, d ** -0.5), ref, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("shape", [(8, 2, 16, 64, 37, 16), (8, 2, 16, 64, 0, 16), (32, 4, 32, 200, 199, 16),
                                   (32, 4, 32, 256, 100, 32), (4, 4, 16, 48, 47, 16)])
def test_split_kv_attention_equals_the_engines(shape):
    """Positions at the start, inside and at the end of the bucket, a bucket no block divides, one query head
    per KV head; the K and V views strided as the engine's cache slices are."""
    if not _triton_runs_here():
        pytest.skip("Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
    hq, hkv, d, length, pos, block = shape
    gen = torch.Generator().manual_seed(pos)
    q = torch.randn(hq, 1, d, generator=gen).to(DEVICE)
    cache_k = torch.randn(hkv, length + 24, d, generator=gen).to(DEVICE)  # a longer cache, sliced to the bucket
    cache_v = torch.randn(hkv, length + 24, d, generator=gen).to(DEVICE)
    keys, values = cache_k[:, :length], cache_v[:, :length]
    at = torch.tensor([pos], device=DEVICE)
    ref = decode_gqa(q, keys, values, torch.arange(length, device=DEVICE) > at, d ** -0.5)
    torch.testing.assert_close(dk.attention_split_kv(q, keys, values, at, d ** -0.5, block_l=block), ref,
                               rtol=1e-5, atol=1e-5)


_triton_only = pytest.mark.skipif("not _triton_runs_here()",
                                  reason="Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")


@_triton_only
@pytest.mark.parametrize("n", [64, 72])
def test_fused_rms_norm_equals_the_models_norms_with_and_without_the_residual(n: int):
    """One kernel for model.rms_norm and hybrid.zc_rms_norm (a width no power of two when 72), and the
    residual add before the norm returned beside it."""
    from abbench.engine.models.hybrid import zc_rms_norm
    from abbench.engine.ops.dense import rms_norm

    gen = torch.Generator().manual_seed(n)
    x, a = (torch.randn(3, n, generator=gen) * 4).to(DEVICE), torch.randn(3, n, generator=gen).to(DEVICE)
    w = torch.randn(n, generator=gen).to(DEVICE)
    torch.testing.assert_close(dk.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk.rms_norm(x, w, 1e-6, plus_one=True), zc_rms_norm(x, w, 1e-6), rtol=1e-5,
                               atol=1e-5)
    total, normed = dk.rms_norm(a, w, 1e-6, residual=x)
    assert torch.equal(total, x + a)
    torch.testing.assert_close(normed, rms_norm(x + a, w, 1e-6), rtol=1e-5, atol=1e-5)


@_triton_only
@pytest.mark.parametrize("pos", [0, 5, 30])
def test_fused_qk_norm_rope_store_equals_the_models_ops(pos: int):
    """q/k per-head norms, rope at a position read on the device and the cache write, against the torch ops of
    Model.decode_attention; the cache written at pos only."""
    from abbench.engine.ops.dense import rms_norm, rope_tables, rotate_half

    hq, hkv, d, length = 8, 2, 16, 32
    gen = torch.Generator().manual_seed(pos)
    q, k, v = (torch.randn(1, n * d, generator=gen).to(DEVICE) for n in (hq, hkv, hkv))
    qn, kn = torch.randn(d, generator=gen).to(DEVICE), torch.randn(d, generator=gen).to(DEVICE)
    cos, sin = rope_tables(d, 10000.0, length, DEVICE, torch.float32)
    cache_k, cache_v = torch.zeros(hkv, length, d, device=DEVICE), torch.zeros(hkv, length, d, device=DEVICE)
    got = dk.qk_norm_rope_store(q, k, v, qn, kn, cos, sin, torch.tensor([pos], device=DEVICE), cache_k, cache_v,
                                1e-6)
    qr = rms_norm(q.view(hq, 1, d), qn, 1e-6)
    kr = rms_norm(k.view(hkv, 1, d), kn, 1e-6)
    c, s_ = cos[pos:pos + 1], sin[pos:pos + 1]
    torch.testing.assert_close(got, qr * c + rotate_half(qr) * s_, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache_k[:, pos:pos + 1], kr * c + rotate_half(kr) * s_, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache_v[:, pos], v.view(hkv, d))
    others = torch.arange(length, device=DEVICE) != pos
    assert not cache_k[:, others].any() and not cache_v[:, others].any()


@_triton_only
@pytest.mark.parametrize("e,k,norm,skew", [(16, 4, True, False), (128, 8, False, True), (60, 6, True, True)])
def test_fused_router_equals_route(e: int, k: int, norm: bool, skew: bool):
    """Softmax, top-k in descending order and the renormalisation in one kernel, against model.route; an
    expert count no power of two, with and without the skew bias."""
    from abbench.engine.ops.moe import route

    gen = torch.Generator().manual_seed(e)
    h, router = torch.randn(1, 32, generator=gen).to(DEVICE), torch.randn(e, 32, generator=gen).to(DEVICE)
    bias = torch.randn(e, generator=gen).to(DEVICE) if skew else None
    w, ids = dk.route_topk(h @ router.T, k, norm, torch.float32, bias)
    ref_w, ref_ids = route(h, router, k, norm, bias)
    assert ids.dtype == torch.long and torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def test_triton_experts_of_one_token_equal_the_grouped_experts():
    if not _triton_runs_here():
        pytest.skip("Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(0)
    G, inter, H, k = 12, 40, 72, 5  # not multiples of the blocks
    gate_up = (torch.randn(G, 2 * inter, H, generator=gen) / 8).to(DEVICE)
    down = (torch.randn(G, H, inter, generator=gen) / 8).to(DEVICE)
    h = torch.randn(1, H, generator=gen).to(DEVICE)
    ids = torch.tensor([[11, 3, 0, 7, 5]], device=DEVICE)
    w = torch.softmax(torch.randn(1, k, generator=gen), -1).to(DEVICE)
    ref = moe_experts(h, w, ids, gate_up, down, looped_mm)
    got = dk.moe_one_token(h, w, ids, gate_up, down, block_n=16, block_k=32)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    x = torch.randn(1, H, generator=gen).to(DEVICE)
    assert torch.equal(dk.moe_one_token(h, w, ids, gate_up, down, block_n=16, block_k=32, residual=x), x + got)
    with pytest.raises(ValueError, match="one token"):
        dk.moe_one_token(h.repeat(2, 1), w, ids, gate_up, down)



def _host_lookup(lru, free, ids: list[int], identity: bool) -> tuple[list[int], int]:
    """ExpertStore.decode_experts's policy on plain containers: (slot of each id, hits)."""
    slot_of = {e: lru[e] for e in sorted(set(ids)) if e in lru}
    for e in slot_of:
        lru.move_to_end(e)
    hits = len(slot_of)
    for e in sorted(set(ids) - set(slot_of)):
        s = e if identity else (free.pop() if free else lru.popitem(last=False)[1])
        lru[e] = slot_of[e] = s
    return [slot_of[e] for e in ids], hits


@pytest.mark.parametrize("via", ["assign_slots", "route_topk"])
@pytest.mark.parametrize("e,k,s", [(16, 4, 4), (16, 4, 7), (16, 4, 16), (40, 8, 13), (160, 8, 97)])
def test_device_slot_lookup_is_the_host_lru(e: int, k: int, s: int, via: str):
    """The device-side slot table (decode_misses "device") picks the slot the host's LRU would, for every
    routed expert, step after step (free slots lowest first, then the least recently used, hits touched
    before misses), keeps the same table (pulled back to the host) and counts the same hits and misses; the
    host can take over and hand back (push) at any step. Up to 160 experts, 97 slots. Through the lookup
    kernel or inside the router's kernel (the decode step's way), which routes to the same experts."""
    from collections import OrderedDict

    from abbench.engine.runtime.experts import DeviceSlotTable

    if not _triton_runs_here():
        pytest.skip("Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
    rng = torch.Generator().manual_seed(s)
    table = DeviceSlotTable(2, e, s, k, DEVICE)
    lru, free = [OrderedDict() for _ in range(2)], [list(range(s - 1, -1, -1)) for _ in range(2)]
    table.push(lru, free)
    hits = misses = 0
    for step in range(10):
        table.tick.add_(1)
        for layer in range(2):
            pool = e if step % 3 == 0 else min(e, k + 3)  # alternate wide routing with a hot set that hits
            ids = (torch.randperm(pool, generator=rng)[:k]).tolist()
            if via == "assign_slots":
                rk.lookup(table, layer, torch.tensor([ids], device=DEVICE))
            else:  # logits whose top k are ids, in that order
                logits = torch.zeros(1, e)
                logits[0, ids] = 8.0 - torch.arange(k, dtype=torch.float32)
                _, routed = dk.route_topk(logits.to(DEVICE), k, True, torch.float32, lookup=table.layer(layer))
                assert routed.tolist() == [ids]
            cached = set(lru[layer])
            want, h = _host_lookup(lru[layer], free[layer], ids, s == e)
            assert table.slots[layer].tolist() == want
            assert table.src[layer].tolist() == [-1 if x in cached else x for x in ids]  # what fetch copies
            hits, misses = hits + h, misses + len(set(ids)) - h
        pulled, pulled_free = table.pull()
        assert [list(d.items()) for d in pulled] == [list(d.items()) for d in lru]
        assert s == e or pulled_free == free
        if step == 5:  # the host takes over (a host-side lookup) and hands back
            table.push(lru, free)
    assert table.take_counts() == (hits, misses) and table.take_counts() == (0, 0)


def test_fetch_misses_copies_exactly_the_missed_experts_bits():
    if not _triton_runs_here():
        pytest.skip("Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(1)
    E, S, inter, H = 9, 5, 24, 40
    host_gu, host_dn = torch.randn(E, 2 * inter, H, generator=gen), torch.randn(E, H, inter, generator=gen)
    if DEVICE.type == "cuda":  # the kernel reads host memory mapped into the device's address space
        host_gu, host_dn = host_gu.pin_memory(), host_dn.pin_memory()
    gu, dn = torch.zeros(S, 2 * inter, H, device=DEVICE), torch.zeros(S, H, inter, device=DEVICE)
    src = torch.tensor([7, -1, 2], dtype=torch.int32, device=DEVICE)  # expert 7 into slot 4, a hit, 2 into 0
    slots = torch.tensor([4, 3, 0], device=DEVICE)
    rk.fetch_misses(src, slots, host_gu, host_dn, gu, dn, chunks=3, block=128)
    assert torch.equal(gu[4].cpu(), host_gu[7]) and torch.equal(dn[4].cpu(), host_dn[7])
    assert torch.equal(gu[0].cpu(), host_gu[2]) and torch.equal(dn[0].cpu(), host_dn[2])
    assert not gu[[1, 2, 3]].any() and not dn[[1, 2, 3]].any()  # the hit's slot and the others untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_reading_their_misses_from_the_host_equal_fetching_first(dtype):
    """moe_one_token's ``fetch``: the missed experts read from the host bank, computed with and stored into
    their slots in the same kernels give the bits of fetch_misses followed by moe_one_token, and leave the
    slots as fetch_misses does (the hit's and the unrouted slots untouched). Sizes the blocks do not divide."""
    if not _triton_runs_here():
        pytest.skip("Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(2)
    E, S, inter, H = 9, 5, 40, 72
    host_gu = (torch.randn(E, 2 * inter, H, generator=gen) / 8).to(dtype)
    host_dn = (torch.randn(E, H, inter, generator=gen) / 8).to(dtype)
    if DEVICE.type == "cuda":  # the kernels read host memory mapped into the device's address space
        host_gu, host_dn = host_gu.pin_memory(), host_dn.pin_memory()
    gu = torch.randn(S, 2 * inter, H, generator=gen).to(dtype).to(DEVICE)  # stale slot contents
    dn = torch.randn(S, H, inter, generator=gen).to(dtype).to(DEVICE)
    gu[3], dn[3] = host_gu[5].to(DEVICE), host_dn[5].to(DEVICE)  # the hit: expert 5 sits in slot 3
    src = torch.tensor([7, -1, 2], dtype=torch.int32, device=DEVICE)  # expert 7 into slot 4, the hit, 2 into 0
    slots = torch.tensor([[4, 3, 0]], device=DEVICE)
    h = torch.randn(1, H, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(1, H, generator=gen).to(dtype).to(DEVICE)
    w = torch.softmax(torch.randn(1, 3, generator=gen), -1).to(DEVICE)
    ref_gu, ref_dn = gu.clone(), dn.clone()
    rk.fetch_misses(src, slots.reshape(-1), host_gu, host_dn, ref_gu, ref_dn, chunks=3, block=128)
    ref = dk.moe_one_token(h, w, slots, ref_gu, ref_dn, block_n=16, block_k=32, residual=x)
    before_gu, before_dn = gu.clone(), dn.clone()
    got = dk.moe_one_token(h, w, slots, gu, dn, block_n=16, block_k=32, residual=x, fetch=(src, host_gu, host_dn))
    assert torch.equal(got, ref)
    assert torch.equal(gu, ref_gu) and torch.equal(dn, ref_dn)
    assert torch.equal(gu[[1, 2, 3]], before_gu[[1, 2, 3]]) and torch.equal(dn[[1, 2, 3]], before_dn[[1, 2, 3]])
    with pytest.raises(ValueError, match="shaped and typed"):
        dk.moe_one_token(h, w, slots, gu, dn, fetch=(src, host_gu[:, :, :8].contiguous(), host_dn))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_reading_fp8_misses_equal_dequantizing_them_first(dtype):
    """An FP8 bank's misses: moe_one_token's ``fetch`` with the bank's float8 values and row scales gives the bits
    of dequantizing the missed experts into their slots first (``bank.dequantize_into``, the host's path), and
    leaves those very values in the slots (the hit's and the unrouted slots untouched)."""
    if not _triton_runs_here():
        pytest.skip("Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip("the interpreter rounds float32 to bfloat16 toward zero; compiled Triton rounds to nearest even")
    from abbench.engine.models.bank import dequantize_into, quantize_rows

    gen = torch.Generator().manual_seed(3)
    E, S, inter, H = 9, 5, 24, 40
    (q_gu, s_gu), (q_dn, s_dn) = (quantize_rows(torch.randn(E, 2 * inter, H, generator=gen) / 8),
                                  quantize_rows(torch.randn(E, H, inter, generator=gen) / 8))
    if DEVICE.type == "cuda":  # the kernels read host memory mapped into the device's address space
        q_gu, s_gu, q_dn, s_dn = (t.pin_memory() for t in (q_gu, s_gu, q_dn, s_dn))
    gu = torch.randn(S, 2 * inter, H, generator=gen).to(dtype).to(DEVICE)  # stale slot contents
    dn = torch.randn(S, H, inter, generator=gen).to(dtype).to(DEVICE)
    dequantize_into(gu[3:4], q_gu[5:6].to(DEVICE), s_gu[5:6].to(DEVICE))  # the hit: expert 5 sits in slot 3
    dequantize_into(dn[3:4], q_dn[5:6].to(DEVICE), s_dn[5:6].to(DEVICE))
    src = torch.tensor([7, -1, 2], dtype=torch.int32, device=DEVICE)  # expert 7 into slot 4, the hit, 2 into 0
    slots = torch.tensor([[4, 3, 0]], device=DEVICE)
    h = torch.randn(1, H, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(1, H, generator=gen).to(dtype).to(DEVICE)
    w = torch.softmax(torch.randn(1, 3, generator=gen), -1).to(DEVICE)
    ref_gu, ref_dn = gu.clone(), dn.clone()
    for slot, e in ((4, 7), (0, 2)):
        dequantize_into(ref_gu[slot:slot + 1], q_gu[e:e + 1].to(DEVICE), s_gu[e:e + 1].to(DEVICE))
        dequantize_into(ref_dn[slot:slot + 1], q_dn[e:e + 1].to(DEVICE), s_dn[e:e + 1].to(DEVICE))
    ref = dk.moe_one_token(h, w, slots, ref_gu, ref_dn, block_n=16, block_k=32, residual=x)
    before_gu, before_dn = gu.clone(), dn.clone()
    got = dk.moe_one_token(h, w, slots, gu, dn, block_n=16, block_k=32, residual=x,
                           fetch=(src, q_gu, q_dn, s_gu, s_dn))
    assert torch.equal(got, ref)
    assert torch.equal(gu, ref_gu) and torch.equal(dn, ref_dn)
    assert torch.equal(gu[[1, 2, 3]], before_gu[[1, 2, 3]]) and torch.equal(dn[[1, 2, 3]], before_dn[[1, 2, 3]])
    with pytest.raises(ValueError, match="FP8 fetch needs"):
        dk.moe_one_token(h, w, slots, gu, dn, fetch=(src, q_gu, q_dn, s_gu[:, :4].contiguous(), s_dn))


@pytest.mark.parametrize("n_tok", [1, 3])
def test_every_way_of_reading_fp8_weights_sums_in_one_order_at_full_width(n_tok):
    """At the width of the 35B-A3B models' experts (H 2048, I 512) and ``moe_tokens``' own tiles, the float32 sums
    are bit for bit those of slots holding the same weights dequantized, however the kernels read them: FP8 slots
    (hits), FP8 slots filled by misses from an FP8 bank, compute-dtype slots filled by them. Compiled Triton lays
    a tile out by its loads' width, and a float8 tile would hold twice a bfloat16 tile's columns a thread (another
    summation order). Small tiles have too few columns a thread for that, and an engine's bfloat16 outputs hide a
    float32 difference at small widths: at full width FP8 slots left the resident FP8 engine's ids
    (results/20261206t)."""
    if DEVICE.type != "cuda" or not dk.have_triton():
        pytest.skip("compiled Triton's tile layouts: CUDA")
    from abbench.engine.models.bank import dequantize, quantize_rows

    gen = torch.Generator().manual_seed(11)
    E, H, inter, k = 8, 2048, 512, 4
    (q_gu, s_gu), (q_dn, s_dn) = (quantize_rows(torch.randn(E, 2 * inter, H, generator=gen) / 8),
                                  quantize_rows(torch.randn(E, H, inter, generator=gen) / 8))
    host = tuple(t.pin_memory() for t in (q_gu, q_dn, s_gu, s_dn))  # read zero-copy by the kernels
    dq_gu, dq_dn = (dequantize(q.to(DEVICE), sc.to(DEVICE), torch.bfloat16)
                    for q, sc in ((q_gu, s_gu), (q_dn, s_dn)))
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(n_tok)]).to(DEVICE)
    h = torch.randn(n_tok, H, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = torch.softmax(torch.randn(n_tok, k, generator=gen), -1).to(DEVICE)
    src = ids.reshape(-1).to(torch.int32)  # every pair a miss of its expert, into the slot of its number
    want = dk.moe_tokens(h, w, ids, dq_gu, dq_dn, out_dtype=torch.float32)  # resident, dequantized weights
    fp8_slots = dk.moe_tokens(h, w, ids, q_gu.to(DEVICE), q_dn.to(DEVICE), out_dtype=torch.float32,
                              slot_scales=(s_gu.to(DEVICE), s_dn.to(DEVICE)))
    gu8, dn8 = torch.zeros_like(q_gu, device=DEVICE), torch.zeros_like(q_dn, device=DEVICE)
    sgu8, sdn8 = torch.ones_like(s_gu, device=DEVICE), torch.ones_like(s_dn, device=DEVICE)
    fp8_misses = dk.moe_tokens(h, w, ids, gu8, dn8, host=host, src=src, slot_scales=(sgu8, sdn8),
                               out_dtype=torch.float32)
    gu, dn = torch.zeros_like(dq_gu), torch.zeros_like(dq_dn)
    misses = dk.moe_tokens(h, w, ids, gu, dn, host=host, src=src, out_dtype=torch.float32)
    for name, got in (("FP8 slots", fp8_slots), ("misses into FP8 slots", fp8_misses),
                      ("misses into bfloat16 slots", misses)):
        assert torch.equal(got, want), f"{name}: {(got - want).abs().max().item():.3g} off"
    routed = ids.unique()
    assert torch.equal(gu8[routed].view(torch.uint8), q_gu.to(DEVICE)[routed].view(torch.uint8))  # the misses
    assert torch.equal(sgu8[routed], s_gu.to(DEVICE)[routed]) and torch.equal(gu[routed], dq_gu[routed])


def test_the_kernel_check_runs_and_every_candidate_agrees(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["--device", str(DEVICE), "--contexts", "64,128", "--replays", "3", "--batch", "1,3", "--out",
                 str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    batched = {f"{part}, {b} tokens" for b in (1, 3) for part in ("experts", "q projection", "attention 128")}
    assert {r["part"] for r in rows} == {"experts", "attention 64", "attention 128"} | (
        batched if dk.have_triton() else set())  # (the batched step's kernels are Triton's)
    assert all(r["agrees"] for r in rows) and all(r["us"] > 0 for r in rows)
    assert "PASS" in capsys.readouterr().out


def _decode(engine, prompts: list[list[int]], n: int = 4, **kw) -> list[list[tuple]]:
    out = []
    for p in prompts:
        engine.reset()
        events, _ = engine.run(p, n, ignore_eos=True, logprobs=3, **kw)
        out.append([(e.token_id, e.top_logprobs) for e in events])
    return out


@pytest.mark.skipif(not _triton_runs_here(), reason="Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
@pytest.mark.parametrize("model,kernels", [("tiny", dict(decode_experts="triton")),
                                          ("tiny", dict(decode_attention="triton")),
                                          ("qwen3.5-tiny", dict(decode_experts="triton", decode_attention="triton"))])
@_slow_when_interpreted
def test_triton_decode_is_one_path_at_every_slot_budget(model, kernels):
    """The Triton experts (and router) or attention (and norms), for Qwen3-MoE and the hybrid: resident
    experts, slot caches too small (per-layer steps, misses copied) and complete (whole steps) decode bitwise
    alike; and within float noise of the default decode."""
    from abbench.engine import Engine, EngineConfig

    knobs = dict(model=model, weights="random:0", device=str(DEVICE), dtype="float32", chunk_tokens=64,
                 max_context=256, bandwidth_probe_bytes=0)  # float32 on CUDA too: "float noise" is float32's
    vocab = PRESETS[model].vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40)]
    ref = _decode(Engine(EngineConfig(**knobs, prefill_mode="resident", **kernels)), prompts)
    misses = ("host", "device") if kernels.get("decode_experts") == "triton" else ("host",)
    counted: dict[int, set] = {}
    for slots in (4, 16):  # top-4 of 16 experts: misses every step, none once every expert is in (whole steps)
        for who in misses:  # per-layer steps with host copies, or whole steps with the lookup on the device
            engine = Engine(EngineConfig(**knobs, prefill_mode="chunked", expert_slots_per_layer=slots,
                                         decode_misses=who, **kernels))
            assert _decode(engine, prompts) == ref
            assert engine.decoder.misses == who
            engine.reset()
            _, st = engine.run(prompts[1], 6, ignore_eos=True)
            counted.setdefault(slots, set()).add((st.slot_hits, st.slot_misses, st.decode_h2d_bytes))
    assert all(len(v) == 1 for v in counted.values()), counted  # one policy, counted alike on either side
    assert next(iter(counted[4]))[1] > 0
    if len(misses) == 2:  # each request choosing: the two sides hand the warm slot cache to each other
        mixed, device = (Engine(EngineConfig(**knobs, prefill_mode="chunked", expert_slots_per_layer=4, **kernels))
                         for _ in range(2))
        p = prompts[1]
        for prompt, who in ((p, "host"), (p + [7], "device"), (p + [7, 9], "host"), (prompts[0], "device")):
            a_events, a = mixed.run(prompt, 4, ignore_eos=True, logprobs=3, decode_misses=who)
            b_events, b = device.run(prompt, 4, ignore_eos=True, logprobs=3)  # the device's all the way
            assert [(e.token_id, e.top_logprobs) for e in a_events] == [(e.token_id, e.top_logprobs)
                                                                       for e in b_events]
            assert (a.slot_hits, a.slot_misses) == (b.slot_hits, b.slot_misses)  # the same cache, step by step
            assert (a.decode_misses, b.decode_misses) == (who, "device")
    grouped = _decode(Engine(EngineConfig(**knobs, prefill_mode="resident", decode_experts="grouped",
                                          decode_attention="torch")), prompts)
    for a, b in zip(ref, grouped):
        assert a[0] == b[0]  # the first token comes from prefill, which is the same code
        for (_, la), (_, lb) in zip(a, b):
            assert [i for i, _ in la][:1] == [i for i, _ in lb][:1] or abs(la[0][1] - la[1][1]) < 1e-3
            assert max(abs(x - y) for (_, x), (_, y) in zip(la, lb)) < 5e-2


@pytest.mark.parametrize("kernel", ["decode_experts", "decode_attention"])
def test_triton_decode_kernels_refuse_what_they_cannot_run(kernel):
    from abbench.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match=kernel):
        EngineConfig(**{kernel: "cutlass"})
    knobs = dict(weights="random:0", device=str(DEVICE), chunk_tokens=64, max_context=128, bandwidth_probe_bytes=0,
                 **{kernel: "triton"})
    if not dk.have_triton():
        with pytest.raises(ValueError, match="needs Triton"):
            Engine(EngineConfig(model="tiny", **knobs))
    else:
        with pytest.raises(ValueError, match="its own"):
            Engine(EngineConfig(model="qwen4-exp-tiny", **knobs))


@_slow_when_interpreted
def test_gpucheck_runs_on_cpu_with_the_kernels_it_is_given(capsys):
    """The pre-run check of a GPU session (grouped GEMM limit, decode equal across graphs, eager and slot
    budgets, step times) runs end to end on CPU at a tiny shape, with the decode kernels it was given."""
    from abbench.engine.tools import gpucheck

    kernels = (["--decode-experts", "triton", "--decode-attention", "triton"] if _triton_runs_here() else [])
    assert gpucheck.main(["--device", str(DEVICE), "--preset", "tiny", "--layers", "2", "--prompt-tokens", "64",
                          "--decode-tokens", "3", *kernels]) == 0
    out = capsys.readouterr().out
    assert "gpucheck: PASS" in out and "'resident_graphs_vs_eager': True" in out


def test_auto_picks_the_triton_kernels_on_cuda_where_they_apply_and_the_default_ones_elsewhere():
    """The default decode kernels ("auto"): Triton's on CUDA for Qwen3-MoE when Triton is installed; the torch
    ones on CPU (even under TRITON_INTERPRET=1) and for Qwen4-Exp, whose decode is its own. The resolved
    names are what the request stats report (decode.kernels)."""
    from abbench.engine import Engine, EngineConfig

    knobs = dict(weights="random:0", device=str(DEVICE), chunk_tokens=64, max_context=128, bandwidth_probe_bytes=0)
    fast = DEVICE.type == "cuda" and dk.have_triton()
    assert Engine(EngineConfig(model="tiny", **knobs)).decoder.kernels == (
        "experts=triton, attention=triton" if fast else "experts=grouped, attention=torch")
    assert Engine(EngineConfig(model="qwen4-exp-tiny", **knobs)).decoder.kernels == "experts=grouped, attention=torch"
    assert Engine(EngineConfig(model="tiny", decode_experts="grouped", decode_attention="torch",
                               **knobs)).decoder.kernels == "experts=grouped, attention=torch"


def test_auto_keeps_the_torch_attention_for_a_head_dimension_the_kernels_do_not_take():
    """A head dimension of 8 (the wide test shapes): auto attends with torch's kernels (on CUDA its experts
    may still be Triton's); asking for the Triton attention is refused with the reason, before any step runs."""
    import dataclasses

    from abbench.engine import Engine, EngineConfig

    narrow = dataclasses.replace(PRESETS["tiny"], head_dim=8, name="tiny-d8")
    knobs = dict(model=narrow, weights="random:0", device=str(DEVICE), chunk_tokens=64, max_context=128,
                 bandwidth_probe_bytes=0)
    assert Engine(EngineConfig(**knobs)).decoder.kernels.endswith("attention=torch")
    if dk.have_triton():
        with pytest.raises(ValueError, match="power-of-two head dimension"):
            Engine(EngineConfig(**knobs, decode_attention="triton"))


def test_device_side_misses_need_the_triton_experts():
    from abbench.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match="decode_misses"):
        EngineConfig(decode_misses="gpu")
    knobs = dict(model="tiny", weights="random:0", device=str(DEVICE), chunk_tokens=64, max_context=128,
                 bandwidth_probe_bytes=0, expert_slots_per_layer=4)
    with pytest.raises(ValueError, match="needs decode_experts 'triton'"):
        Engine(EngineConfig(**knobs, decode_experts="grouped", decode_misses="device"))
    engine = Engine(EngineConfig(**knobs, decode_experts="grouped"))  # auto: the host handles them
    assert engine.decoder.misses == "host" and engine.decoder.table is None
    with pytest.raises(ValueError, match="needs decode_experts 'triton'"):  # nor may a request ask for it
        engine.run([1, 2, 3], 2, decode_misses="device")
    with pytest.raises(ValueError, match="'host' or 'device'"):
        engine.run([1, 2, 3], 2, decode_misses="gpu")
    assert engine.run([1, 2, 3], 3, decode_misses="host")[1].decode_misses == "host"
    assert Engine(EngineConfig(**{**knobs, "expert_slots_per_layer": None}, prefill_mode="resident",
                               decode_experts="grouped")).decoder.misses is None  # nothing can miss


@_slow_when_interpreted
def test_the_slot_cache_hands_over_between_host_and_device_and_a_flush_empties_both():
    """The host's and the device's views of the slot cache each pull the other's changes before use, once; a
    flush discards what device-side steps did as well (no Triton needed: the table's own copies)."""
    from collections import OrderedDict

    from abbench.engine.runtime.experts import SlotCache

    cfg = PRESETS["tiny"]
    cache = SlotCache(cfg, 4, torch.device("cpu"), torch.float32)
    table = cache.attach_table(cfg.num_experts_per_tok)
    assert cache.attach_table(cfg.num_experts_per_tok) is table and not cache.host_ahead
    device_view = [OrderedDict() for _ in range(cfg.num_hidden_layers)]
    device_view[1].update({9: 0, 3: 2})  # as if device-side steps had put experts 9 and 3 in layer 1's slots
    table.push(device_view, [[s for s in (3, 2, 1, 0) if s not in d.values()] for d in device_view])
    table.ahead = True
    assert cache.layer_slots(1) == {9: 0, 3: 2} and list(cache.lru[1]) == [9, 3]  # pulled, oldest first
    assert cache.free[1] == [3, 1] and cache.loaded == 2 and not table.ahead
    table.ahead = True  # more device-side steps, then a flush: nothing of theirs may come back
    cache.flush()
    assert cache.layer_slots(1) == {} and cache.host_ahead
    cache.sync_device()  # the next device-side step starts from the empty cache
    assert not cache.host_ahead and (table.slot_of == -1).all() and (table.expert_of == -1).all()


@pytest.mark.skipif(not _triton_runs_here(), reason="Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
@pytest.mark.parametrize("config", dk.GROUPED_FP8_CONFIGS)
@pytest.mark.parametrize("counts", [[5, 0, 70, 1, 0, 130], [0, 0, 0, 3], [64, 64]])
def test_the_fp8_grouped_gemm_multiplies_by_the_dequantized_weights(counts, config):
    """``grouped_mm_fp8`` over an FP8 layer equals the grouped GEMM over the layer ``dequantize_fp8`` writes:
    groups empty, shorter than a tile and over several, columns and a reduction not a multiple of the tile."""
    from abbench.engine.models.bank import dequantize, quantize_rows

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(len(counts))
    g, n, k = len(counts), 200, 96
    w = (torch.randn(g, n, k, generator=gen) * k ** -0.5).to(DEVICE, dtype)
    q, scale = quantize_rows(w)
    x = torch.randn(sum(counts), k, generator=gen).to(DEVICE, dtype)
    offs = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    got = dk.grouped_mm_fp8(x, q, scale, offs, config)
    want = looped_mm(x, dequantize(q, scale, dtype), offs)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert got.shape == want.shape and torch.allclose(got.float(), want.float(), **tol)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dk.grouped_mm_fp8(x, w, scale, offs)


@pytest.mark.skipif(not _triton_runs_here(), reason="Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
@pytest.mark.parametrize("config", dk.GROUPED_FP8_CONFIGS[:2] + (None,))  # None: W8A8's default launch
@pytest.mark.parametrize("counts", [[5, 0, 70, 1, 0, 130], [64, 64]])
def test_the_w8a8_grouped_gemm_is_the_fp8_products_scaled(counts, config):
    """``grouped_mm_fp8(math="fp8")``: x quantized per row by ``quantize_rows_fp8`` (the bank's rule and torch's
    bits: an all-zero row gets scale 1), the FP8 products summed in float32 and scaled by the row's and the
    channel's scales, as ``moe.w8a8_reference`` computes; and within FP8's error of the bf16 GEMM over the dequantized weights."""
    from abbench.engine.models.bank import dequantize, quantize_rows
    from abbench.engine.ops.moe import Fp8Experts, w8a8_reference

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(len(counts) + 7)
    g, n, k = len(counts), 200, 96
    w = (torch.randn(g, n, k, generator=gen) * k ** -0.5).to(DEVICE, dtype)
    q, scale = quantize_rows(w)
    x = torch.randn(sum(counts), k, generator=gen).to(DEVICE, dtype)
    x[3] = 0
    xq, xs = dk.quantize_rows_fp8(x)
    tq, ts = quantize_rows(x)
    assert torch.equal(xs, ts) and xs[3] == 1 and torch.equal(xq.view(torch.uint8), tq.view(torch.uint8))
    offs = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    got = dk.grouped_mm_fp8(x, q, scale, offs, config, math="fp8")
    want = w8a8_reference(x, Fp8Experts(q, scale, "fp8"), offs, looped_mm)
    assert got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert (got[3] == 0).all()
    bf16 = looped_mm(x, dequantize(q, scale, dtype), offs).float()
    assert (got.float() - bf16).abs().max() <= 0.1 * bf16.abs().max()  # e4m3's 3 mantissa bits on x
    with pytest.raises(ValueError, match="math"):
        dk.grouped_mm_fp8(x, q, scale, offs, math="int8")
