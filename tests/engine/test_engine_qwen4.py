"""The vendored engine's Qwen4-Exp text decoder (hyper-connections, PLE, indexed attention, 512-expert shapes):
numerics against transformers, bitwise equality of the prefill modes, state across chunks, windows, the prefix
cache and decode.

Reference: transformers' ``Qwen4ExpForCausalLM`` (installed in the venv), random-initialised at a tiny shape with
PLE on two layers and an indexer budget far below the prompt length, saved with ``save_pretrained`` (the PLE
tables in row shards) and loaded by ``abbench.engine.models.qwen4_weights``. No network, no hub; CPU, float32, seconds.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from abbench.engine import PRESETS, EngineConfig, ModelConfig  # noqa: E402
from abbench.engine.config import Qwen4Config  # noqa: E402
from abbench.engine.runtime.memory import dense_params, kv_cache_bytes, plan_device_memory  # noqa: E402
from abbench.engine.runtime.prefill import prefill  # noqa: E402
from abbench.engine.models.qwen4 import Qwen4Model  # noqa: E402
from abbench.engine.runtime.engine import Engine  # noqa: E402
from tests.support.hf_models import save_random_hybrid  # noqa: E402

EOS = 7
MODES = ("chunked", "layer-major", "demand", "resident")
KNOBS = dict(chunk_tokens=64, layer_major_window_tokens=128, demand_max_tokens=64, max_context=1024,
             bandwidth_probe_bytes=0, device=os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu"))
# indexer: 16-token budget in blocks of 4 (4 blocks per query); PLE on layers 1 and 3 (one-indexed)
HF_SHAPE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, moe_intermediate_size=32, shared_expert_intermediate_size=24, num_experts=16,
                num_experts_per_tok=4, max_position_embeddings=1024, eos_token_id=EOS, hc_count=4, hc_lowrank=24,
                ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_vocab_size_base=300, split_ngram_parts=3,
                indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                indexer_compress_ratio=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def _prompt(n: int, seed: int = 0, vocab: int = 512, eos_every: int = 37) -> list[int]:
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [EOS if (j + 1) % eos_every == 0 else t for j, t in enumerate(ids)]  # n-grams must reset at EOS


def _hf_model(tmp: Path, seed: int = 0):
    """A random Qwen4-Exp model saved into ``tmp`` (``save_random_hybrid``: every tensor redrawn so that it matters)."""
    return save_random_hybrid(transformers.Qwen4ExpForCausalLM, transformers.Qwen4ExpTextConfig(**HF_SHAPE), tmp, seed, unit=("embed_tokens", "ngram_embedding"))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_qwen4_exp")
    model = _hf_model(tmp)
    engine = Engine(EngineConfig(model=str(tmp), weights=str(tmp), **KNOBS, dtype="float32",
                                 prefill_mode="resident"))
    return tmp, model, engine


def _raw_prefill(engine: Engine, ids: list[int], mode: str, start: int = 0):
    engine.store.begin_request()
    logits, stats = prefill(engine.model, engine.store, engine.kv, torch.tensor(ids[start:], device=engine.device), start, mode,
                            chunk_tokens=engine.config.chunk_tokens,
                            window_tokens=engine.config.layer_major_window_tokens,
                            demand_max_tokens=engine.config.demand_max_tokens)
    kv, n = engine.kv, len(ids)
    cache = ([t[:, :n].clone() for t in kv.k + kv.v] + [t[:n].clone() for t in kv.ik]
             + [t.clone() for t in kv.ck] + [t.clone() for t in kv.states()])
    return logits.clone(), stats, cache


def _gen(engine: Engine, prompt: list[int], n: int, mode: str):
    """Greedy ids and the request stats."""
    events, stats = engine.run(prompt, n, temperature=0, ignore_eos=True, prefill_mode=mode)
    return [e.token_id for e in events], stats


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _hf_greedy(model, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int], list[float]]:
    """Last-position logits of the prompt, n greedy ids and each step's top-2 logit margin, each step a full
    no-cache forward (the reference semantics, independent of transformers' cache code)."""
    ids, out, first, margins = list(prompt), [], None, []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            first = logits if first is None else first
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]))
            out.append(int(torch.argmax(logits)))
            ids.append(out[-1])
    return first, out, margins


# -- configuration ----------------------------------------------------------------------------------------

