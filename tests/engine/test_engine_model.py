"""The vendored engine's model: configuration, weights, numerics against transformers, sampling.

Reference: transformers' own ``Qwen3MoeForCausalLM`` (installed in the venv), random-initialised at a tiny
shape, saved with ``save_pretrained`` and loaded by ``abbench.engine.models.weights``. No network, no hub.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from abbench.engine import PRESETS, EngineConfig, ModelConfig  # noqa: E402
from abbench.engine.models.bank import ExpertBank  # noqa: E402
from abbench.engine.ops.moe import looped_mm, moe_experts  # noqa: E402
from abbench.engine.runtime.prefill import prefill  # noqa: E402
from abbench.engine.serve.reference import random_qwen3_moe  # noqa: E402
from abbench.engine.contract import ContextOverflow, GenerateRequest  # noqa: E402
from abbench.engine.runtime.engine import Engine  # noqa: E402
from abbench.engine.models.weights import load_checkpoint  # noqa: E402

HF_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                max_position_embeddings=256, rope_theta=10000.0)


def _hf_model(tmp: Path, *, norm_topk_prob: bool, tie: bool, seed: int = 0):
    """A random transformers Qwen3MoeForCausalLM saved with save_pretrained into ``tmp``.

    Weights are redrawn so that every tensor matters: matrices N(0, 1/fan_in), embeddings N(0, 1), RMSNorm
    weights 1 + N(0, 0.2^2) (a swapped or ignored norm would show), the lm_head independent unless tied."""
    cfg = transformers.Qwen3MoeConfig(**HF_SHAPE, norm_topk_prob=norm_topk_prob, tie_word_embeddings=tie,
                                      eos_token_id=None)
    model = random_qwen3_moe(cfg, seed)
    model.save_pretrained(tmp)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_qwen3moe")
    model = _hf_model(tmp, norm_topk_prob=True, tie=False)
    return tmp, model


def _hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]))
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):], margins


# -- configuration ----------------------------------------------------------------------------------------

def test_from_hf_config_reads_transformers5_config(hf_dir):
    tmp, model = hf_dir
    mc = ModelConfig.from_hf_config(tmp)
    assert (mc.num_experts, mc.num_experts_per_tok, mc.head_dim, mc.num_hidden_layers) == (8, 2, 16, 3)
    assert mc.rope_theta == 10000.0  # from rope_parameters (transformers 5) rather than rope_theta
    assert mc.norm_topk_prob is True and mc.tie_word_embeddings is False
    raw = json.loads((tmp / "config.json").read_text())
    assert "num_local_experts" in raw  # what transformers 5 writes for num_experts


def test_from_hf_config_rejects_other_models_and_dense_layers(tmp_path):
    base = dict(HF_SHAPE, model_type="qwen3_moe", num_experts=8)
    cases = [({"model_type": "qwen3"}, "model_type"), ({"mlp_only_layers": [1]}, "dense"),
             ({"decoder_sparse_step": 2}, "dense"), ({"use_sliding_window": True}, "sliding"),
             ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope")]
    for override, word in cases:
        (tmp_path / "config.json").write_text(json.dumps(base | override))
        with pytest.raises(ValueError, match=word):
            ModelConfig.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base | {"mlp_only_layers": [], "decoder_sparse_step": 1}))
    assert ModelConfig.from_hf_config(tmp_path).num_experts == 8


def test_presets_match_the_models_they_name():
    big, half, tiny = PRESETS["qwen3-30b-a3b"], PRESETS["qwen3-30b-a3b-half"], PRESETS["tiny"]
    assert (big.num_hidden_layers, big.num_experts, big.num_experts_per_tok, big.hidden_size) == (48, 128, 8, 2048)
    assert (big.moe_intermediate_size, big.num_attention_heads, big.num_key_value_heads, big.head_dim) == (768, 32,
                                                                                                          4, 128)
    assert (big.vocab_size, big.rope_theta, big.max_position_embeddings) == (151936, 1e6, 40960)
    assert big.bank_bytes(2) == 57_982_058_496  # 48 x 128 x 3 x 2048 x 768 x 2 bytes (bf16): the "58 GB"
    assert half.num_hidden_layers == 24 and half.bank_bytes(2) * 2 == big.bank_bytes(2)
    assert tiny.vocab_size == 151936 and tiny.eos_ids == {151645}  # the Qwen3 tokenizer's vocabulary and eos


def test_first_layers_cuts_every_per_layer_field():
    """The checks that run part of a model at full width cut it here; a hybrid's layer kinds and Qwen4-Exp's PLE
    layers go with the depth (gpucheck_fp8 once cut the depth alone, and the hybrid refused to build)."""
    hybrid = PRESETS["qwen3.5-35b-a3b"].first_layers(20)
    assert hybrid.num_hidden_layers == 20 and hybrid.layer_types == PRESETS["qwen3.5-35b-a3b"].layer_types[:20]
    assert hybrid.bank_bytes(2) * 2 == PRESETS["qwen3.5-35b-a3b"].bank_bytes(2)
    qwen4 = PRESETS["qwen4-exp"].first_layers(1, name="one")
    assert (qwen4.name, qwen4.num_hidden_layers, qwen4.ple_layer_ids) == ("one", 1, (1,))
    assert PRESETS["tiny"].first_layers(99) == PRESETS["tiny"].first_layers(4)  # at most every layer
    assert PRESETS["tiny"].first_layers(2).name == "tiny[:2]"

def test_engine_config_defaults_depend_on_device():
    r = EngineConfig(model="tiny").resolved()
    assert r.dtype == "float32" and r.max_context == 40960 and r.expert_slots_per_layer is None
    assert EngineConfig(model="qwen3-30b-a3b", device="cuda").resolved().dtype == "bfloat16"
    with pytest.raises(ValueError, match="prefill_mode"):
        EngineConfig(prefill_mode="fast")
    with pytest.raises(ValueError, match="expert_slots_per_layer"):
        EngineConfig(model="tiny", expert_slots_per_layer=2).resolved()  # fewer than top_k = 4
    with pytest.raises(ValueError, match="expert_slots_per_layer"):
        EngineConfig(model="tiny", expert_slots_per_layer=17).resolved()  # more than the 16 experts


# -- weights ----------------------------------------------------------------------------------------------

def test_checkpoint_loads_per_expert_and_fused_layouts_identically(hf_dir, tmp_path):
    """save_pretrained (transformers 5) writes per-expert keys; a raw state_dict dump has the fused
    [E, 2I, H] / [E, H, I] tensors. Both must fill the bank with the same bits."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tmp, model = hf_dir
    with safe_open(str(tmp / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tmp / "config.json").read_text())
    mc = ModelConfig.from_hf_config(tmp)
    banks = []
    for path in (tmp, tmp_path):
        bank = ExpertBank(mc, torch.float32, pin=False)
        dense = load_checkpoint(path, mc, bank, torch.device("cpu"), torch.float32)
        banks.append((bank, dense))
    (b1, d1), (b2, d2) = banks
    for layer in range(mc.num_hidden_layers):
        assert torch.equal(b1.gate_up[layer], b2.gate_up[layer]) and torch.equal(b1.down[layer], b2.down[layer])
        assert torch.equal(d1.layers[layer].router, d2.layers[layer].router)
    hf_experts = model.model.layers[1].mlp.experts
    assert torch.equal(b1.gate_up[1], hf_experts.gate_up_proj) and torch.equal(b1.down[1], hf_experts.down_proj)


