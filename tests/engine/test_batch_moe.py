"""The routed experts of a decode batch (``kernels.moe_tokens``): every token's bits as alone, each expert read once
for the batch, the batch's experts looked up in the slot table once each (the host LRU's policy over the union),
misses read from the host bank and left in their slots, and an expert the slots cannot take this step read from
the host and not cached. Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1 (float32 there: the interpreter
rounds to bfloat16 differently from compiled Triton).
"""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest

torch = pytest.importorskip("torch")

from abbench.engine.ops import kernels as dk  # noqa: E402
from abbench.engine.runtime.experts import DeviceSlotTable  # noqa: E402

DEVICE = torch.device(os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu"))
pytestmark = pytest.mark.skipif(not (dk.have_triton() and (DEVICE.type == "cuda"
                                                           or os.environ.get("TRITON_INTERPRET") == "1")),
                                reason="Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")

E, K, INTER, H, MAX_TOKENS = 12, 3, 40, 72, 8  # sizes the blocks (16, 32) do not divide
BLOCKS = dict(block_n=16, block_k=32)


def _weights(seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=gen) / 8).to(dtype)
    down = (torch.randn(E, H, INTER, generator=gen) / 8).to(dtype)
    return gate_up, down


def _tokens(seed: int, routes: list[list[int]], dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    b = len(routes)
    h = torch.randn(b, H, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(b, H, generator=gen).to(dtype).to(DEVICE)
    w = torch.softmax(torch.randn(b, K, generator=gen), -1).to(dtype).to(DEVICE)
    return h, x, w, torch.tensor(routes, device=DEVICE)


def _reference(h, w, ids, gate_up, down):
    """float64 SwiGLU experts, weighted and summed."""
    out = torch.zeros(h.shape[0], H, dtype=torch.float64)
    for b in range(h.shape[0]):
        for j, e in enumerate(ids[b].tolist()):
            gu = gate_up[e].cpu().double() @ h[b].cpu().double()
            a = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
            out[b] += float(w[b, j]) * (down[e].cpu().double() @ a)
    return out


ROUTES = [[1, 4, 7], [4, 1, 9], [2, 7, 4], [11, 0, 5], [4, 9, 1]]  # experts shared by up to four tokens


def test_each_token_gives_its_own_bits_in_any_batch():
    """Resident experts: the batch's rows are bitwise each token run alone (the same compiled kernels: one
    ``max_tokens``), whatever shares their experts, and other rows' values never reach a row."""
    gate_up, down = (t.to(DEVICE) for t in _weights(0))
    h, x, w, ids = _tokens(1, ROUTES)
    got = dk.moe_tokens(h, w, ids, gate_up, down, residual=x, max_tokens=MAX_TOKENS, **BLOCKS)
    for b in range(len(ROUTES)):
        alone = dk.moe_tokens(h[b:b + 1], w[b:b + 1], ids[b:b + 1], gate_up, down, residual=x[b:b + 1],
                              max_tokens=MAX_TOKENS, **BLOCKS)
        assert torch.equal(got[b:b + 1], alone), b
    torch.testing.assert_close(got.cpu().double() - x.cpu().double(), _reference(h, w, ids, gate_up, down),
                               rtol=1e-4, atol=1e-5)
    h2 = h.clone()
    h2[[0, 2, 3]] = torch.randn(3, H, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    again = dk.moe_tokens(h2, w, ids, gate_up, down, residual=x, max_tokens=MAX_TOKENS, **BLOCKS)
    assert torch.equal(again[[1, 4]], got[[1, 4]]) and not torch.equal(again[0], got[0])
    assert torch.equal(dk.moe_tokens(h, w, ids, gate_up, down, max_tokens=MAX_TOKENS, **BLOCKS) + x, got)
    with pytest.raises(ValueError, match="max_tokens"):
        dk.moe_tokens(h, w, ids, gate_up, down, max_tokens=4)


def _union_lookup(lru: OrderedDict, free: list[int], ids: list[int], slots: int):
    """The host's LRU over a batch's experts, each once (hits touched first, then misses in ascending order
    into free slots, lowest first, then the least recently used); a miss that finds every slot holding one of
    this batch's experts is left uncached. Returns ({expert: slot or None}, the experts that hit)."""
    union = sorted(set(ids))
    where = {e: lru[e] for e in union if e in lru}
    for e in where:
        lru.move_to_end(e)
    hit = set(where)
    for e in union:
        if e in where:
            continue
        if slots == E:  # a slot per expert: expert e in slot e
            where[e] = s = e
        elif free:
            where[e] = s = free.pop()
        elif len(lru) > 0 and next(iter(lru)) not in union:
            where[e] = s = lru.popitem(last=False)[1]
        else:
            where[e] = None
            continue
        lru[e] = s
    return where, hit


@pytest.mark.parametrize("bank", ["model", "fp8", "fp8-slots"])
@pytest.mark.parametrize("slots", [6, 9, E])
def test_a_batch_looks_its_experts_up_once_and_reads_its_misses_from_the_host(slots: int, bank: str):
    """Through the device-side slot table, step after step: each token's bits are the resident experts' (so
    alone's), the table ends as the host's LRU over each step's union, every cached slot holds exactly its
    expert's weights (a miss stored by the one program that read it), hits and misses counted per step and
    charged to the token of each expert's first pair; with 6 slots the 9-expert batches overflow and their last
    misses are read from the host without being cached. A bank in the compute dtype, an FP8 bank dequantized
    into the slots, and an FP8 bank whose slots keep its float8 values and row scales (dequantized as read)."""
    fp8 = bank != "model"
    from abbench.engine.models.bank import dequantize_into, quantize_rows

    gate_up, down = _weights(2)
    if fp8:
        (q_gu, s_gu), (q_dn, s_dn) = quantize_rows(gate_up), quantize_rows(down)
        gate_up, down = torch.empty_like(gate_up), torch.empty_like(down)
        dequantize_into(gate_up, q_gu, s_gu)
        dequantize_into(down, q_dn, s_dn)
        host = (q_gu, q_dn, s_gu, s_dn)
    else:
        host = (gate_up.clone(), down.clone())
    if DEVICE.type == "cuda":  # the kernels read host memory mapped into the device's address space
        host = tuple(t.pin_memory() for t in host)
    resident = (gate_up.to(DEVICE), down.to(DEVICE))
    table = DeviceSlotTable(1, E, slots, K, DEVICE)
    lru, free = OrderedDict(), list(range(slots - 1, -1, -1))
    table.push([lru], [free])
    if bank == "fp8-slots":
        gu = torch.zeros(slots, 2 * INTER, H, device=DEVICE).to(torch.float8_e4m3fn)
        dn = torch.zeros(slots, H, INTER, device=DEVICE).to(torch.float8_e4m3fn)
        scales = (torch.zeros(slots, 2 * INTER, device=DEVICE), torch.zeros(slots, H, device=DEVICE))
    else:
        gu = torch.zeros(slots, 2 * INTER, H, device=DEVICE)
        dn = torch.zeros(slots, H, INTER, device=DEVICE)
        scales = None
    counts = torch.zeros(dk.next_pow2(MAX_TOKENS), 2, dtype=torch.long, device=DEVICE)
    steps = [ROUTES, [[4, 1, 7]], [[0, 3, 6], [6, 3, 8], [10, 2, 0]], ROUTES[::-1], [[5, 8, 11], [9, 10, 6]]]
    hits = misses = 0
    for n, routes in enumerate(steps):
        h, x, w, ids = _tokens(10 + n, routes)
        table.tick.add_(1)
        counts.zero_()
        got = dk.moe_tokens(h, w, ids, gu, dn, residual=x, lookup=table.layer(0), host=host,
                            max_tokens=MAX_TOKENS, token_counts=counts, slot_scales=scales, **BLOCKS)
        want = dk.moe_tokens(h, w, ids, *resident, residual=x, max_tokens=MAX_TOKENS, **BLOCKS)
        assert torch.equal(got, want), n
        where, hit = _union_lookup(lru, free, sum(routes, []), slots)
        hits, misses = hits + len(hit), misses + len(where) - len(hit)
        pulled, _ = table.pull()
        assert list(pulled[0].items()) == list(lru.items()), n
        for e, s in lru.items():  # every cached expert's slot holds its weights
            if scales is None:
                assert torch.equal(gu[s].cpu(), gate_up[e]) and torch.equal(dn[s].cpu(), down[e]), (n, e)
            else:  # the bank's float8 bytes and row scales
                assert torch.equal(gu[s].cpu().view(torch.uint8), q_gu[e].view(torch.uint8)), (n, e)
                assert torch.equal(dn[s].cpu().view(torch.uint8), q_dn[e].view(torch.uint8)), (n, e)
                assert torch.equal(scales[0][s].cpu(), s_gu[e]) and torch.equal(scales[1][s].cpu(), s_dn[e])
        charged = [[0, 0] for _ in range(counts.shape[0])]
        for e in where:  # each expert charged to the first token routed to it
            b = next(b for b, r in enumerate(routes) if e in r)
            charged[b][0 if e in hit else 1] += 1
        assert counts.tolist() == charged, n
        if n == 0 and slots == 6:
            assert None in where.values()  # the batch really overflowed the slots
    assert table.take_counts() == (hits, misses)