def test_config_from_hf_and_presets(hf):
    tmp, _, _ = hf
    mc = ModelConfig.from_hf_config(tmp)
    assert isinstance(mc, Qwen4Config) and mc.is_qwen4 and mc.is_hybrid
    assert mc.ple_layers == (0, 2) and mc.attention_layers == (3,) and mc.stream_width == 4 * 64
    assert mc.block_topk == 4 and mc.ple_eos == EOS
    full = PRESETS["qwen4-exp"]
    assert full.num_experts == 512 and full.num_experts_per_tok == 10 and full.num_hidden_layers == 40
    assert full.bank_bytes(2) == 40 * 512 * 3 * 2048 * 512 * 2  # 129 GB
    assert PRESETS["qwen4-exp-half"].num_hidden_layers == 20
    cfg = EngineConfig(model="qwen4-exp", weights="random:0", device="cuda", max_context=32768).resolved()
    plan = plan_device_memory(cfg, 24 * 10**9)
    assert plan.slots_per_layer >= 10  # 512 experts top-10 fit the 24 GB budget
    assert dense_params(full) > 0 and kv_cache_bytes(full, 32768, 2) > 0
    with pytest.raises(ValueError, match="hc_count"):
        dataclasses.replace(PRESETS["qwen4-exp-tiny"], hc_count=1)
    with pytest.raises(ValueError, match="ple_layer_ids"):
        dataclasses.replace(PRESETS["qwen4-exp-tiny"], ple_layer_ids=(4,))


# -- numerics against transformers -----------------------------------------------------------------------

@pytest.mark.skipif(KNOBS["device"] != "cpu", reason="float32 agreement with transformers is checked on CPU "
                    "(with fla installed, transformers runs its Triton kernels, which take no CPU tensors)")
def test_matches_transformers_past_the_indexer_budget(hf):
    _, model, engine = hf
    assert isinstance(engine.model, Qwen4Model)
    prompt = _prompt(150)  # 150 tokens: 37 blocks of 4 against a budget of 4 blocks; EOS every 37 tokens,
    prompt[63] = prompt[128] = EOS  # and just before / at chunk starts (the n-gram history crosses chunks)
    ref_logits, ref_ids, margins = _hf_greedy(model, prompt, 6)
    logits, _, _ = _raw_prefill(engine, prompt, "chunked")
    rel = float((logits - ref_logits).norm() / ref_logits.norm())
    print(f"qwen4 vs transformers: relative logits difference {rel:.2e}; least top-2 margin {min(margins):.2e}")
    assert rel < 1e-4
    # equal greedy ids are a property, not a coin flip of the CPU's summation order: every step's top-2 margin
    # is far above the logits' difference (measured: least margin 3.1e-3, largest logit difference 4.2e-7)
    assert min(margins) > 1e-3
    assert _gen(engine, prompt, 6, "chunked")[0] == ref_ids
    with torch.no_grad():  # transformers' own cached decode (indexer keys, PLE history and conv) agrees too
        cached = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
    assert cached.tolist() == ref_ids


# -- modes, state, prefix cache ---------------------------------------------------------------------------

def test_prefill_modes_bitwise_equal(hf):
    _, _, engine = hf
    prompt = _prompt(300, seed=3)  # 5 chunks (the last 44 tokens), 3 layer-major windows
    runs = {m: _raw_prefill(engine, prompt, m) for m in MODES}
    ref = runs["chunked"]
    for m in MODES:
        assert runs[m][1].path == m
        assert torch.equal(runs[m][0], ref[0]), m
        assert _same(runs[m][2], ref[2]), m


def test_streamed_prefill_uploads_ple_rows_before_the_next_bank_copy(hf, monkeypatch):
    """A streamed prefill uploads a PLE layer's rows for the chunks of a layer visit (layer-major: the window;
    chunked: the chunk) between the copy of that layer's bank and the next one's: uploaded inside the layer,
    they waited behind the next layer's whole bank copy on the H200. Bitwise the same as resident, which
    uploads per chunk; rows left by a prefill cancelled mid-layer are dropped at the next one."""
    _, _, engine = hf
    model, store, cfg = engine.model, engine.store, engine.model_config
    events: list[tuple] = []
    upload, issue = model._upload, store._issue_layer
    monkeypatch.setattr(model, "_upload", lambda emb: (events.append(("upload", emb.shape[0])), upload(emb))[1])
    monkeypatch.setattr(store, "_issue_layer", lambda buf, layer: (events.append(("bank", layer)),
                                                                   issue(buf, layer))[1])
    prompt = _prompt(300, seed=3)  # chunks of 64 (the last 44); layer-major windows of 2 chunks
    ref = _raw_prefill(engine, prompt, "resident")
    n_layers, (p0, p1) = cfg.num_hidden_layers, cfg.ple_layers
    for mode, visits in (("layer-major", [(64, 64), (64, 64), (44,)]), ("chunked", [(64,)] * 4 + [(44,)])):
        events.clear()
        out = _raw_prefill(engine, prompt, mode)
        assert torch.equal(out[0], ref[0]) and _same(out[2], ref[2]), mode
        assert not engine.kv.ple_ready  # every row uploaded ahead was used
        banks = [i for i, e in enumerate(events) if e[0] == "bank"]
        assert [events[i][1] for i in banks] == list(range(n_layers)) * len(visits)  # one bank a layer visit
        for v, sizes in enumerate(visits):
            for ple_layer in (p0, p1):
                # the rows go up once the copy of ple_layer's bank is queued and before the next layer's is
                i = v * n_layers + ple_layer
                got = tuple(e[1] for e in events[banks[i] + 1:banks[i + 1]] if e[0] == "upload")
                assert got == sizes, (mode, v, ple_layer, events)
    engine.kv.ple_ready[(p0, 0)] = torch.zeros(1)  # left by a prefill cancelled mid-layer
    assert torch.equal(_raw_prefill(engine, prompt, "resident")[0], ref[0])  # dropped at the next prefill