def test_checkpoint_shape_mismatch_names_the_tensor(hf_dir):
    tmp, _ = hf_dir
    wrong = dataclasses.replace(ModelConfig.from_hf_config(tmp), moe_intermediate_size=48)
    bank = ExpertBank(wrong, torch.float32, pin=False)
    with pytest.raises(ValueError, match="experts.0.gate_proj"):
        load_checkpoint(tmp, wrong, bank, torch.device("cpu"), torch.float32)


def test_random_weights_are_deterministic_per_seed_and_independent_of_depth():
    mc = dataclasses.replace(PRESETS["tiny"], vocab_size=1000)
    a = Engine(EngineConfig(model=mc, weights="random:3", max_context=64, bandwidth_probe_bytes=0))
    b = Engine(EngineConfig(model=mc, weights="random:3", max_context=64, bandwidth_probe_bytes=0))
    c = Engine(EngineConfig(model=mc, weights="random:4", max_context=64, bandwidth_probe_bytes=0))
    shallow = Engine(EngineConfig(model=dataclasses.replace(mc, num_hidden_layers=2), weights="random:3",
                                  max_context=64, bandwidth_probe_bytes=0))
    for layer in range(4):
        assert torch.equal(a.store.bank.gate_up[layer], b.store.bank.gate_up[layer])
        assert torch.equal(a.model.w.layers[layer].q_proj, b.model.w.layers[layer].q_proj)
        assert not torch.equal(a.store.bank.down[layer], c.store.bank.down[layer])
    # layer l's weights depend on (seed, l) only: the 24-layer preset is the 48-layer one's first half
    assert torch.equal(shallow.store.bank.down[1], a.store.bank.down[1])
    assert torch.equal(shallow.model.w.embed, a.model.w.embed)


# -- numerics ---------------------------------------------------------------------------------------------

