"""Decode prefetch (``EngineConfig.decode_prefetch``, ``decode_kernels.prefetch_experts``): each next layer's experts
guessed from the residual stream and brought into its slots ahead of its lookup.

- The kernel: the guessed experts a layer's slots lack get slots (the LRU's, at the step before's tick: never
  a slot the step before used) and the bank's bits in them (bf16, an FP8 bank dequantized into compute-dtype
  slots, an FP8 bank's values and scales into FP8 slots); the layer's own lookup then finds them as hits and
  its experts give the bits they give without the prefetch; what the lookup needs may evict what the prefetch
  placed; the counts say how many were already there and how many were copied.
- The engine: with the prefetch, every sequence decodes bitwise as without it, alone and in a batch, and the
  copies it made are charged (traffic, ``ExpertStore.prefetched``), not counted as lookups.
- Refusals: without offloaded experts whose misses the device handles.

The kernel and engine tests need Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``: slow, numpy); the
refusals run everywhere.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict

import pytest
import torch

from abbench.engine.config import PRESETS, EngineConfig
from abbench.engine.ops import kernels as dk
from abbench.engine.runtime.engine import Engine

DEVICE = os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu")
_TRITON = dk.have_triton() and (DEVICE.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1")
triton_only = pytest.mark.skipif(not _TRITON, reason="Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
VOCAB = 1024
# the compute dtype of the kernel tests: the interpreter rounds float32 to bfloat16 toward zero where compiled
# Triton and torch round to nearest even, so an FP8 bank's dequantized bits are compared in float32 there
CDT = torch.bfloat16 if DEVICE.startswith("cuda") else torch.float32


def _config(model: str = "tiny", **kw) -> EngineConfig:
    mc = dataclasses.replace(PRESETS[model], vocab_size=VOCAB, eos_token_id=VOCAB - 1, name=f"{model}-v{VOCAB}")
    knobs = dict(weights="random:0", chunk_tokens=64, max_context=256, bandwidth_probe_bytes=0, max_num_seqs=3,
                 device=DEVICE, prefill_mode="chunked", expert_slots_per_layer=mc.num_experts // 2)
    return EngineConfig(model=mc, **{**knobs, **kw})


@pytest.mark.parametrize("kw,why", [
    (dict(decode_misses="host"), "misses on the device"),
    (dict(prefill_mode="resident"), "misses on the device"),
])
def test_the_prefetch_is_refused_where_no_device_lookup_runs(kw, why):
    """Without a slot table the device looks up (the host's misses, resident experts, or no Triton experts:
    this machine without Triton), the engine refuses the flag and says what it needs."""
    extra = dict(decode_experts="triton", decode_attention="triton") if _TRITON else {}
    with pytest.raises(ValueError, match=why):
        Engine(_config(decode_prefetch=True, **{**extra, **kw}))
    engine = Engine(_config(**{**extra, **kw}))  # built without it: it cannot be turned on later
    with pytest.raises(ValueError, match="built without the prefetch"):
        engine.set_decode_prefetch(True)
    engine.set_decode_prefetch(False)


def _bank(e: int, inter: int, h: int, fp8: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gu, dn = torch.randn(e, 2 * inter, h, generator=gen) / 4, torch.randn(e, h, inter, generator=gen) / 4
    if not fp8:
        return (gu.to(CDT), dn.to(CDT)), None
    from abbench.engine.models.bank import quantize_rows

    (qg, sg), (qd, sd) = quantize_rows(gu), quantize_rows(dn)
    return (qg, qd, sg, sd), (gu, dn)


@triton_only
@pytest.mark.parametrize("fmt", ["bf16", "fp8-bank", "fp8-slots"])
def test_prefetched_experts_are_the_banks_bits_and_the_lookup_then_hits(fmt):
    """A 12-expert layer with 5 slots, top 3, two tokens. The step before used experts 0 and 1 (slots 0, 1), an
    older step 2 (slot 2); slots 3 and 4 are free. The prefetch of {1, 4, 7} (token 0) and {7, 9, 1} (token
    1): 1 is there; 4 and 7 take the free slots 3 and 4; 9 finds only slot 2 (older than the step before) and
    evicts expert 2; slots 0 and 1 (the step before's) are kept. Each copied slot holds the bank's bits; the
    counts: 1 already there, 3 copied, charged to the first token routed to each. Then the layer's own lookup
    of the same experts hits all four and its output equals the experts' without any prefetch (fetched by the
    kernels themselves)."""
    from abbench.engine.runtime.experts import DeviceSlotTable

    dev = torch.device(DEVICE)
    E, S, K, inter, H = 12, 5, 3, 16, 32
    host, _ = _bank(E, inter, H, fmt != "bf16")
    host = tuple(t.pin_memory() if dev.type == "cuda" else t for t in host)
    slot_fp8 = fmt == "fp8-slots"
    sdt = torch.float8_e4m3fn if slot_fp8 else CDT
    gate_up, down = torch.zeros(S, 2 * inter, H, dtype=sdt, device=dev), torch.zeros(S, H, inter, dtype=sdt,
                                                                                      device=dev)
    scales = (torch.ones(S, 2 * inter, device=dev), torch.ones(S, H, device=dev)) if slot_fp8 else None

    def bank_rows(e: int) -> tuple[torch.Tensor, torch.Tensor]:  # what a slot holding expert e must contain
        if fmt == "bf16":
            return host[0][e], host[1][e]
        if slot_fp8:
            return host[0][e], host[1][e]
        return ((host[0][e].float() * host[2][e][:, None]).to(CDT),
                (host[1][e].float() * host[3][e][:, None]).to(CDT))

    for e, s in ((0, 0), (1, 1), (2, 2)):  # experts already in slots
        gate_up[s], down[s] = bank_rows(e)
        if slot_fp8:
            scales[0][s], scales[1][s] = host[2][e], host[3][e]
    table = DeviceSlotTable(1, E, S, K, dev)
    lru = OrderedDict([(2, 2), (0, 0), (1, 1)])  # oldest first: 2 (an older step), then 0 and 1
    table.push([lru], [[4, 3]])
    table.tick.add_(1)  # the step before: it used 0 and 1
    table.stamp[0, 0], table.stamp[0, 1] = (table.tick * dk.STAMP_STEP).item(), (table.tick * dk.STAMP_STEP).item() + 1
    table.next_tick(prefetch=True)  # this step
    ids = torch.tensor([[1, 4, 7], [7, 9, 1]], device=dev)
    out = dk.PrefetchBuffers.empty(2, K, dev)
    counts = torch.zeros(2, 2, dtype=torch.long, device=dev)
    dk.prefetch_experts(ids, table.prefetch_layer(0), host, gate_up, down, out, max_tokens=2, token_counts=counts,
                        slot_scales=scales)
    slot_of = table.slot_of[0].tolist()
    assert {e: slot_of[e] for e in (0, 1, 4, 7, 9)} == {0: 0, 1: 1, 4: 3, 7: 4, 9: 2} and slot_of[2] == -1
    for e in (4, 7, 9):
        want_gu, want_dn = bank_rows(e)
        s = slot_of[e]
        assert torch.equal(gate_up[s].cpu().view(torch.uint8), want_gu.view(torch.uint8)), e
        assert torch.equal(down[s].cpu().view(torch.uint8), want_dn.view(torch.uint8)), e
        if slot_fp8:
            assert torch.equal(scales[0][s].cpu(), host[2][e]) and torch.equal(scales[1][s].cpu(), host[3][e])
    base = (table.tick.item() - 1) * dk.STAMP_STEP
    assert all(base <= table.stamp[0, slot_of[e]].item() < base + dk.STAMP_STEP for e in (1, 4, 7, 9))
    assert table.pf_counts.tolist() == [1, 3] and counts.tolist() == [[1, 2], [0, 1]]
    assert table.counts.tolist() == [0, 0]  # the lookups' own counts are untouched

    # the layer's own lookup now hits all four, and the experts give the bits of a step with no prefetch
    h = torch.randn(2, H, generator=torch.Generator().manual_seed(3)).to(CDT).to(dev)
    w = torch.softmax(torch.randn(2, K, generator=torch.Generator().manual_seed(4)), -1).to(CDT).to(dev)
    got = dk.moe_tokens(h, w, ids, gate_up, down, lookup=table.layer(0), host=host, slot_scales=scales)
    assert table.counts.tolist() == [4, 0]
    plain_gu, plain_dn = torch.zeros_like(gate_up), torch.zeros_like(down)
    plain_scales = None if scales is None else (torch.ones_like(scales[0]), torch.ones_like(scales[1]))
    cold = DeviceSlotTable(1, E, S, K, dev)
    cold.push([OrderedDict()], [[4, 3, 2, 1, 0]])
    cold.tick.add_(1)
    want = dk.moe_tokens(h, w, ids, plain_gu, plain_dn, lookup=cold.layer(0), host=host, slot_scales=plain_scales)
    assert cold.counts.tolist() == [0, 4]
    assert torch.equal(got, want)


@triton_only
def test_the_lookup_may_evict_what_the_prefetch_placed():
    """Two slots, top 2: the prefetch places 5 and 6 (a wrong guess); the lookup of 3 and 4 evicts both (they
    are older than this step's) and takes their slots."""
    from abbench.engine.runtime.experts import DeviceSlotTable

    dev = torch.device(DEVICE)
    E, S, K, inter, H = 8, 2, 2, 8, 16
    host, _ = _bank(E, inter, H, False)
    host = tuple(t.pin_memory() if dev.type == "cuda" else t for t in host)
    gate_up, down = (torch.zeros(S, 2 * inter, H, dtype=CDT, device=dev),
                     torch.zeros(S, H, inter, dtype=CDT, device=dev))
    table = DeviceSlotTable(1, E, S, K, dev)
    table.push([OrderedDict()], [[1, 0]])
    table.next_tick(prefetch=True)
    dk.prefetch_experts(torch.tensor([[5, 6]], device=dev), table.prefetch_layer(0), host, gate_up, down,
                        dk.PrefetchBuffers.empty(1, K, dev), max_tokens=1)
    assert table.slot_of[0, 5].item() >= 0 and table.slot_of[0, 6].item() >= 0
    h = torch.ones(1, H, dtype=CDT, device=dev)
    w = torch.full((1, K), 0.5, dtype=CDT, device=dev)
    dk.moe_tokens(h, w, torch.tensor([[3, 4]], device=dev), gate_up, down, lookup=table.layer(0), host=host)
    assert table.counts.tolist() == [0, 2]
    assert table.slot_of[0, 5].item() == table.slot_of[0, 6].item() == -1
    assert sorted(table.slot_of[0, [3, 4]].tolist()) == [0, 1]


@triton_only
@pytest.mark.parametrize("model", ["tiny", "qwen3.5-tiny"])
def test_an_engine_with_the_prefetch_decodes_bitwise_as_without_it(model):
    """Qwen3-MoE: three sequences through the scheduler (one batched step each decode step) on a tiny model
    whose 16 experts have 8 slots a layer: each sequence's ids and logprobs are those of the same engine without
    the prefetch; the prefetch copied experts in (some), the requests' decode traffic counts them (copies =
    lookup misses + the prefetch's), and the lookups still count only the routed experts. Then one sequence
    alone (whole steps): the same. The hybrid: one sequence alone (its batches run layer-outer, without the
    prefetch). Turned off between requests (``Engine.set_decode_prefetch``), the same engine copies nothing ahead and
    decodes the same ids."""
    from abbench.engine.contract import Finished, GenerateRequest

    kw = dict(decode_experts="triton", decode_attention="triton", decode_misses="device")
    with_pf, without = Engine(_config(model, decode_prefetch=True, **kw)), Engine(_config(model, **kw))
    assert with_pf.decoder.prefetch and not without.decoder.prefetch
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (40, 23, 31)]

    def run(engine: Engine, ps: list[list[int]]):
        engine.reset()
        engine.store.collect_decode_counts()
        outs: list[list] = [[] for _ in ps]
        for i, p in enumerate(ps):
            engine.scheduler.submit(engine.resolve(GenerateRequest(p, 5, ignore_eos=True, logprobs=3)), None,
                                    outs[i].append)
        while engine.scheduler.busy:
            engine.scheduler.step()
        engine.store.collect_decode_counts()
        toks = [[(e.token_id, e.logprob, e.top_logprobs) for e in o if not isinstance(e, (Finished, Exception))]
                for o in outs]
        stats = [next(e for e in o if isinstance(e, Finished)).stats for o in outs]
        return toks, stats

    for ps in (prompts, prompts[:1]) if model == "tiny" else (prompts[:1],):
        p0, m0 = with_pf.store.prefetched, with_pf.store.slot_lifetime.misses
        got, stats = run(with_pf, ps)
        want, _ = run(without, ps)
        assert got == want
        prefetched = with_pf.store.prefetched - p0
        misses = with_pf.store.slot_lifetime.misses - m0
        assert prefetched > 0
        decode_copies = sum(s.decode_h2d_bytes for s in stats) // with_pf.store.bank.expert_bytes
        assert decode_copies == misses + prefetched
        assert sum(s.slot_misses for s in stats) == misses
        assert sum(s.decode_prefetched for s in stats) == prefetched
    with_pf.set_decode_prefetch(False)  # turned off between requests (gpucheck_batch --decode-prefetch both)
    p0 = with_pf.store.prefetched
    got, stats = run(with_pf, prompts[:1])
    assert got == run(without, prompts[:1])[0] and with_pf.store.prefetched == p0
    assert all(s.decode_prefetched == 0 for s in stats)
    with_pf.set_decode_prefetch(True)