def test_continuation_equals_one_call_prefill(hf):
    _, _, engine = hf
    prompt = _prompt(256, seed=4)
    one, _, c1 = _raw_prefill(engine, prompt, "layer-major")
    _raw_prefill(engine, prompt[:128], "chunked")
    two, _, c2 = _raw_prefill(engine, prompt, "layer-major", start=128)
    assert torch.equal(one, two) and _same(c1, c2)


def test_prefix_cache_and_decode_are_deterministic(hf):
    _, _, engine = hf
    engine.reset()
    prompt = _prompt(200, seed=5)
    a, _ = _gen(engine, prompt, 5, "layer-major")
    b, bstats = _gen(engine, prompt + a[:3], 5, "chunked")
    engine.reset()
    c, cstats = _gen(engine, prompt + a[:3], 5, "demand")
    assert bstats.cached_prompt_tokens == len(prompt) and cstats.cached_prompt_tokens == 0
    assert b == c  # a continuation from the prefix-cache snapshot equals a cold prefill
    assert a[3:] == b[:2]  # decode carried the same states as a prefill would


def test_tiny_preset_runs_in_every_mode():
    eng = Engine(EngineConfig(model="qwen4-exp-tiny", weights="random:0", **{**KNOBS, "max_context": 512}))
    prompt = _prompt(140, seed=6, vocab=1000, eos_every=50)
    outs = {m: _gen(eng, prompt, 3, m)[0] for m in ("chunked", "layer-major", "demand")}
    assert len(set(map(tuple, outs.values()))) == 1
    eng.reset()
    short = _gen(eng, prompt[:5], 3, "chunked")[0]  # shorter than one indexer block: no compressed key yet
    eng.reset()
    assert _gen(eng, prompt[:5] + short[:1], 2, "demand")[0] == short[1:]


def test_indexer_ties_pick_the_lower_block_in_every_mode_and_in_decode(hf):
    """With the indexer's projection zeroed every block scores 0: each query keeps blocks 0..k-1 and its tail,
    whatever the chunking, the mode or decode."""
    _, _, engine = hf
    cfg, model = engine.model_config, engine.model
    c, k = cfg.indexer_compress_ratio, cfg.block_topk
    q = torch.zeros(3, cfg.indexer_n_heads, cfg.indexer_head_dim)  # [T, Hi, Di]
    ck = torch.randn(40, cfg.indexer_head_dim)  # [nb, Di]
    pos = torch.tensor([10, 70, 150])  # [T]: all blocks (fewer than k complete), then sparse
    vis = model._select(q, ck, pos, 160)  # [T, L]
    for t, p in enumerate(pos.tolist()):
        done = (p + 1) // c
        want = [j for j in range(160) if j <= p and (j // c < k or j // c >= done)]
        assert torch.nonzero(vis[t]).flatten().tolist() == want
    layer = cfg.attention_layers[0]
    aw = model.w.layers[layer].mixer
    saved = aw.index_qk.clone()
    try:
        aw.index_qk.zero_()
        prompt = _prompt(300, seed=7)
        runs = {m: _raw_prefill(engine, prompt, m) for m in MODES}
        assert all(torch.equal(r[0], runs["chunked"][0]) and _same(r[2], runs["chunked"][2]) for r in runs.values())
        engine.reset()
        ids, _ = _gen(engine, prompt, 4, "chunked")
        engine.reset()
        longer, _ = _gen(engine, prompt + ids[:2], 2, "layer-major")
        assert longer == ids[2:]  # decode's selection agrees with prefill's
    finally:
        aw.index_qk.copy_(saved)


def test_gpucheck_hybrid_runs_qwen4_on_cpu(capsys):
    from abbench.engine.tools import gpucheck_hybrid
    assert gpucheck_hybrid.main(["--device", "cpu", "--model", "qwen4-exp-tiny", "--tokens", "200",
                                 "--repeats", "1"]) == 0
    assert "qwen4-exp-tiny" in capsys.readouterr().out
