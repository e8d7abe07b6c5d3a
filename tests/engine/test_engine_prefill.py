"""The vendored engine's prefill modes, byte accounting, prefix cache, slot cache and cancellation.

What users of the engine rely on: chunked, layer-major, demand and resident prefill give bitwise-identical
logits, KV and tokens on one device (so an A/B of prefill modes measures speed only); the H2D byte counters
say how many banks crossed PCIe; the optimised modes say when they fell back; a cancelled request stops at
once and leaves the engine correct for the next one.

Everything runs with a small random model (3 layers, 16 experts top-2) and 32-token chunks, on CPU; set
ABBENCH_ENGINE_TEST_DEVICE=cuda to run the same assertions on a GPU (bfloat16 there).
"""

from __future__ import annotations

import os
import threading

import pytest

torch = pytest.importorskip("torch")

from abbench.engine import PRESETS, EngineConfig, ModelConfig  # noqa: E402
from abbench.engine.runtime.prefill import plan_chunks, prefill  # noqa: E402
from abbench.engine.runtime.steps import LayerSteps  # noqa: E402
from abbench.engine.contract import Cancelled, GenerateRequest  # noqa: E402
from abbench.engine.runtime.engine import Engine  # noqa: E402
from abbench.engine.ops.moe import Fp8Experts  # noqa: E402

MINI = ModelConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=2,
                   max_position_embeddings=4096, eos_token_id=None, name="mini")