def test_the_guess_check_runs_on_cpu_and_guesses_better_than_chance(tmp_path):
    """``predict_check`` on the tiny presets' first layers, through the engine's own prefill and the models' own
    ``predict_experts``: every share in [0, 1], one row per layer (the first without a guess), and the guess from
    one layer ahead names far more of a token's experts than chance, for Qwen3-MoE and the hybrid; Qwen4-Exp's
    first layers are refused with the reason."""
    import json

    from abbench.engine.tools.predict_check import main

    out = tmp_path / "guess.json"
    assert main(["--model", "tiny", "--layers", "3", "--tokens", "48", "--batch", "4", "--dtype", "float32",
                 "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["layer"] for r in rep["per_layer"]] == [0, 1, 2] and "guessed" not in rep["per_layer"][0]
    assert all(0 <= r[key] <= 1 for r in rep["per_layer"] for key in ("previous_token", "guessed",
                                                                         "batch_union_guessed") if key in r)
    assert rep["chance"] == 4 / 16 and rep["guessed_mean"] > 2 * rep["chance"]
    hybrid = tmp_path / "hybrid.json"
    assert main(["--model", "qwen3.5-tiny", "--layers", "4", "--tokens", "64", "--batch", "4", "--dtype", "float32",
                 "--out", str(hybrid)]) == 0
    rep = json.loads(hybrid.read_text())
    assert [r["kind"] for r in rep["per_layer"]][-1] == "full_attention"
    assert rep["guessed_mean"] > 2 * rep["chance"]
    with pytest.raises(SystemExit, match="predict_check: qwen4-exp-tiny"):
        main(["--model", "qwen4-exp-tiny", "--layers", "2", "--tokens", "16"])
