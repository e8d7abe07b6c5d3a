"""Decode through the per-layer slot cache at shapes where CUDA's limits bite, and memory budgeting.

Set ABBENCH_ENGINE_TEST_DEVICE=cuda to run them on a GPU (bfloat16, CUDA graphs), where the limit is real.
The model here has 512 experts per layer (top-4) and tiny hidden sizes: 3 layers x 512 slots = 1,536 slots,
more than CUDA's grouped GEMM takes (1,023 groups). A spy on ``torch._grouped_mm`` records every call's group
count, so the class of bug that failed every offloaded request on the H200 fails here, on CPU.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from abbench.engine import Engine, EngineConfig
from abbench.engine.config import MAX_GROUPED_MM_GROUPS, PRESETS, ModelConfig
from abbench.engine.runtime.memory import GIB, RUNTIME_RESERVE_BYTES, dense_params, plan_device_memory
from abbench.engine.runtime.decode import kv_buckets, kv_len_for
from abbench.engine.models.bank import (
    HEADROOM_FLOOR, check_host_memory, host_memory_available, host_memory_headroom,
)
from abbench.engine.ops.moe import TooManyGroups, grouped_mm

WIDE = ModelConfig(vocab_size=512, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=512,
                   num_experts_per_tok=4, max_position_embeddings=4096, name="wide-512")
KNOBS = dict(model=WIDE, weights="random:3", chunk_tokens=16, layer_major_window_tokens=64,
             bandwidth_probe_bytes=0, max_context=512,
             device=os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu"))  # cuda: the same tests on a GPU


@pytest.fixture
def group_spy(monkeypatch):
    """Records the group count of every torch._grouped_mm call (the B operand's first dimension)."""
    seen: list[int] = []
    real = torch._grouped_mm

    def spy(a, b, *args, **kwargs):
        seen.append(int(b.shape[0]))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    return seen


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, WIDE.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode_ids(engine: Engine, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    out = []
    for p in prompts:
        engine.reset()
        events, stats = engine.run(p, max_tokens, ignore_eos=True)
        assert stats.completion_tokens == max_tokens
        out.append([e.token_id for e in events])
    return out


@pytest.fixture(scope="module")
def resident_ids():
    engine = Engine(EngineConfig(**KNOBS, prefill_mode="resident"))
    prompts = [_prompt(n, seed) for n, seed in ((5, 1), (37, 2), (64, 3))]
    return prompts, _decode_ids(engine, prompts)


def test_grouped_gemm_refuses_more_groups_than_cuda_takes_on_every_device():
    x = torch.randn(4, 8)
    offs = torch.full((MAX_GROUPED_MM_GROUPS + 1,), 4, dtype=torch.int32)
    with pytest.raises(TooManyGroups, match="1024 groups > 1023"):
        grouped_mm(x, torch.randn(MAX_GROUPED_MM_GROUPS + 1, 2, 8), offs)
    with pytest.raises(ValueError, match="num_experts 1024 per layer > 1023"):
        EngineConfig(model=dataclasses.replace(WIDE, num_experts=1024), weights="random:0").resolved()


@pytest.mark.parametrize("slots", [4, 9, 128, 512])
def test_offloaded_decode_equals_resident_decode_at_every_slot_budget(resident_ids, group_spy, slots):
    """From one token's experts per layer (4) to every expert (512; 1,536 slots in all): same ids as resident
    decode, bit for bit, and no grouped call ever sees more than one layer's experts."""
    prompts, want = resident_ids
    group_spy.clear()  # from the engine's start on: on CUDA its decode warm-up captures the slot-block calls
    engine = Engine(EngineConfig(**KNOBS, prefill_mode="chunked", expert_slots_per_layer=slots))
    assert engine.slots_per_layer == slots and engine.store.slots.capacity == 3 * slots
    assert _decode_ids(engine, prompts) == want
    assert group_spy and max(group_spy) <= WIDE.num_experts <= MAX_GROUPED_MM_GROUPS
    if engine.decoder.kernels.startswith("experts=grouped"):  # on CUDA auto decodes through Triton's GEMV
        assert slots in group_spy  # decode's grouped calls run over one layer's slot block


def test_slot_cache_counts_hits_and_misses_and_goes_whole_step_when_complete():
    """With a slot for every expert, once every expert of every layer has been loaded no step can miss:
    decode runs whole steps (no router read-back) and gives the same ids as before."""
    small = dataclasses.replace(WIDE, num_experts=8, name="wide-8")
    engine = Engine(EngineConfig(**{**KNOBS, "model": small}, prefill_mode="chunked"))
    assert engine.slots_per_layer == 8  # CPU without a budget: every expert
    p = _prompt(20, seed=4)
    _, first = engine.run(p, 40, ignore_eos=True)
    assert first.slot_misses > 0 and first.slot_hits > 0
    assert first.slot_hits + first.slot_misses == first.decode_steps_per_layer * 3 * 4 or first.decode_steps_whole
    assert first.decode_h2d_bytes == first.slot_misses * engine.store.bank.expert_bytes
    for layer in range(3):  # fill every slot, then nothing can miss
        engine.store.decode_experts(layer, list(range(8)))
    assert engine.store.slots.complete
    engine._kv_tokens = []
    events, again = engine.run(p, 40, ignore_eos=True)
    assert again.decode_steps_per_layer == 0 and again.decode_steps_whole == 39 and again.slot_misses == 0
    engine2 = Engine(EngineConfig(**{**KNOBS, "model": small}, prefill_mode="resident"))
    ref, _ = engine2.run(p, 40, ignore_eos=True)
    assert [e.token_id for e in events] == [e.token_id for e in ref]


def test_budgets_size_the_slot_cache_and_give_identical_ids(resident_ids):
    prompts, want = resident_ids
    base = EngineConfig(**KNOBS, prefill_mode="chunked", max_num_seqs=1).resolved()  # a budget plans one
    fixed = plan_device_memory(base, 10**12).fixed_bytes
    slot = plan_device_memory(base, 10**12).slot_bytes
    sizes = []
    for n in (4, 50, 512, 600):
        budget_gib = (fixed + n * slot) / 2**30
        engine = Engine(EngineConfig(**KNOBS, prefill_mode="chunked", gpu_memory_budget_gib=budget_gib))
        sizes.append(engine.slots_per_layer)
        assert _decode_ids(engine, prompts[:1]) == want[:1]
    assert sizes == [4, 50, 512, 512]  # at most every expert


def test_memory_plan_adds_up_and_refuses_with_every_term_named():
    cfg = EngineConfig(model="qwen3-30b-a3b-2507", device="cuda", max_context=131_072 + 512,
                       max_num_seqs=1).resolved()
    plan = plan_device_memory(cfg, 24 * GIB)
    mc = cfg.model
    assert plan.dense_bytes == dense_params(mc) * 2
    assert plan.kv_bytes == 2 * 48 * 4 * (131_072 + 512) * 128 * 2  # 12.9 GB of bf16 keys and values
    assert plan.prefill_buffer_bytes == 2 * 128 * 3 * 2048 * 768 * 2  # two layer banks
    assert plan.reserve_bytes == RUNTIME_RESERVE_BYTES == 2 * GIB
    assert plan.slot_bytes == 48 * 3 * 2048 * 768 * 2
    assert 8 <= plan.slots_per_layer < 128 and plan.total_bytes <= 24 * GIB
    assert plan.total_bytes + plan.slot_bytes > 24 * GIB  # one more slot per layer would not fit
    with pytest.raises(ValueError) as e:
        plan_device_memory(cfg, 16 * GIB)
    msg = str(e.value)
    for term in ("dense", "KV 12.05 GiB", "prefill buffers", "workspace", "--gpu-memory-budget to at least", "8"):
        assert term in msg
    resident = EngineConfig(model="qwen3-30b-a3b", device="cuda", prefill_mode="resident", max_num_seqs=1).resolved()
    with pytest.raises(ValueError, match="resident experts do not fit"):
        plan_device_memory(resident, 24 * GIB)
    assert plan_device_memory(resident, 80 * GIB).resident_bytes == PRESETS["qwen3-30b-a3b"].bank_bytes(2)


def test_explicit_expert_slots_beyond_the_budget_are_refused():
    """--expert-slots-per-layer asks for a number of slots: as many as the budget holds are kept as asked (the
    plan within its budget); one more is refused, naming what the budget holds, not silently over budget."""
    def cfg(slots: int | None) -> EngineConfig:
        return EngineConfig(model="qwen3-30b-a3b-2507", device="cuda", max_context=131_072 + 512,
                            expert_slots_per_layer=slots, max_num_seqs=1).resolved()

    budget = 24 * GIB  # --gpu-memory-budget 24: GiB
    fit = plan_device_memory(cfg(None), budget).slots_per_layer  # what the budget holds (below num_experts)
    plan = plan_device_memory(cfg(fit), budget)
    assert plan.slots_per_layer == fit and plan.total_bytes <= budget
    with pytest.raises(ValueError, match=f"holds {fit} expert slots per layer but decode needs {fit + 1} "
                                         r"\(num_experts_per_tok=8, as requested\)"):
        plan_device_memory(cfg(fit + 1), budget)


def test_engine_refuses_a_budget_below_one_tokens_experts():
    with pytest.raises(ValueError, match="holds 0 expert slots per layer but decode needs 4"):
        Engine(EngineConfig(**KNOBS, gpu_memory_budget_gib=0.001))


def test_host_memory_check_refuses_a_bank_that_does_not_fit():
    available = host_memory_available()
    assert available is None or available > 0
    with pytest.raises(ValueError, match=r"needs 58.00 GB of host memory .* but 24.00 GB is available"):
        check_host_memory(58 * 10**9, 24 * 10**9)
    check_host_memory(10**9, 24 * 10**9)  # fits
    check_host_memory(10**15, None)  # unknown: nothing to check against


def test_host_memory_headroom_scales_with_what_the_engine_allocates():
    """The headroom is the dense weights plus a twentieth of the bank, at least 256 MiB: a tiny engine's bank fits
    where a fixed 2 GiB headroom refused it (0.01 GB with 1.72 GB free), every tiny preset starts with 1 GB free,
    and a large bank still gets gigabytes of room."""
    assert host_memory_headroom(10**7) == HEADROOM_FLOOR == 256 * 2**20
    assert host_memory_headroom(100 * 10**9, 3 * 10**9) == 8 * 10**9
    assert host_memory_headroom(10**9, 10**9) == 10**9 + 5 * 10**7
    check_host_memory(10**7, int(1.72e9), dense_bytes=156 * 10**6)  # refused before with 2 GiB of headroom
    for name in ("tiny", "qwen3.5-tiny", "qwen4-exp-tiny"):
        mc = PRESETS[name]
        check_host_memory(mc.bank_bytes(4), 10**9, dense_bytes=dense_params(mc) * 4)  # float32 on CPU
    with pytest.raises(ValueError, match=r"needs 0.50 GB .*\+0.62 GB headroom.* but 1.00 GB is available"):
        check_host_memory(5 * 10**8, 10**9, dense_bytes=6 * 10**8)  # the dense weights count
    with pytest.raises(ValueError, match=r"\+2.90 GB headroom"):
        check_host_memory(58 * 10**9, 60 * 10**9)
    check_host_memory(58 * 10**9, 61 * 10**9)


def test_kv_len_is_a_power_of_two_cover_capped_at_the_cache():
    assert [kv_len_for(p, 40960) for p in (0, 1023, 1024, 4100, 40959)] == [1024, 1024, 2048, 8192, 40960]
    assert kv_len_for(10, 512) == 512


def test_kv_buckets_are_every_length_a_step_can_use():
    assert kv_buckets(131200) == [1024 * 2**i for i in range(8)] + [131200]
    assert kv_buckets(4096) == [1024, 2048, 4096] and kv_buckets(512) == [512]
    for n in (512, 1000, 3000, 131200):
        assert kv_buckets(n) == sorted({kv_len_for(p, n) for p in range(n)})


@pytest.mark.parametrize("preset", ["tiny", "qwen3.5-tiny", "qwen4-exp-tiny"])
def test_decode_warmup_leaves_no_trace(preset):
    """The start-up decode warm-up (on CUDA with graphs: every KV-length bucket captured before any request)
    runs two steps at the end of every bucket, then leaves nothing behind: an engine that ran it answers
    bitwise like one that did not (ids, logprobs, slot hits and misses, no prefix-cache hit), with its traffic
    and step counts at zero. Offloaded decode (slots below the experts: the per-layer path) and the hybrids'
    states and token history included."""
    cfg = EngineConfig(model=preset, weights="random:0", chunk_tokens=64, layer_major_window_tokens=128,
                       bandwidth_probe_bytes=0, max_context=2100,
                       expert_slots_per_layer=PRESETS[preset].num_experts_per_tok + 2,
                       warm_decode_graphs=False, device=KNOBS["device"])
    fresh, warmed = Engine(cfg), Engine(cfg)
    positions: list[int] = []
    real_step = warmed.decoder.step
    warmed.decoder.step = lambda token, pos, cancel=None, misses=None, cache=0: (
        positions.append((cache, pos)), real_step(token, pos, cancel, misses, cache))[1]
    warmed._warm_decode()
    del warmed.decoder.step
    caches = range(warmed.config.max_num_seqs)  # every sequence cache's graphs, the engine's way of misses only
    assert positions == [(c, p) for c in caches for p in (1023, 2047, 2099) for _ in range(2)]
    assert warmed.decode_warmup["kv_buckets"] == [1024, 2048, 2100]
    if warmed.decoder.table is not None:  # CUDA: a server whose requests may choose warms both ways
        both, ways = Engine(dataclasses.replace(cfg, warm_every_misses_way=True)), []
        both_step = both.decoder.step
        both.decoder.step = lambda token, pos, cancel=None, misses=None, cache=0: (
            ways.append(misses), both_step(token, pos, cancel, misses, cache))[1]
        both._warm_decode()
        del both.decoder.step
        assert set(ways) == {"host", "device"} and set(ways[:2]) == {warmed.decoder.misses}
    assert warmed.decoder.steps == {"whole": 0, "per_layer": 0, "batched": 0} and warmed.store.lifetime.h2d_bytes == 0
    assert not any(warmed.store.slots.lru)  # the throwaway steps' experts are gone from the slot cache
    prompt = torch.randint(0, 400, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    for mode in ("chunked", "layer-major"):
        a_events, a = fresh.run(prompt, 6, ignore_eos=True, logprobs=3, prefill_mode=mode)
        b_events, b = warmed.run(prompt, 6, ignore_eos=True, logprobs=3, prefill_mode=mode)
        assert [(e.token_id, e.top_logprobs) for e in a_events] == [(e.token_id, e.top_logprobs) for e in b_events]
        assert (a.slot_hits, a.slot_misses, a.cached_prompt_tokens) == (b.slot_hits, b.slot_misses,
                                                                        b.cached_prompt_tokens)
        fresh.reset()
        warmed.reset()


def test_decode_gqa_equals_repeated_kv_attention_with_the_mask():
    """decode_gqa reads each KV head for its query group in place; the same numbers as attention over
    K and V repeated to every query head (transformers' repeat_kv) with the hidden positions masked."""
    from abbench.engine.ops.dense import decode_gqa

    g = torch.Generator().manual_seed(0)
    hq, hkv, d, L, pos = 8, 2, 16, 64, 37
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((hq, 1, d), (hkv, L, d), (hkv, L, d)))
    hidden = torch.arange(L) > pos
    got = decode_gqa(q, k, v, hidden, d ** -0.5)  # [Hq, 1, D]
    kr, vr = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)  # [Hq, L, D]
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=~hidden, scale=d ** -0.5)
    assert got.shape == (hq, 1, d)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)  # float32 softmax
    # a hidden position's key and value do not matter
    k2, v2 = k.clone(), v.clone()
    k2[:, pos + 1:] = 1e3
    v2[:, pos + 1:] = -1e3
    assert torch.equal(decode_gqa(q, k2, v2, hidden, d ** -0.5), got)


