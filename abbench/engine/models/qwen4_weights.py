"""Weights of the Qwen4-Exp text decoder: seeded random initialisation, or a local checkpoint (safetensors).

Contract (as ``weights`` for the other models):
- ``random_qwen4_weights(cfg, seed, bank, device, dtype) -> Qwen4Weights``: every tensor drawn with a generator
  seeded per (seed, layer, tensor kind); matrices N(0, 1/fan_in), the embedding and the PLE tables N(0, 1),
  the convs N(0, 1/K), zero-centred norm weights zeros (scale 1), the gated norm ones, dt_bias ones, A_log
  log(U(1, 16)); the routed experts go one layer at a time into the host ``bank``. The PLE tables are drawn
  and kept on the host (``cfg.ngram_vocab_size_base`` sets their size; see the presets).
- ``load_qwen4_checkpoint(path, cfg, bank, device, dtype) -> Qwen4Weights``: the keys of
  ``Qwen4ExpForCausalLM`` (``model.`` prefix) or of ``Qwen4ExpForConditionalGeneration``
  (``model.language_model.``); routed experts per expert or fused; a PLE table either whole
  (``ple.ple_embedding.ngram_embedding.weight``) or in the row shards ``save_pretrained`` writes
  (``...ngram_embedding.shard_{i}.weight``, concatenated in order) and kept on the host in ``dtype``. The
  n-gram hash multipliers and head sizes are derived from the config (as transformers does), not read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from abbench.engine.config import Qwen4Config
from abbench.engine.models.bank import ExpertBank
from abbench.engine.models.qwen4 import (
    IndexedAttnWeights, MixerWeights, PLEWeights, Qwen4LayerWeights, Qwen4Weights, ngram_head_sizes,
    ngram_multipliers, ple_table_rows,
)
from abbench.engine.models.weights import (
    Draw, Checkpoint, load_experts, layer_seed, load_embed_and_head, load_linear_mixer, random_linear_mixer,
)

# Tensor kinds for seeding (the hybrid's kinds 0..18 keep their meaning).
(_EMBED, _LM_HEAD, _Q, _K, _V, _O, _ROUTER, _GATE_UP, _DOWN, _QKV, _Z, _B, _A, _CONV, _ALOG, _OUT, _SH_GATE_UP,
 _SH_DOWN, _SH_GATE) = range(19)
_HC_DOWN, _HC_UP, _HC_INJ, _IDX, _PLE_TABLE, _PLE_KEY, _PLE_VALUE, _PLE_CONV = range(19, 27)
_MLP_MIX = 8  # added to the mixer kinds for the MoE mixer; the final mixer uses layer -1


def _ple_static(cfg: Qwen4Config, index: int):
    """Hash multipliers, head sizes and offsets of PLE layer number ``index`` (host tensors: PLE hashes there)."""
    sizes = ngram_head_sizes(cfg, index)
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    mult = ngram_multipliers(cfg.vocab_size, cfg.ngram_size, index, cfg.seed)
    as_t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return as_t(mult), as_t(sizes), as_t(offsets)


def random_qwen4_weights(cfg: Qwen4Config, seed: int, bank: ExpertBank, device: torch.device,
                         dtype: torch.dtype) -> Qwen4Weights:
    draw = Draw(seed, device, dtype)
    normal, const = draw.normal, draw.const
    host_gen = torch.Generator(device="cpu")

    h, d, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    hq, hkv, i_s = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.shared_expert_intermediate_size
    w, r, hc, p = cfg.stream_width, cfg.hc_lowrank, cfg.hc_count, cfg.ple_embed_dim
    di, hi = cfg.indexer_head_dim, cfg.indexer_n_heads

    def mixer(layer: int, off: int, injection: bool) -> MixerWeights:
        return MixerWeights(norm=const(w, 0.0), down=normal((r, w), layer, _HC_DOWN + off),
                            up=normal((w, r), layer, _HC_UP + off),
                            inject=normal((hc, w), layer, _HC_INJ + off) if injection else None)

    layers = []
    for l in range(cfg.num_hidden_layers):
        if cfg.layer_types[l] == "full_attention":
            mx = IndexedAttnWeights(
                q_proj=normal((hq * 2 * d, h), l, _Q), k_proj=normal((hkv * d, h), l, _K),
                v_proj=normal((hkv * d, h), l, _V), o_proj=normal((h, hq * d), l, _O), q_norm=const(d, 0.0),
                k_norm=const(d, 0.0), index_qk=normal(((hi + 1) * di, h), l, _IDX), index_q_norm=const(di, 0.0),
                index_k_norm=const(di, 0.0))
        else:
            mx = random_linear_mixer(cfg, draw, l)
        ple = None
        if l in cfg.ple_layers:
            index = cfg.ple_layers.index(l)
            host_gen.manual_seed(layer_seed(seed, l, _PLE_TABLE))
            table = torch.randn(ple_table_rows(cfg, index), p // cfg.ngram_heads, generator=host_gen).to(dtype)
            mult, sizes, offsets = _ple_static(cfg, index)
            ple = PLEWeights(table=table, multipliers=mult, head_sizes=sizes, head_offsets=offsets,
                             key_proj=normal((w, p), l, _PLE_KEY), value_proj=normal((h, p), l, _PLE_VALUE),
                             norm_key=const(w, 0.0), norm_query=const(w, 0.0), norm_conv=const(w, 0.0),
                             conv=normal((w, cfg.ple_conv_kernel_size), l, _PLE_CONV))
        layers.append(Qwen4LayerWeights(
            attn_mix=mixer(l, 0, True), mixer=mx, mlp_mix=mixer(l, _MLP_MIX, True),
            router=normal((e, h), l, _ROUTER), shared_gate_up=normal((2 * i_s, h), l, _SH_GATE_UP),
            shared_down=normal((h, i_s), l, _SH_DOWN), shared_gate=normal((1, h), l, _SH_GATE), ple=ple))
        bank.put_layer(l, normal((e, 2 * i, h), l, _GATE_UP), normal((e, h, i), l, _DOWN))  # a layer at a time
    embed = normal((cfg.vocab_size, h), -1, _EMBED, std=1.0)
    lm_head = embed if cfg.tie_word_embeddings else normal((cfg.vocab_size, h), -1, _LM_HEAD)
    return Qwen4Weights(embed=embed, layers=layers, final_mix=mixer(-1, 0, False), lm_head=lm_head)


def load_qwen4_checkpoint(path: str | Path, cfg: Qwen4Config, bank: ExpertBank, device: torch.device,
                          dtype: torch.dtype) -> Qwen4Weights:
    ck = Checkpoint(Path(path))
    root = "model.language_model." if "model.language_model.embed_tokens.weight" in ck else "model."
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv, i_s = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.shared_expert_intermediate_size
    w, r, hc, p = cfg.stream_width, cfg.hc_lowrank, cfg.hc_count, cfg.ple_embed_dim
    di, hi = cfg.indexer_head_dim, cfg.indexer_n_heads

    def dev(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        return ck.get(key, shape).to(device=device, dtype=dtype)

    def mixer(q: str, injection: bool) -> MixerWeights:
        return MixerWeights(norm=dev(q + "hc_norm.weight", (w,)), down=dev(q + "input_mix_weight_down.weight", (r, w)),
                            up=dev(q + "input_mix_weight_up.weight", (w, r)),
                            inject=dev(q + "block_inject_weight.weight", (hc, w)) if injection else None)

    def table(q: str, rows: int) -> torch.Tensor:
        cols = p // cfg.ngram_heads
        if q + "weight" in ck:
            return ck.get(q + "weight", (rows, cols)).to(dtype)
        parts, n = [], 0
        while f"{q}shard_{n}.weight" in ck:
            key = f"{q}shard_{n}.weight"
            parts.append(ck.where[key].get_tensor(key).to(dtype))
            n += 1
        if not parts:
            raise ValueError(f"{path}: tensor {q + 'weight'!r} (or its shards) is missing")
        t = torch.cat(parts)  # [rows, cols]
        if tuple(t.shape) != (rows, cols):
            raise ValueError(f"{path}: {q}shard_* concatenate to {tuple(t.shape)}, the config says {(rows, cols)}")
        return t

    layers = []
    for l in range(cfg.num_hidden_layers):
        pre = f"{root}layers.{l}."
        if cfg.layer_types[l] == "full_attention":
            a = pre + "self_attn."
            mx = IndexedAttnWeights(
                q_proj=dev(a + "q_proj.weight", (hq * 2 * d, h)), k_proj=dev(a + "k_proj.weight", (hkv * d, h)),
                v_proj=dev(a + "v_proj.weight", (hkv * d, h)), o_proj=dev(a + "o_proj.weight", (h, hq * d)),
                q_norm=dev(a + "q_norm.weight", (d,)), k_norm=dev(a + "k_norm.weight", (d,)),
                index_qk=dev(a + "indexer.index_qk_proj.weight", ((hi + 1) * di, h)),
                index_q_norm=dev(a + "indexer.q_layernorm.weight", (di,)),
                index_k_norm=dev(a + "indexer.k_layernorm.weight", (di,)))
        else:
            mx = load_linear_mixer(cfg, dev, pre + "linear_attn.")
        ple = None
        if l in cfg.ple_layers:
            index = cfg.ple_layers.index(l)
            q = pre + "ple."
            mult, sizes, offsets = _ple_static(cfg, index)
            ple = PLEWeights(table=table(q + "ple_embedding.ngram_embedding.", ple_table_rows(cfg, index)),
                             multipliers=mult, head_sizes=sizes, head_offsets=offsets,
                             key_proj=dev(q + "key_proj.weight", (w, p)),
                             value_proj=dev(q + "value_proj.weight", (h, p)),
                             norm_key=dev(q + "norm_key.weight", (w,)), norm_query=dev(q + "norm_query.weight", (w,)),
                             norm_conv=dev(q + "norm_conv.weight", (w,)),
                             conv=dev(q + "conv1d.weight", (w, 1, cfg.ple_conv_kernel_size))[:, 0].contiguous())
        s = pre + "mlp.shared_expert."
        layers.append(Qwen4LayerWeights(
            attn_mix=mixer(pre + "attn_hyper_connection.", True), mixer=mx,
            mlp_mix=mixer(pre + "mlp_hyper_connection.", True),
            router=dev(pre + "mlp.gate.weight", (cfg.num_experts, h)),
            shared_gate_up=torch.cat([dev(s + "gate_proj.weight", (i_s, h)), dev(s + "up_proj.weight", (i_s, h))]),
            shared_down=dev(s + "down_proj.weight", (h, i_s)),
            shared_gate=dev(pre + "mlp.shared_expert_gate.weight", (1, h)), ple=ple))
        load_experts(ck, pre, l, cfg, bank)
    embed, lm_head = load_embed_and_head(ck, dev, root, cfg, path)
    return Qwen4Weights(embed=embed, layers=layers, final_mix=mixer(root + "hyper_connection_mixer.", False),
                        lm_head=lm_head)