MODES = ("chunked", "layer-major", "demand", "resident")
KNOBS = dict(chunk_tokens=32, layer_major_window_tokens=64, demand_max_tokens=32, max_context=512,
             bandwidth_probe_bytes=0, device=os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu"))


def _engine(**overrides) -> Engine:
    return Engine(EngineConfig(**{"model": MINI, "weights": "random:1", **KNOBS, **overrides}))


@pytest.fixture(scope="module")
def resident():
    """Started resident, so it can also run every streamed mode per request (its bank stays in host memory)."""
    return _engine(prefill_mode="resident")


@pytest.fixture(scope="module")
def streamed():
    """Started chunked with the smallest legal slot cache (top_k experts): decode evicts constantly."""
    return _engine(expert_slots_per_layer=MINI.num_experts_per_tok)


def _prompt(n: int, seed: int = 0, lo: int = 0) -> list[int]:
    return torch.randint(lo, MINI.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kv(engine: Engine, n: int) -> list[torch.Tensor]:
    return [t[:, :n].clone() for t in engine.kv.k + engine.kv.v]


def _raw_prefill(engine: Engine, ids: list[int], mode: str):
    """One fresh prefill through the module API: (logits, stats, KV of every layer)."""
    engine.reset()  # the prefix cache must not claim KV that this call overwrites
    engine.store.begin_request()
    logits, stats = prefill(engine.model, engine.store, engine.kv, torch.tensor(ids, device=engine.device), 0, mode,
                            chunk_tokens=engine.config.chunk_tokens,
                            window_tokens=engine.config.layer_major_window_tokens,
                            demand_max_tokens=engine.config.demand_max_tokens)
    out = (logits.clone(), stats, _kv(engine, len(ids)))
    engine.reset()
    return out


@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 64, 95, 150])
def test_all_modes_give_bitwise_identical_logits_and_kv(resident, n):
    ids = _prompt(n, seed=n)
    ref_logits, ref_stats, ref_kv = _raw_prefill(resident, ids, "chunked")
    assert ref_stats.n_chunks == -(-n // 32)
    for mode in MODES[1:]:
        logits, stats, kv = _raw_prefill(resident, ids, mode)
        assert torch.equal(logits, ref_logits), mode
        assert all(torch.equal(a, b) for a, b in zip(kv, ref_kv, strict=True)), mode
        if mode == "layer-major" and n <= 32:
            assert stats.path == "chunked" and "one chunk" in stats.fallback_reason
        else:
            assert (stats.path, stats.fallback_reason) == (mode, None)
    if n == 150:  # 5 chunks, 2 per 64-token window: 3 windows
        assert _raw_prefill(resident, ids, "layer-major")[1].n_windows == 3


def _triton_runs_here() -> bool:
    from abbench.engine.ops import kernels

    return kernels.have_triton() and (KNOBS["device"] == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.skipif(not _triton_runs_here(), reason="Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
def test_prefill_kernels_triton_keep_every_mode_bitwise_and_stay_near_torchs(resident):
    """``prefill_kernels`` "triton" (decode's fused kernels for the attention half's norms, rope, cache write and
    router top-k): every mode still gives the same bits (logits and every layer's KV, the last layer's written by
    ``cache_only`` for the chunks before the last), within float rounding of the torch ops', and the same greedy
    tokens end to end, decode included."""
    fused = _engine(prefill_mode="resident", prefill_kernels="triton")
    assert fused.model.prefill_kernel == "triton"
    ids = _prompt(80, seed=5)  # 3 chunks (the last short), 2 layer-major windows
    ref_logits, _, ref_kv = _raw_prefill(fused, ids, "chunked")
    for mode in ("layer-major", "demand", "resident"):
        logits, stats, kv = _raw_prefill(fused, ids, mode)
        assert stats.path == mode
        assert torch.equal(logits, ref_logits) and all(torch.equal(a, b) for a, b in zip(kv, ref_kv)), mode
    steps = LayerSteps(fused.model)  # every step whole: the last layer's cache written by attention, not cache_only
    for a, b in plan_chunks(0, len(ids), 32):
        x = fused.model.embed(torch.tensor(ids[a:b], device=fused.device))
        for layer in range(MINI.num_hidden_layers):
            steps.layer(layer, x, fused.kv, a, *fused.store.resident[layer])
    assert torch.equal(fused.model.logits(x[-1:]), ref_logits)
    assert all(torch.equal(a, b) for a, b in zip(_kv(fused, len(ids)), ref_kv))
    fused.reset()
    torch_logits, _, torch_kv = _raw_prefill(resident, ids, "chunked")
    # bfloat16 (CUDA): the fused kernels round once where torch's ops round at each step; on an H100 the logits
    # differed by up to 0.026 (hybrid) and 0.033 (Qwen3-MoE) of a few units (results/20261206i)
    tol = dict(rtol=2e-2, atol=5e-2) if fused.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref_logits, torch_logits, **tol)
    for a, b in zip(ref_kv, torch_kv):
        torch.testing.assert_close(a, b, **tol)
    fused_ids = [e.token_id for e in fused.run(ids, 4)[0]]
    assert fused_ids == [e.token_id for e in resident.run(ids, 4)[0]]
    resident.reset()


def test_prefill_kernels_are_refused_where_they_do_not_apply():
    """Triton's prefill kernels are Qwen3-MoE's and the hybrid's: Qwen4-Exp is refused by name, and without Triton
    (the CPU build of torch) so is Qwen3-MoE, each with the reason."""
    from abbench.engine.ops import kernels

    with pytest.raises(ValueError, match="Qwen3.5/3.6 hybrid; qwen4-exp-tiny norms and routes its own way"):
        Engine(EngineConfig(model="qwen4-exp-tiny", weights="random:0", device=KNOBS["device"],
                            prefill_kernels="triton"))
    with pytest.raises(ValueError, match="prefill_kernels must be one of"):
        EngineConfig(model=MINI, prefill_kernels="fused")
    if not kernels.have_triton():
        with pytest.raises(ValueError, match="prefill_kernels 'triton' needs Triton"):
            _engine(prefill_kernels="triton")


def test_qwen3_moe_prefill_runs_eagerly_on_every_device(resident):
    """Qwen3-MoE replays no prefill step from CUDA graphs (``ModelConfig.prefill_graph_moe``: measured on the H200,
    results/20261205k): the engine says so, on CUDA as on CPU, and its steps hold no graph cache."""
    assert not MINI.prefill_graph_moe
    assert resident.prefill_graphs_mode == "eager" and resident.steps.graphs is None


def test_only_a_prompts_last_chunk_runs_the_last_layers_moe_half(resident):
    """Nothing reads the last layer's output of a chunk that is not its prompt's last (the cache is written in
    the first half), so every mode leaves those MoE halves out: the logits and KV of running every step whole,
    bit for bit, with ``moe_skipped`` = chunks - 1. Layer-major runs a window's last first halves before asking
    for that layer's bank."""
    steps, dev, n_layers = LayerSteps(resident.model), resident.device, MINI.num_hidden_layers
    for n in (128, 150):  # 4 and 5 chunks of 32 tokens; 64-token windows
        ids = _prompt(n, seed=20 + n)
        resident.reset()
        for a, b in plan_chunks(0, n, 32):  # every step whole, through the module API
            x = resident.model.embed(torch.tensor(ids[a:b], device=dev))
            for layer in range(n_layers):
                steps.layer(layer, x, resident.kv, a, *resident.store.resident[layer])
        full_logits, full_kv = resident.model.logits(x[-1:]).clone(), _kv(resident, n)
        for mode in MODES:
            logits, stats, kv = _raw_prefill(resident, ids, mode)
            assert torch.equal(logits, full_logits), (n, mode)
            assert all(torch.equal(a, b) for a, b in zip(kv, full_kv, strict=True)), (n, mode)
            assert stats.moe_skipped == stats.n_chunks - 1, (n, mode)
    resident.reset()


def test_streaming_adds_host_work_per_layer_never_per_chunk(resident):
    """What each chunk of a prompt asks of the host is the same in layer-major as in resident: the torch calls
    per added chunk are equal, so the streaming loop's own work (bank copies, parked activations, the copy
    stream's events) is per prompt or per layer, never per chunk and layer. A prefill paced by the host's
    launches (Qwen3-MoE's eager prefill on the H200, docs/fp8.md) would otherwise pay it once per chunk step.
    Chunked, which copies a bank per chunk and layer, shows that the count sees such work."""
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):  # the torch calls made from Python, not reads of a tensor's attributes
        n = 0  # (.shape, .device: no work); a dispatch mode cannot hold the tensor subclass of CUDA's attention

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Calls.n += getattr(func, "__name__", "") != "__get__"
            return func(*args, **(kwargs or {}))

    def calls(mode: str, n: int) -> int:
        ids = torch.tensor(_prompt(n, seed=3), device=resident.device)
        resident.reset()
        resident.store.begin_request()
        before = Calls.n
        with torch.no_grad(), Calls():  # one window: each bank streamed once
            prefill(resident.model, resident.store, resident.kv, ids, 0, mode, chunk_tokens=32, window_tokens=512,
                    demand_max_tokens=0)
        resident.reset()
        return Calls.n - before

    per_chunk = {m: (calls(m, 160) - calls(m, 96)) // 2 for m in ("resident", "layer-major", "chunked")}
    assert per_chunk["layer-major"] == per_chunk["resident"] > 0
    assert per_chunk["chunked"] > per_chunk["resident"]


def test_a_primed_first_layer_is_taken_once_and_changes_no_bit(streamed, resident):
    """``ExpertStore.prime`` (a request arriving at an idle engine): the first layer's copy starts ahead, and a
    streamed prefill whose first layer it is takes it instead of copying again. Same logits and KV, the same
    bytes in its stats, counted once. Demand loading writes the first buffer itself: it drops the prime, whose
    copy counts then, to the request that dropped it. A second prime before the first is used, or one with
    resident experts, does nothing."""
    store, bank = streamed.store, streamed.store.bank
    ids = _prompt(150, seed=7)
    for mode in ("layer-major", "chunked"):
        ref_logits, ref_stats, ref_kv = _raw_prefill(streamed, ids, mode)
        life0, taken0 = store.lifetime.snapshot(), store.primes_taken
        assert store.prime(0) and not store.prime(0)
        assert store.lifetime.minus(life0).h2d_bytes == 0  # held back until taken or dropped
        logits, stats, kv = _raw_prefill(streamed, ids, mode)
        assert torch.equal(logits, ref_logits) and all(torch.equal(a, b) for a, b in zip(kv, ref_kv, strict=True))
        assert stats.primed and not ref_stats.primed and store.primes_taken == taken0 + 1, mode
        assert (stats.h2d_bytes, stats.expert_copies) == (ref_stats.h2d_bytes, ref_stats.expert_copies), mode
        assert store.lifetime.minus(life0).h2d_bytes == ref_stats.h2d_bytes, mode
    ref_logits, ref_stats, _ = _raw_prefill(streamed, ids, "demand")
    dropped0 = store.primes_dropped
    assert store.prime(0)
    logits, stats, _ = _raw_prefill(streamed, ids, "demand")
    assert torch.equal(logits, ref_logits) and not stats.primed and store.primes_dropped == dropped0 + 1
    assert stats.h2d_bytes == ref_stats.h2d_bytes + bank.layer_bytes  # the prime's copy, for nothing
    assert not resident.store.prime(0)


def _serve(engine: Engine, prompts: list[list[int]], mode: str, max_tokens: int = 5):
    """Serve prompts in order from a flushed engine; per request: (ids, logprobs, stats, KV)."""
    engine.reset()
    out = []
    for p in prompts:
        events, stats = engine.run(p, max_tokens, prefill_mode=mode, logprobs=4)
        kv = _kv(engine, len(p) + max_tokens - 1)
        out.append(([e.token_id for e in events], [e.top_logprobs for e in events], stats, kv))
    return out


def test_prefix_cache_continuation_is_identical_across_modes(resident, streamed):
    cold = _prompt(70, seed=1)
    cont = cold + _prompt(40, seed=2)  # the continuation extends the cold prompt
    runs = {mode: _serve(resident, [cold, cont], mode) for mode in MODES}
    runs["slot-cache engine"] = _serve(streamed, [cold, cont], "chunked")  # decode through an evicting cache
    ref = runs["chunked"]
    for name, run in runs.items():
        for (ids, lps, stats, kv), (rids, rlps, _, rkv) in zip(run, ref, strict=True):
            assert ids == rids and lps == rlps, name  # logprobs compared as exact floats
            assert all(torch.equal(a, b) for a, b in zip(kv, rkv, strict=True)), name
        stats = run[1][2]
        assert stats.cached_prompt_tokens == 70 and stats.prompt_tokens == 110
        assert stats.n_chunks == 2  # chunks start at the reuse point: [70, 102), [102, 110)
    assert runs["layer-major"][1][2].prefill_path == "layer-major"
    # the reused prefix is right: a cold prefill of the whole continuation agrees (other chunk boundaries,
    # so not bitwise: within float32 rounding)
    cold_ids, cold_lps, cold_stats, _ = _serve(resident, [cont], "chunked")[0]
    assert cold_stats.cached_prompt_tokens == 0 and cold_ids == ref[1][0]
    for a, b in zip(cold_lps, ref[1][1], strict=True):
        torch.testing.assert_close(torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]), atol=1e-4,
                                   rtol=0)