def test_grouped_mm_matches_per_expert_loop():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(37, 64, generator=gen)  # [T, H]
    ids = torch.randint(0, 8, (37, 2), generator=gen)  # [T, k]
    w = torch.softmax(torch.randn(37, 2, generator=gen), -1)  # [T, k]
    gate_up, down = torch.randn(8, 64, 64, generator=gen) / 8, torch.randn(8, 64, 32, generator=gen) / 6
    grouped = moe_experts(h, w, ids, gate_up, down)
    looped = moe_experts(h, w, ids, gate_up, down, mm=looped_mm)
    ref = torch.zeros_like(h)  # the textbook definition, token by token
    for t in range(37):
        for j in range(2):
            e = int(ids[t, j])
            g, u = (gate_up[e] @ h[t]).chunk(2)
            ref[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(grouped, looped, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grouped, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob,tie", [(True, False), (False, True)])
def test_logits_and_greedy_tokens_match_transformers(tmp_path, norm_topk_prob, tie):
    """Last-position logits of our chunked prefill against transformers' full forward, and 8 greedy tokens.

    Tolerance: fp32 on CPU, max |diff| <= 2e-5 x max |logit|. Both sides compute the same float32 math in
    different orders: SDPA over 16-token chunks against a cached prefix vs one causal SDPA call, the MoE
    combine summed over the k slots vs index_add per expert, grouped vs per-expert GEMMs. Each reordering
    costs ~1e-7 relative (float32 epsilon 1.2e-7), accumulated through 3 layers; measured here: 1.7e-6 on
    logits of max 3.0 (5.5e-7 relative) and 7.6e-6 on max 64 (tied embeddings, 1.2e-7 relative). The bound
    leaves a 20-150x margin and stays 1000x below what a real bug (a wrong RoPE angle, norm, mask offset
    or routing weight) produces, >= 1e-2 relative. Greedy tokens must be identical; the top-2 margins are
    asserted far above the tolerance so an equal sequence is meaningful and not a coin flip."""
    model = _hf_model(tmp_path, norm_topk_prob=norm_topk_prob, tie=tie)
    engine = Engine(EngineConfig(weights=str(tmp_path), chunk_tokens=16, max_context=128, bandwidth_probe_bytes=0))
    assert engine.model_config.tie_word_embeddings is tie
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 512, (45,), generator=gen).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1]
    ours, stats = prefill(engine.model, engine.store, engine.kv, torch.tensor(prompt), 0, "chunked",
                          chunk_tokens=16, window_tokens=64, demand_max_tokens=8)
    assert stats.n_chunks == 3
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= 2e-5 * scale, (err, scale)
    hf_tokens, margins = _hf_greedy(model, prompt, 8)
    events, _ = engine.run(prompt, 8)
    assert [e.token_id for e in events] == hf_tokens
    assert min(margins) > 1e-2


def test_sampling_is_reproducible_with_a_seed_and_logprobs_are_consistent():
    mc = dataclasses.replace(PRESETS["tiny"], vocab_size=2000)
    engine = Engine(EngineConfig(model=mc, max_context=256, chunk_tokens=32, bandwidth_probe_bytes=0))
    prompt = list(range(10, 60))
    a, _ = engine.run(prompt, 6, temperature=1.0, seed=11)
    b, _ = engine.run(prompt, 6, temperature=1.0, seed=11)
    c, _ = engine.run(prompt, 6, temperature=1.0, seed=12)
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert [e.token_id for e in a] != [e.token_id for e in c]
    greedy, stats = engine.run(prompt, 4, logprobs=3)
    assert stats.completion_tokens == 4 and stats.finish_reason == "length"
    for e in greedy:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0][0] == e.token_id and e.top_logprobs[0][1] == e.logprob  # argmax is the top-1
        assert e.logprob <= 0 and [v for _, v in e.top_logprobs] == sorted((v for _, v in e.top_logprobs),
                                                                            reverse=True)
    assert greedy[0].logprob is not None and a[0].logprob is None


def test_eos_stops_unless_ignored_and_context_overflow_is_eager():
    mc = dataclasses.replace(PRESETS["tiny"], vocab_size=2000, eos_token_id=None)
    prompt = list(range(300, 340))
    free, _ = Engine(EngineConfig(model=mc, max_context=128, bandwidth_probe_bytes=0)).run(prompt, 5)
    eos = free[2].token_id  # make the 3rd greedy token the eos of an otherwise identical model
    engine = Engine(EngineConfig(model=dataclasses.replace(mc, eos_token_id=eos), max_context=128,
                                 bandwidth_probe_bytes=0))
    events, stats = engine.run(prompt, 5)
    assert [e.token_id for e in events] == [e.token_id for e in free[:3]]
    assert (stats.finish_reason, stats.completion_tokens) == ("stop", 3)
    events, stats = engine.run(prompt, 5, ignore_eos=True)
    assert [e.token_id for e in events] == [e.token_id for e in free] and stats.finish_reason == "length"
    with pytest.raises(ContextOverflow, match="40 tokens.*max_tokens 89.*129.*128"):
        engine.generate(GenerateRequest(prompt, 89))  # raised at the call, before the generator starts any work
    assert engine.run(prompt, 1)[1].prompt_tokens == 40
