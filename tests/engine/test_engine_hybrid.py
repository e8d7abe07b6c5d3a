"""The vendored engine's Qwen3.5/3.6-MoE hybrid (Gated DeltaNet + gated attention): numerics against
transformers, bitwise equality of the prefill modes, the linear layers' states across chunks, windows,
prefix-cache continuations, decode and /reset.

Reference: transformers' ``Qwen3_5MoeForCausalLM`` (installed in the venv), random-initialised at a tiny shape,
saved with ``save_pretrained`` and loaded by ``abbench.engine.models.weights``. No network, no hub. Everything runs on
CPU with 64-token chunks (the delta rule's block) in a few seconds; set ABBENCH_ENGINE_TEST_DEVICE=cuda to run
the same assertions on a GPU (bfloat16 there, except the float32 comparison with transformers; the delta rule
through fla when it imports).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from abbench.engine import PRESETS, EngineConfig, ModelConfig  # noqa: E402
from abbench.engine.config import HybridConfig  # noqa: E402
from abbench.engine.runtime.prefill import prefill  # noqa: E402
from abbench.engine.runtime.engine import Engine  # noqa: E402
from abbench.engine.runtime.steps import BatchingStats, plan_attention_groups  # noqa: E402
from tests.support.hf_models import save_random_hybrid  # noqa: E402

L, F = "linear_attention", "full_attention"
MINI = HybridConfig(
    vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    moe_intermediate_size=32, num_experts=16, num_experts_per_tok=2, max_position_embeddings=4096, eos_token_id=None,
    name="mini-hybrid", layer_types=(L, F, L, L), linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, shared_expert_intermediate_size=24)
MODES = ("chunked", "layer-major", "demand", "resident")
KNOBS = dict(chunk_tokens=64, layer_major_window_tokens=128, demand_max_tokens=64, max_context=1024,
             bandwidth_probe_bytes=0, device=os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu"))
CPU = KNOBS["device"] == "cpu"

HF_SHAPE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, moe_intermediate_size=32, shared_expert_intermediate_size=24, num_experts=8,
                num_experts_per_tok=2, max_position_embeddings=1024, eos_token_id=None)


# -- fixtures and helpers ---------------------------------------------------------------------------------

def _engine(model=MINI, **overrides) -> Engine:
    return Engine(EngineConfig(**{"model": model, "weights": "random:1", **KNOBS, **overrides}))


@pytest.fixture(scope="module")
def resident():
    """Started resident, so it also runs every streamed mode per request."""
    return _engine(prefill_mode="resident")


def _prompt(n: int, seed: int = 0, vocab: int = MINI.vocab_size) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache(engine: Engine, n: int) -> list[torch.Tensor]:
    """KV of positions [0, n) of the attention layers and every linear layer's conv and recurrent state."""
    kv = engine.kv
    return [t[:, :n].clone() for t in kv.k + kv.v] + [t.clone() for t in kv.states()]


def _raw_prefill(engine: Engine, ids: list[int], mode: str, start: int = 0, window_tokens: int | None = None):
    """One prefill through the module API from whatever the cache holds: (logits, stats, cache)."""
    engine.store.begin_request()
    logits, stats = prefill(engine.steps, engine.store, engine.kv, torch.tensor(ids[start:], device=engine.device), start, mode,
                            chunk_tokens=engine.config.chunk_tokens,
                            window_tokens=window_tokens or engine.config.layer_major_window_tokens,
                            demand_max_tokens=engine.config.demand_max_tokens)
    return logits.clone(), stats, _cache(engine, len(ids))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _hf_model(tmp: Path, seed: int = 0):
    """A random transformers Qwen3.5-MoE model saved into ``tmp`` (``save_random_hybrid``: every tensor redrawn so that it matters)."""
    return save_random_hybrid(transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig(**HF_SHAPE), tmp, seed, unit=("embed_tokens",))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_qwen3_5_moe")
    model = _hf_model(tmp)
    engine = Engine(EngineConfig(model=str(tmp), weights=str(tmp), **KNOBS, dtype="float32"))
    return tmp, model, engine


# -- configuration ----------------------------------------------------------------------------------------