def test_h2d_bytes_count_banks_per_mode(resident, streamed):
    bank = resident.bank_bytes
    assert bank == MINI.bank_bytes(resident.dtype.itemsize)  # float32 on CPU
    long_prompt, two_chunks, short = _prompt(150, seed=3), _prompt(64, seed=4), _prompt(5, seed=5)
    by_mode = {m: _serve(resident, [long_prompt], m)[0][2] for m in MODES}
    assert by_mode["chunked"].prefill_h2d_bytes == 5 * bank  # one bank per chunk
    assert by_mode["chunked"].expert_copies == 5 * MINI.num_hidden_layers * MINI.num_experts
    assert by_mode["layer-major"].prefill_h2d_bytes == 3 * bank and by_mode["layer-major"].n_windows == 3
    assert _serve(resident, [two_chunks], "layer-major")[0][2].prefill_h2d_bytes == bank  # one window: one bank
    assert by_mode["demand"].prefill_h2d_bytes <= 5 * bank
    assert by_mode["resident"].h2d_bytes == 0 and by_mode["resident"].expert_copies == 0
    demand = _serve(resident, [short], "demand")[0][2]
    assert 0 < demand.prefill_h2d_bytes < bank  # 5 tokens x top-2 reach at most 10 of 16 experts a layer
    assert demand.prefill_h2d_bytes == demand.expert_copies * (bank // (3 * 16))
    assert demand.decode_h2d_bytes == 0  # the resident engine decodes from resident experts
    # decode through the slot cache: misses are copied one expert at a time and counted
    _, _, stats, _ = _serve(streamed, [long_prompt], "chunked", max_tokens=6)[0]
    expert_bytes = bank // (MINI.num_hidden_layers * MINI.num_experts)
    assert stats.h2d_bytes == stats.prefill_h2d_bytes + stats.decode_h2d_bytes
    assert 0 < stats.decode_h2d_bytes <= 5 * 3 * 2 * expert_bytes  # 5 decode steps x 3 layers x top-2
    assert stats.expert_copies == 5 * 3 * 16 + stats.decode_h2d_bytes // expert_bytes
    counters = resident.counters
    assert counters["requests_by_path"]["layer-major"] >= 2 and counters["h2d_bytes_total"] >= 9 * bank


def test_slot_cache_size_changes_bytes_not_tokens(streamed):
    big = _engine(expert_slots_per_layer=MINI.num_experts)
    p = _prompt(40, seed=6)
    small_run = _serve(streamed, [p, p], "chunked", max_tokens=8)
    big_run = _serve(big, [p, p], "chunked", max_tokens=8)
    assert [r[0] for r in small_run] == [r[0] for r in big_run]
    assert big_run[0][2].decode_h2d_bytes <= small_run[0][2].decode_h2d_bytes
    assert big_run[1][2].decode_h2d_bytes < big_run[0][2].decode_h2d_bytes  # second pass: warm cache


def test_d2d_from_slot_cache_moves_cached_experts_on_device(resident):
    engine = _engine(d2d_from_slot_cache=True, expert_slots_per_layer=MINI.num_experts)
    warm, fresh = _prompt(30, seed=7, lo=1), [0] + _prompt(99, seed=8, lo=1)  # no shared prefix
    engine.reset()
    engine.run(warm, 8)  # decode fills the slot cache
    events, stats = engine.run(fresh, 4)
    assert stats.cached_prompt_tokens == 0 and stats.d2d_bytes > 0
    assert stats.prefill_h2d_bytes + stats.d2d_bytes == stats.n_chunks * engine.bank_bytes
    kv = _kv(engine, len(fresh) + 3)
    ref_ids, _, _, ref_kv = _serve(resident, [fresh], "chunked", max_tokens=4)[0]
    assert [e.token_id for e in events] == ref_ids
    assert all(torch.equal(a, b) for a, b in zip(kv, ref_kv, strict=True))


def test_a_per_request_chunk_length_equals_an_engine_started_with_it(resident):
    """``chunk_tokens`` per request (the giant-chunk and larger-compute-chunk arms on one service): every mode
    at that length is bitwise what an engine started with ``--chunk-tokens`` of that length gives, and what the
    request ran with is reported."""
    prompt = _prompt(150, seed=12)
    for chunk in (16, 64, 150, 512):  # smaller, larger, exactly the prompt, beyond it (one giant chunk)
        other = _engine(prefill_mode="resident", chunk_tokens=chunk)
        ref_ids, ref_lps, ref_stats, ref_kv = _serve(other, [prompt], "chunked")[0]
        assert ref_stats.chunk_tokens == chunk and ref_stats.n_chunks == -(-150 // chunk)
        for mode in MODES:
            resident.reset()
            events, stats = resident.run(prompt, 5, prefill_mode=mode, logprobs=4, chunk_tokens=chunk)
            assert [e.token_id for e in events] == ref_ids and [e.top_logprobs for e in events] == ref_lps, mode
            assert all(torch.equal(a, b) for a, b in zip(_kv(resident, 154), ref_kv, strict=True)), (chunk, mode)
            assert (stats.chunk_tokens, stats.n_chunks) == (chunk, ref_stats.n_chunks)
            if mode == "layer-major":  # a 64-token window holds one 64-token chunk: no layer-major then
                want = "layer-major" if chunk < 64 else "chunked"
                assert stats.prefill_path == want, chunk
    resident.reset()
    assert resident.run(prompt, 2)[1].chunk_tokens == 32  # the engine's own without an override
    retries = resident.run(prompt, 2)[1].alloc_retries  # the CUDA caching allocator's count; None on CPU
    assert retries is None if resident.device.type == "cpu" else retries >= 0


def test_a_per_request_chunk_length_is_checked():
    engine = _engine()
    for bad in (0, -32):
        with pytest.raises(ValueError, match="chunk_tokens must be positive"):
            engine.run(_prompt(10), 2, chunk_tokens=bad)
    budget = _engine(gpu_memory_budget_gib=10.0)
    with pytest.raises(ValueError, match="planned for 32-token chunks"):
        budget.run(_prompt(10), 2, chunk_tokens=64)
    assert budget.run(_prompt(40), 2, chunk_tokens=16)[1].n_chunks == 3  # smaller fits the plan


def test_optimised_modes_report_their_fallbacks():
    engine = _engine(demand_max_tokens=8, layer_major_window_tokens=32)
    _, stats = engine.run(_prompt(100, seed=9), 1, prefill_mode="demand")  # chunks 32, 32, 32, 4: mixed
    assert (stats.prefill_path, stats.fallback_reason) == ("demand", None)
    assert 3 * engine.bank_bytes < stats.prefill_h2d_bytes < 4 * engine.bank_bytes
    _, stats = engine.run(_prompt(96, seed=10), 1, prefill_mode="demand")  # every chunk > 8 tokens
    assert stats.prefill_path == "chunked" and "demand_max_tokens=8" in stats.fallback_reason
    _, stats = engine.run(_prompt(96, seed=11), 1, prefill_mode="layer-major")  # window of one chunk
    assert stats.prefill_path == "chunked" and "window" in stats.fallback_reason
    assert stats.prefill_h2d_bytes == 3 * engine.bank_bytes
    with pytest.raises(ValueError, match="resident"):
        engine.generate(GenerateRequest(_prompt(10), 1, prefill_mode="resident"))  # not started resident
    assert engine.counters["requests_by_path"]["chunked"] == 2
    assert engine.counters["requests_by_path"]["demand"] == 1


class CancelAfter:
    """A cancel flag that reads 'set' from its n-th check on (the engine checks once per layer step)."""

    def __init__(self, n: int):
        self.n, self.checks = n, 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks >= self.n


@pytest.mark.parametrize("mode", MODES)
def test_cancellation_is_prompt_and_leaves_the_engine_correct(resident, mode):
    p = _prompt(150, seed=12)
    ref = _serve(resident, [p], mode)[0]
    counting = CancelAfter(10**9)
    resident.reset()
    resident.run(p, 5, prefill_mode=mode, cancel=counting)  # how many checks a whole cold request makes
    for n in (7, counting.checks - 4):  # mid-prefill, then mid-decode
        cancel, seen = CancelAfter(n), []
        resident.reset()
        with pytest.raises(Cancelled):
            for event in resident.generate(GenerateRequest(p, 5, prefill_mode=mode), cancel):
                seen.append(event.token_id)
        assert cancel.checks == n  # stopped at the first check that saw the flag
        assert seen == ref[0][: len(seen)] and (len(seen) > 0) == (n > 7)
        events, stats = resident.run(p, 5, prefill_mode=mode)  # the next request, on whatever cache is left
        assert [e.token_id for e in events] == ref[0]
        assert stats.cached_prompt_tokens == (0 if n == 7 else 149)  # a cancelled prefill leaves no prefix
    event = threading.Event()
    event.set()
    with pytest.raises(Cancelled):
        resident.run(p, 5, prefill_mode=mode, cancel=event)
    assert resident.counters["requests_cancelled"] >= 3


def test_generate_from_a_worker_thread_and_one_request_at_a_time(resident):
    p = _prompt(50, seed=13)
    resident.reset()
    ref, _ = resident.run(p, 4)
    resident.reset()
    box = {}
    worker = threading.Thread(target=lambda: box.update(out=resident.run(p, 4)))
    worker.start()
    worker.join()
    assert [e.token_id for e in box["out"][0]] == [e.token_id for e in ref]
    first = resident.generate(GenerateRequest(p, 4))
    next(first)
    with pytest.raises(RuntimeError, match="one at a time"):
        next(resident.generate(GenerateRequest(p, 4)))
    first.close()  # an abandoned request releases the engine
    assert len(resident.run(p, 2)[0]) == 2


def test_tiny_preset_end_to_end_in_every_mode():
    """The preset the harness's CPU smoke runs use (Qwen3 vocabulary), through the public API only."""
    tiny = PRESETS["tiny"]
    engine = Engine(EngineConfig(model="tiny", prefill_mode="resident", **KNOBS))
    prompt = torch.randint(0, tiny.vocab_size, (100,), generator=torch.Generator().manual_seed(14)).tolist()
    results = {m: _serve(engine, [prompt], m, max_tokens=4)[0] for m in MODES}
    for m in MODES:
        assert results[m][0] == results["chunked"][0] and results[m][1] == results["chunked"][1], m
        assert results[m][2].prefill_path == m and results[m][2].completion_tokens == 4
    bank = engine.bank_bytes
    assert bank == tiny.bank_bytes(engine.dtype.itemsize)
    assert results["chunked"][2].prefill_h2d_bytes == 4 * bank  # 100 tokens = 4 chunks of 32
    assert results["layer-major"][2].prefill_h2d_bytes == 2 * bank  # 2 windows of 2 chunks
    assert results["resident"][2].h2d_bytes == 0
    assert engine.measured_h2d_gbps != engine.measured_h2d_gbps  # probe disabled: NaN


@pytest.mark.parametrize("preset,mode", [("tiny", "chunked"), ("qwen3.5-tiny", "layer-major")])
def test_the_start_up_prefill_warm_up_leaves_no_trace(preset, mode):
    """``warm_prefill`` (on by default on CUDA, forced here): one throwaway prefill of two full chunks and a short
    one at start, in the engine's prefill mode (Qwen3-MoE chunked, the hybrid layer-major), then nothing of it
    is left. An engine that ran it answers
    bitwise like one that did not (ids, logprobs, prefill bytes, slot hits and misses), with no prefix-cache hit
    for a prompt that starts like the warm-up's (token 0 repeated) and its traffic at zero."""
    cfg = dict(model=preset, weights="random:0", chunk_tokens=64, layer_major_window_tokens=128,
               bandwidth_probe_bytes=0, max_context=400, warm_decode_graphs=False, device=KNOBS["device"],
               expert_slots_per_layer=PRESETS[preset].num_experts_per_tok + 2)
    fresh = Engine(EngineConfig(**cfg, prefill_mode=mode, warm_prefill=False))
    warmed = Engine(EngineConfig(**cfg, prefill_mode=mode, warm_prefill=True))
    assert fresh.prefill_warmup is None
    assert {k: warmed.prefill_warmup[k] for k in ("tokens", "mode")} == {"tokens": 129, "mode": mode}
    assert warmed.store.lifetime.h2d_bytes == 0 and not any(warmed.store.slots.lru)
    prompt = [0] * 40 + _prompt(60, seed=5)
    a_events, a = fresh.run(prompt, 6, ignore_eos=True, logprobs=3)
    b_events, b = warmed.run(prompt, 6, ignore_eos=True, logprobs=3)
    assert [(e.token_id, e.top_logprobs) for e in a_events] == [(e.token_id, e.top_logprobs) for e in b_events]
    assert b.cached_prompt_tokens == 0
    assert (a.prefill_h2d_bytes, a.slot_hits, a.slot_misses) == (b.prefill_h2d_bytes, b.slot_hits, b.slot_misses)


def test_the_build_says_where_its_time_went() -> None:
    """``Engine.startup_phases``: each step of the build in order (the launch log prints them), the warm-ups
    where they run, together the build's time."""
    engine = _engine(warm_prefill=True)
    phases = engine.startup_phases
    assert list(phases)[:5] == ["plan", "host bank", "weights", "device experts, decoder, steps", "bandwidth probe"]
    assert "prefill warm-up" in phases and "auto's costs" not in phases
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= engine.startup_s + 0.01


@pytest.mark.parametrize("mode,bank", [("chunked", {}), ("layer-major", {}), ("demand", {}),
                                       ("layer-major", dict(expert_dtype="fp8", fp8_dequant="gemm"))])
def test_slots_sharing_the_buffers_memory_are_forgotten_at_each_prefill(resident, mode, bank):
    """``slots_share_buffers``: the decode slots are views of the prefill buffers' memory, so every prefill
    writes over slots that decode filled, and the engine must forget them (decode starts cold). Requests in a row,
    without a reset, give the ids, logprobs and KV of the resident engine; a slot still believed to hold an
    expert after a prefill wrote over it would decode through other weights. An FP8 bank's buffers of FP8 values
    and row scales (``fp8_dequant`` "gemm") share the slots' memory the same way."""
    if bank:
        resident = _engine(prefill_mode="resident", **bank)
    engine = _engine(prefill_mode=mode, slots_share_buffers="on", expert_slots_per_layer=4, max_num_seqs=1, **bank)
    store = engine.store
    buffers = [t.values if isinstance(t, Fp8Experts) else t for t in store.buf_gate_up + store.buf_down]
    pool = buffers[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == pool for t in buffers + store.slots.gate_up + store.slots.down)
    prompts = [_prompt(70, seed=40), _prompt(45, seed=41, lo=1), _prompt(99, seed=42, lo=2)]
    got = _serve(engine, prompts, mode, max_tokens=6)
    want = _serve(resident, prompts, mode, max_tokens=6)
    for (ids, lps, stats, kv), (rids, rlps, _, rkv) in zip(got, want, strict=True):
        assert ids == rids and lps == rlps
        assert all(torch.equal(a, b) for a, b in zip(kv, rkv, strict=True))
        assert stats.slot_misses > 0  # cold after its prefill
    assert store.slot_flushes >= len(prompts) - 1  # each prefill after the first found decode's experts there
    assert engine.memory_plan is None or engine.memory_plan.slots_share_buffers