@pytest.mark.parametrize("preset", ["tiny", "qwen3.5-tiny", "qwen4-exp-tiny"])
def test_decode_never_calls_sdpa(preset, monkeypatch):
    """Decode steps of every model family attend through decode_gqa: SDPA with a mask and grouped-query
    heads falls back on CUDA to its math kernel, which expands K/V to every query head in float32 (measured
    on the H200 with the Qwen3.5 shape: ~52 KB of temporaries per cached position, 6.4 GiB at a 128K KV
    length, and long-context decode several times slower)."""
    import torch.nn.functional as F

    from abbench.engine.runtime import decode as decode_mod

    eng = Engine(EngineConfig(model=preset, weights="random:0", chunk_tokens=64, layer_major_window_tokens=128,
                              bandwidth_probe_bytes=0, max_context=512, device=KNOBS["device"]))
    prompt = torch.randint(0, 400, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    calls, steps = [], []
    real_sdpa, real_step = F.scaled_dot_product_attention, decode_mod.Decoder.step_batch

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real_sdpa(*args, **kwargs)

    def step(self, *a, **kw):  # SDPA is swapped only inside decode steps (prefill's causal bias dispatches on it)
        steps.append(1)
        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
        try:
            return real_step(self, *a, **kw)
        finally:
            monkeypatch.setattr(F, "scaled_dot_product_attention", real_sdpa)

    monkeypatch.setattr(decode_mod.Decoder, "step_batch", step)  # the scheduler's steps, solo ones too
    events, _ = eng.run(prompt, 4, ignore_eos=True)
    assert len(events) == 4 and len(steps) == 3  # the first token comes from prefill
    assert calls == []


def test_the_server_warms_both_ways_of_misses_only_where_requests_may_choose_one():
    """``--allow-request-overrides`` (a request may ask ``decode_misses``) makes the decode warm-up capture both
    ways' graphs; without it only the engine's own way is warmed (the other is unreachable). ``--no-warm-prefill``
    turns the start-up prefill off."""
    from abbench.engine.serve import launch

    parse = launch.build_arg_parser().parse_args
    assert launch._engine_config(parse(["--device", "cpu"])).warm_every_misses_way is False
    assert launch._engine_config(parse(["--device", "cpu", "--allow-request-overrides"])).warm_every_misses_way
    assert launch._engine_config(parse(["--device", "cpu"])).warm_prefill is None  # the default: on CUDA only
    assert launch._engine_config(parse(["--device", "cpu", "--no-warm-prefill"])).warm_prefill is False


def test_slots_share_the_buffers_where_a_budget_leaves_too_few_beside_them():
    """Qwen3.5/3.6 at 262,144 tokens under 16 GiB: beside the two prefill buffers the budget holds 1 slot a
    layer where decode needs 8, so "auto" puts the slots in the buffers' memory (the larger of the two counted
    once) and the plan fits; "off" refuses, naming the budget sharing would need; a budget that holds the slots
    beside the buffers, or more than one sequence, keeps them apart."""
    def cfg(**kw) -> EngineConfig:
        return EngineConfig(**{"model": "qwen3.5-35b-a3b", "device": "cuda", "max_context": 262_144,
                               "layer_major_window_tokens": 65_536, "max_num_seqs": 1, **kw}).resolved()

    plan = plan_device_memory(cfg(), 16 * GIB)
    apart = plan_device_memory(cfg(), 10**12)
    assert plan.slots_share_buffers and plan.slots_per_layer >= 8 and plan.total_bytes <= 16 * GIB
    assert plan.fixed_bytes == apart.fixed_bytes - apart.prefill_buffer_bytes
    assert plan.total_bytes == plan.fixed_bytes + max(plan.slots_per_layer * plan.slot_bytes,
                                                      plan.prefill_buffer_bytes)
    assert plan.total_bytes + plan.slot_bytes > 16 * GIB  # one more slot a layer would not fit
    assert "in one allocation" in plan.describe() and "prefill buffers 3.00 GiB +" not in plan.describe()
    with pytest.raises(ValueError, match="holds 1 expert slots per layer but decode needs 8") as e:
        plan_device_memory(cfg(slots_share_buffers="off"), 16 * GIB)
    assert f"at least {(apart.fixed_bytes + 8 * apart.slot_bytes) / GIB:.2f} GiB," in str(e.value)
    with pytest.raises(ValueError, match=f"at least {(plan.fixed_bytes + plan.prefill_buffer_bytes) / GIB:.2f} "
                                         r"GiB \(the slots in the prefill buffers' memory\)"):
        plan_device_memory(cfg(), 15 * GIB)  # too small either way: the least is shared's
    assert not plan_device_memory(cfg(), 24 * GIB).slots_share_buffers  # 24 GiB holds them apart
    assert plan_device_memory(cfg(slots_share_buffers="on"), 24 * GIB).slots_share_buffers
    with pytest.raises(ValueError, match="holds 0 expert slots"):  # two caches: no sharing, and no room
        plan_device_memory(cfg(max_num_seqs=2), 16 * GIB)
    for bad, why in ((dict(max_num_seqs=2), "max_num_seqs 1, got 2"), (dict(prefill_mode="resident"), "streamed"),
                     (dict(d2d_from_slot_cache=True), "d2d_from_slot_cache")):
        with pytest.raises(ValueError, match=why):
            cfg(slots_share_buffers="on", **bad)


def test_a_budget_that_leaves_too_few_slots_beside_the_buffers_puts_them_in_their_memory(resident_ids):
    """The path a user with a small card runs: ``--gpu-memory-budget`` alone (slots_share_buffers "auto"). A
    budget that holds the two layer buffers (1,024 of this model's experts) and nothing beside them leaves 0 slots
    apart and 341 (1,024 / 3 layers) in the buffers' memory; the engine plans that, and requests in a row (no
    reset between them) decode the resident engine's ids."""
    prompts, want = resident_ids
    base = EngineConfig(**KNOBS, prefill_mode="chunked", max_num_seqs=1).resolved()
    apart = plan_device_memory(base, 10**12)
    budget = apart.fixed_bytes + apart.slot_bytes // 2  # the buffers and everything else, half a slot beside
    with pytest.raises(ValueError, match="holds 0 expert slots"):
        plan_device_memory(dataclasses.replace(base, slots_share_buffers="off"), budget)
    engine = Engine(EngineConfig(**KNOBS, prefill_mode="chunked", gpu_memory_budget_gib=budget / GIB))
    plan = engine.memory_plan
    assert plan.slots_share_buffers and engine.slots_per_layer == 2 * WIDE.num_experts // 3
    assert plan.total_bytes <= budget
    engine.reset()
    got = []
    for p in prompts:
        events, stats = engine.run(p, 12, ignore_eos=True)
        got.append([e.token_id for e in events])
    assert got == want and engine.store.slot_flushes == len(prompts) - 1