def test_from_hf_config_reads_text_and_multimodal_configs(hf, tmp_path):
    tmp, _, _ = hf
    mc = ModelConfig.from_hf_config(tmp)
    assert isinstance(mc, HybridConfig) and mc.is_hybrid
    assert mc.layer_types == (L, L, L, F) and mc.rotary_dim == 4 and mc.conv_dim == 2 * 2 * 16 + 4 * 8
    assert (mc.linear_num_key_heads, mc.linear_num_value_heads, mc.shared_expert_intermediate_size) == (2, 4, 24)
    raw = json.loads((tmp / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe_text"
    wrapped = {"model_type": "qwen3_5_moe", "text_config": raw | {"model_type": "qwen3_5_moe_text"},
               "vision_config": {}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    mm = ModelConfig.from_hf_config(tmp_path)
    assert dataclasses.replace(mm, name=mc.name) == mc
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe"})
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_hf_dict(raw | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_presets_match_the_models_they_name():
    big, tiny = PRESETS["qwen3.5-35b-a3b"], PRESETS["qwen3.5-tiny"]
    assert big.is_hybrid and tiny.is_hybrid and not PRESETS["tiny"].is_hybrid
    assert (big.num_hidden_layers, len(big.linear_layers), len(big.attention_layers)) == (40, 30, 10)
    assert big.attention_layers == tuple(range(3, 40, 4))
    assert (big.num_experts, big.num_experts_per_tok, big.hidden_size, big.moe_intermediate_size) == (256, 8, 2048, 512)
    assert (big.shared_expert_intermediate_size, big.head_dim, big.rotary_dim) == (512, 256, 64)
    assert (big.vocab_size, big.max_position_embeddings, big.rope_theta) == (248320, 262144, 1e7)
    assert round(big.bank_bytes(2) / 1e9, 1) == 64.4  # routed experts only: the "64.4 GB" bank
    # the tiny preset's embedding holds every id of the Qwen3.5/3.6 tokenizer (248,044 ranks + 33 specials)
    assert tiny.vocab_size == 248320 and tiny.eos_ids == {248044}
    assert big.conv_dim == 8192 and tiny.layer_types == (L, L, L, F)


def test_chunk_tokens_must_be_a_multiple_of_64_for_hybrids():
    with pytest.raises(ValueError, match="multiple of 64"):
        EngineConfig(model=MINI, chunk_tokens=100).resolved()
    with pytest.raises(ValueError, match="multiple of 64"):
        EngineConfig(model="qwen3.5-tiny", chunk_tokens=1000).resolved()
    assert EngineConfig(model="tiny", chunk_tokens=100).resolved().chunk_tokens == 100  # plain models: any


# -- numerics against transformers ------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.skipif(KNOBS["device"] != "cpu", reason="float32 agreement with transformers is checked on CPU")
def test_logits_and_greedy_tokens_match_transformers(hf):
    """float32, the same random checkpoint: last-position logits within 1e-5 relative (measured: ~1e-6) at
    lengths inside one chunk, at a chunk boundary and over several chunks; greedy ids equal (with decode)."""
    _, model, engine = hf
    worst, margins = 0.0, []
    for n in (1, 7, 64, 65, 150, 200):
        ids = _prompt(n, seed=n, vocab=512)
        engine.reset()
        events, stats = engine.run(ids, 8, logprobs=0)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1]
        engine.reset()
        logits, _, _ = _raw_prefill(engine, ids, "chunked")
        worst = max(worst, _rel(logits, ref))
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        hf_ids = out.sequences[0, n:].tolist()
        assert [e.token_id for e in events] == hf_ids, n
        margins.extend(float(t[0] - t[1]) for t in (torch.topk(s[0].float(), 2).values for s in out.scores))
    print(f"max relative logits difference vs transformers: {worst:.2e}; least top-2 margin {min(margins):.2e}")
    assert worst < 1e-5
    # equal greedy ids are a property, not a coin flip of the CPU's summation order: every step's top-2 margin
    # is far above the logits' difference
    assert min(margins) > 1e-3


def test_multimodal_prefix_and_fused_expert_keys_load_identically(hf, tmp_path):
    """The multimodal checkpoint's ``model.language_model.`` keys with fused [E, 2I, H] / [E, H, I] experts
    (and vision tensors to ignore) load the same bits as the save_pretrained per-expert checkpoint."""
    from safetensors.torch import save_file

    tmp, model, engine = hf
    sd = {}
    for k, v in model.state_dict().items():
        sd[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v.contiguous()
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in sd
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": raw}))
    other = Engine(EngineConfig(model=str(tmp_path), weights=str(tmp_path), **KNOBS, dtype="float32"))
    for l in range(4):
        assert torch.equal(other.store.bank.gate_up[l], engine.store.bank.gate_up[l])
        assert torch.equal(other.store.bank.down[l], engine.store.bank.down[l])
    mine, theirs = _tensors(other.model.w), _tensors(engine.model.w)
    assert len(mine) == len(theirs) > 40 and all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor of a weights dataclass tree, in field order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list):
        return [t for x in obj for t in _tensors(x)]
    return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]


# -- bitwise equality across modes ------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 129, 200, 333])
def test_all_modes_give_bitwise_identical_logits_kv_and_states(resident, n):
    ids = _prompt(n, seed=n)
    resident.reset()
    ref_logits, ref_stats, ref_cache = _raw_prefill(resident, ids, "chunked")
    assert ref_stats.n_chunks == -(-n // 64)
    for mode in MODES[1:]:
        resident.reset()
        logits, stats, cache = _raw_prefill(resident, ids, mode)
        assert torch.equal(logits, ref_logits), mode
        assert _same(cache, ref_cache), mode
        if mode == "layer-major" and n <= 64:
            assert stats.path == "chunked"
        else:
            assert (stats.path, stats.fallback_reason) == (mode, None)
    if n == 333:  # 6 chunks, 2 per 128-token window: 3 windows; 4 and 3 windows of other budgets agree too
        bank = resident.bank_bytes
        item = resident.dtype.itemsize  # float32 on CPU, bfloat16 on CUDA
        assert bank == MINI.num_hidden_layers * MINI.num_experts * 3 * 64 * 32 * item  # routed experts only
        assert ref_stats.h2d_bytes == 6 * bank  # one bank per chunk; the shared experts never move
        lm = _raw_prefill(resident, ids, "layer-major")[1]
        assert (lm.n_windows, lm.h2d_bytes) == (3, 3 * bank)
        assert _raw_prefill(resident, ids, "resident")[1].h2d_bytes == 0
        for window in (192, 256, 1024):
            logits, stats, cache = _raw_prefill(resident, ids, "layer-major", window_tokens=window)
            assert torch.equal(logits, ref_logits) and _same(cache, ref_cache), window
            assert stats.n_windows == -(-6 // (window // 64))


def _triton_runs_here() -> bool:
    from abbench.engine.ops import kernels

    return kernels.have_triton() and (not CPU or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.skipif(not _triton_runs_here(), reason="Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
def test_prefill_kernels_triton_keep_every_mode_bitwise_and_stay_near_torchs(resident):
    """``prefill_kernels`` "triton" on the hybrid: the input norm, the residual add with the post norm and the
    router's top-k as decode's fused kernels, in DeltaNet and attention layers, whole chunks and a short last one
    (on CUDA inside the prefill graphs too): every mode still gives the same bits (logits, KV, every linear
    layer's states), within float rounding of torch's ops, and the same greedy tokens end to end."""
    fused = _engine(prefill_mode="resident", prefill_kernels="triton")
    ids = _prompt(200, seed=7)  # 4 chunks (the last short), 2 layer-major windows
    fused.reset()
    ref_logits, _, ref_cache = _raw_prefill(fused, ids, "chunked")
    for mode in MODES[1:]:
        fused.reset()
        logits, stats, cache = _raw_prefill(fused, ids, mode)
        assert stats.path == mode and torch.equal(logits, ref_logits) and _same(cache, ref_cache), mode
    resident.reset()
    torch_logits, _, torch_cache = _raw_prefill(resident, ids, "chunked")
    # bfloat16 (CUDA): the fused kernels round once where torch's ops round at each step; on an H100 the logits
    # differed by up to 0.026 (hybrid) and 0.033 (Qwen3-MoE) of a few units (results/20261206i)
    tol = dict(rtol=2e-2, atol=5e-2) if fused.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref_logits, torch_logits, **tol)
    for a, b in zip(ref_cache, torch_cache, strict=True):
        torch.testing.assert_close(a, b, **tol)
    for engine in (fused, resident):
        engine.reset()
    assert _serve(fused, [ids], "layer-major")[0][0] == _serve(resident, [ids], "layer-major")[0][0]


def test_prefill_graphs_replay_bitwise_what_eager_steps_compute():
    """CUDA: an engine that replays full chunks' fixed-shape layer steps as CUDA graphs gives, in every mode and
    across requests (eager first sighting, capture, replays), exactly the logits, KV and states of an engine
    that runs every step eagerly; a prompt's shorter last chunk runs eagerly in both. On CPU there are no graphs
    and the engine says so."""
    graphed = _engine(prefill_mode="resident")
    if CPU:
        assert graphed.prefill_graphs_mode == "eager" and graphed.steps.graphs is None
        return
    eager = _engine(prefill_mode="resident", prefill_graphs=False)
    assert (graphed.prefill_graphs_mode, eager.prefill_graphs_mode) == ("cuda-graphs", "eager")
    for n in (192, 200, 333):
        ids = _prompt(n, seed=40 + n)
        eager.reset()
        ref_logits, _, ref_cache = _raw_prefill(eager, ids, "chunked")
        for repeat in range(3):  # first sighting eager, then capture, then replays
            for mode in MODES:
                graphed.reset()
                logits, stats, cache = _raw_prefill(graphed, ids, mode)
                assert torch.equal(logits, ref_logits) and _same(cache, ref_cache), (n, mode, repeat)
                if repeat:
                    assert stats.graph_replays > 0, (n, mode)
    ids = _prompt(200, seed=3)
    graphed.reset()
    ref = graphed.run(ids, 6, logprobs=2)[0]
    eager.reset()
    assert [(e.token_id, e.top_logprobs) for e in eager.run(ids, 6, logprobs=2)[0]] == \
        [(e.token_id, e.top_logprobs) for e in ref]


def test_attention_groups_follow_the_stated_rule():
    """Groups of k chunks share an attention call only when the device is exact, the window has k chunks left,
    every chunk is full and the group ends within the context limit; each other group is counted once with its
    reason, and every chunk appears exactly once, in order."""
    window = [(a, min(a + 64, 500)) for a in range(0, 500, 64)]  # 8 chunks, the last of 52 tokens
    stats = BatchingStats()
    groups = plan_attention_groups(window, 2, 64, 256, True, stats)
    assert [c for g in groups for c in g] == list(range(8))
    assert groups[:2] == [[0, 1], [2, 3]]  # ends at 128 and 256 <= 256
    assert groups[2:] == [[4], [5], [6], [7]]
    assert (stats.batched, stats.fallbacks) == (2, {"long-context": 1, "short-chunk": 1})
    stats = BatchingStats()
    groups = plan_attention_groups(window[:7], 2, 64, 4096, True, stats)  # 7 full chunks: one left over
    assert groups == [[0, 1], [2, 3], [4, 5], [6]]
    assert (stats.batched, stats.fallbacks) == (3, {"window-end": 1})
    for k in (2, 3):
        stats = BatchingStats()
        groups = plan_attention_groups(window, k, 64, 4096, False, stats)
        assert groups == [[c] for c in range(8)]
        assert (stats.batched, stats.fallbacks) == (0, {"not-bit-identical": -(-8 // k)})
    assert plan_attention_groups(window, 1, 64, 4096, True) == [[c] for c in range(8)]


def test_attention_batching_is_bitwise_one_call_per_chunk_or_falls_back_with_its_reason():
    """Layer-major with two chunks per attention call gives the ids and logprobs of one call per chunk. Where the
    device computes the joint call bit for bit (probed at start), groups run batched and the prompt's shorter last
    chunk and the groups past the context limit fall back with their reasons; where it does not, every group
    falls back as not bit-identical. Batching is refused for a model without joint attention calls."""
    ids = _prompt(333, seed=8)  # 6 chunks: 5 full and one of 13 tokens; one 512-token window
    engine = _engine(prefill_mode="chunked", attention_batch=2, attention_batch_max_context=192,
                     layer_major_window_tokens=512)
    ref, _ = engine.run(ids, 4, prefill_mode="layer-major", logprobs=3, attention_batch=1)
    engine.reset()
    events, stats = engine.run(ids, 4, prefill_mode="layer-major", logprobs=3)
    assert [(e.token_id, e.top_logprobs) for e in events] == [(e.token_id, e.top_logprobs) for e in ref]
    n_attn = len(MINI.attention_layers)
    exact = engine._batch_exact[(2, 64)]
    if exact:  # groups [0,1] (ends at 128), [2,3] past 192, [4,5] with a short chunk
        assert (stats.attention_batched, stats.attention_fallbacks) == (
            n_attn, {"long-context": n_attn, "short-chunk": n_attn})
    else:
        assert (stats.attention_batched, stats.attention_fallbacks) == (0, {"not-bit-identical": 3 * n_attn})
    engine.reset()
    _, chunked = engine.run(ids, 2, prefill_mode="chunked")
    assert (chunked.attention_batched, chunked.attention_fallbacks) == (0, None)  # only layer-major batches
    qwen3 = Engine(EngineConfig(model=PRESETS["tiny"], weights="random:1", device=KNOBS["device"],
                                bandwidth_probe_bytes=0))
    with pytest.raises(ValueError, match="joint attention"):
        qwen3.run(ids[:10], 1, attention_batch=2)


def test_a_per_request_chunk_length_equals_an_engine_started_with_it():
    """The delta rule's state crosses chunks the same way at any legal chunk length: per request, each mode at
    128 or 384 tokens is bitwise an engine started with that length; lengths off the 64-token grid are refused."""
    ids = _prompt(333, seed=21)
    engine = _engine(prefill_mode="resident", layer_major_window_tokens=512)  # started at 64-token chunks
    for chunk in (128, 384):
        other = _engine(prefill_mode="resident", chunk_tokens=chunk, layer_major_window_tokens=512)
        ref_events, ref_stats = other.run(ids, 4, logprobs=3)
        for mode in MODES:
            engine.reset()
            events, stats = engine.run(ids, 4, prefill_mode=mode, logprobs=3, chunk_tokens=chunk)
            if mode == "layer-major":
                assert stats.prefill_path == ("layer-major" if chunk == 128 else "chunked")
            assert [(e.token_id, e.top_logprobs) for e in events] == [(e.token_id, e.top_logprobs)
                                                                       for e in ref_events], (chunk, mode)
            assert (stats.chunk_tokens, stats.n_chunks) == (chunk, ref_stats.n_chunks)
    with pytest.raises(ValueError, match="multiple of 64"):
        engine.run(ids, 2, chunk_tokens=96)


def test_states_carry_across_chunks_and_windows(resident):
    """A prompt prefilled in two calls split at a multiple of 64 (the second starting from the first's KV and
    states, as a prefix-cache hit does) equals the one-call prefill bit for bit, in every mode; and the
    states are not trivial: a prefill that starts from zeroed states at the split point differs."""
    ids = _prompt(320, seed=11)
    resident.reset()
    ref_logits, _, ref_cache = _raw_prefill(resident, ids, "chunked")
    for mode in MODES:
        resident.reset()
        _raw_prefill(resident, ids[:128], mode)
        logits, stats, cache = _raw_prefill(resident, ids, mode, start=128)
        assert stats.n_chunks == 3
        assert torch.equal(logits, ref_logits) and _same(cache, ref_cache), mode
    resident.reset()
    _raw_prefill(resident, ids[:128], "chunked")
    for t in resident.kv.states():
        t.zero_()
    assert not torch.equal(_raw_prefill(resident, ids, "chunked", start=128)[0], ref_logits)


def _serve(engine: Engine, prompts: list[list[int]], mode: str, max_tokens: int = 5):
    """Serve prompts in order from a reset engine; per request: (ids, logprobs, stats, cache)."""
    engine.reset()
    out = []
    for p in prompts:
        events, stats = engine.run(p, max_tokens, prefill_mode=mode, logprobs=3)
        out.append(([e.token_id for e in events], [e.top_logprobs for e in events], stats,
                    _cache(engine, len(p) + max_tokens - 1)))
    return out


def test_prefix_cache_continuations_after_decode_are_identical_across_modes(resident):
    cold = _prompt(100, seed=1)
    first = _serve(resident, [cold], "chunked")[0]
    after_decode = cold + first[0] + _prompt(70, seed=2)  # extends the prompt *and* the generated tokens
    other = _prompt(90, seed=3)  # shares nothing
    prompts = [cold, after_decode, other, other + _prompt(5, seed=4)]
    runs = {mode: _serve(resident, prompts, mode) for mode in MODES}
    slots = _engine(expert_slots_per_layer=MINI.num_experts_per_tok)  # decode through an evicting slot cache
    runs["slot-cache engine"] = _serve(slots, prompts, "chunked")
    ref = runs["chunked"]
    for name, run in runs.items():
        for (ids, lps, _, cache), (rids, rlps, _, rcache) in zip(run, ref, strict=True):
            assert ids == rids and lps == rlps, name
            assert _same(cache, rcache), name
        assert [r[2].cached_prompt_tokens for r in run] == [0, 100, 0, 90], name
    assert runs["layer-major"][1][2].prefill_path == "layer-major"
    if not CPU:  # bfloat16: other chunk boundaries are not within float32 rounding
        return
    # the resumed states are right: cold prefills of the same prompts agree within float32 rounding (other
    # chunk boundaries, so not bitwise) and pick the same tokens
    for i in (1, 3):
        cold_ids, cold_lps, cold_stats, _ = _serve(resident, [prompts[i]], "chunked")[0]
        assert cold_stats.cached_prompt_tokens == 0 and cold_ids == ref[i][0]
        for a, b in zip(cold_lps, ref[i][1], strict=True):
            torch.testing.assert_close(torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]),
                                       atol=1e-4, rtol=0)


def test_reset_clears_the_states_and_the_prefix_cache(resident):
    ids = _prompt(80, seed=5)
    resident.reset()
    a = resident.run(ids, 3)
    assert any(t.abs().sum() > 0 for t in resident.kv.states())
    resident.reset()
    assert all(t.abs().sum() == 0 for t in resident.kv.states())
    b = resident.run(ids + [1, 2], 3)
    assert b[1].cached_prompt_tokens == 0  # nothing reused after /reset
    c = resident.run(ids + [1, 2, 3], 3)
    assert c[1].cached_prompt_tokens == 82
    resident.reset()
    assert resident.run(ids, 3)[0] == a[0]


# -- decode -----------------------------------------------------------------------------------------------

def test_static_decode_step_matches_the_one_token_chunk(resident):
    """``decode_attn_block`` (position as a device tensor, KV over a fixed length with a mask, states in
    place) gives the same hidden states as ``attn_block`` on a one-token chunk, layer by layer."""
    model = resident.model
    ids = _prompt(70, seed=6)
    resident.reset()
    _raw_prefill(resident, ids, "chunked")
    saved = _cache(resident, 70)
    x = model.embed(torch.tensor([ids[-1]], device=resident.device))  # [1, H] any input will do
    pos, kv_len = 70, 128
    for layer in range(MINI.num_hidden_layers):
        ref = model.attn_block(layer, x, resident.kv, pos)
        ref_cache = _cache(resident, pos + 1)
        n_lin = len(MINI.linear_layers)
        n_attn = len(MINI.attention_layers)
        # restore the layer's pre-step cache and redo the step statically
        for t, s in zip(resident.kv.k + resident.kv.v, saved[:2 * n_attn], strict=True):
            t[:, :70] = s
            t[:, 70:] = 0
        for t, s in zip(resident.kv.states(), saved[2 * n_attn:2 * n_attn + 2 * n_lin], strict=True):
            t.copy_(s)
        out = model.decode_attn_block(layer, x, resident.kv, torch.tensor([pos], device=resident.device), kv_len)
        for a, b in zip(out, ref, strict=True):
            if CPU:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:  # bfloat16, SDPA with and without a mask
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        i = resident.kv.slot[layer]
        if MINI.layer_types[layer] == L:
            assert torch.equal(resident.kv.conv[i], ref_cache[2 * n_attn + i])
            torch.testing.assert_close(resident.kv.rec[i], ref_cache[2 * n_attn + n_lin + i], rtol=0, atol=0)
        else:
            assert torch.equal(resident.kv.k[i][:, :71], ref_cache[i])
    resident.reset()


def test_qwen3_5_tiny_preset_end_to_end_in_every_mode():
    engine = Engine(EngineConfig(model="qwen3.5-tiny", weights="random:0", prefill_mode="resident", chunk_tokens=64,
                                 layer_major_window_tokens=128, demand_max_tokens=64, max_context=512,
                                 bandwidth_probe_bytes=0, device=KNOBS["device"]))
    ids = _prompt(200, seed=7, vocab=248077)
    outs = {}
    for mode in MODES:
        engine.reset()
        events, stats = engine.run(ids, 4, prefill_mode=mode, logprobs=1)
        item = engine.dtype.itemsize
        assert stats.prefill_path == mode and stats.bank_bytes == engine.model_config.bank_bytes(item)
        outs[mode] = [(e.token_id, e.logprob) for e in events]
    assert all(v == outs["chunked"] for v in outs.values())


def test_gpucheck_runs_on_cpu_at_the_tiny_shape(capsys):
    from abbench.engine.tools import gpucheck_hybrid

    assert gpucheck_hybrid.main(["--device", "cpu", "--tokens", "200", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("bitwise equal;") == 4 and "DeltaNet mixer / 64-token chunk" in out and "PASS" in out
    assert "layer-major order, resident experts    bitwise equal (logits)" in out


def test_gpu_busy_is_the_union_of_kernel_intervals():
    """``gpucheck_hybrid --gpu-busy`` counts overlapping kernels (several streams) once and idle gaps not."""
    from abbench.engine.tools.gpucheck_hybrid import union_seconds

    assert union_seconds([]) == 0.0
    assert union_seconds([(0, 10), (5, 20), (30, 40), (32, 35), (40, 41)]) == pytest.approx(31e-6)
    assert union_seconds([(30, 40), (0, 1e6)]) == pytest.approx(1.0)


def test_the_memory_plan_counts_prefill_graphs_and_joint_attention_calls():
    """On CUDA the prefill graphs' pool (a second chunk workspace) and static buffers are planned, and a joint
    attention call's extra queries and output; the decode slots shrink to pay for them, never the budget."""
    from abbench.engine.runtime.memory import plan_device_memory

    mc = PRESETS["qwen3.5-35b-a3b"]
    base = dict(model=mc, device="cuda", chunk_tokens=2048, layer_major_window_tokens=131072, max_context=262144,
                max_num_seqs=1)
    plans = {name: plan_device_memory(EngineConfig(**base, **kw).resolved(), int(24e9)) for name, kw in {
        "eager": dict(prefill_graphs=False), "graphs": {}, "graphs+k2": dict(attention_batch=2)}.items()}
    extra = plans["graphs"].workspace_bytes - plans["eager"].workspace_bytes
    assert extra > 2048 * 4 * mc.hidden_size * 2  # at least the static buffers, bf16
    k2 = plans["graphs+k2"].workspace_bytes - plans["graphs"].workspace_bytes
    assert k2 == 2 * 2048 * mc.num_attention_heads * mc.head_dim * 2
    assert plans["eager"].slots_per_layer >= plans["graphs"].slots_per_layer >= plans["graphs+k2"].slots_per_layer
    assert all(p.total_bytes <= int(24e9) for p in plans.values())
    cpu = plan_device_memory(EngineConfig(**{**base, "device": "cpu", "dtype": "bfloat16"}).resolved(), int(24e9))
    assert cpu.workspace_bytes == plans["eager"].workspace_bytes  # no graphs off CUDA
    # Qwen3-MoE's prefill runs eagerly (ModelConfig.prefill_graph_moe): no pool comes out of its budget
    q3 = dict(base, model=PRESETS["qwen3-30b-a3b"], max_context=32768)
    eager, graphs = (plan_device_memory(EngineConfig(**q3, **kw).resolved(), 16 * 2**30)
                     for kw in (dict(prefill_graphs=False), {}))
    assert graphs == eager and graphs.slots_per_layer == 12
