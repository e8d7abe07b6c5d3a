"""The Qwen3.5/3.6-MoE text decoder (Gated DeltaNet + gated attention hybrid), one request at a time.

Contract:
- ``HybridModel`` has the interface of ``model.Model`` that ``prefill`` and ``decode`` drive:
  ``embed(ids)``, ``attn_block(layer, x, cache, start) -> (x, h, top_w, top_ids)``,
  ``moe_block(x, h, top_w, top_ids, gate_up, down)``, ``logits(x_last)``, plus the static-shape decode step
  ``decode_attn_block(layer, x, cache, pos_t, kv_len)``. The layer type is dispatched inside ``attn_block``:
  * "full_attention": gated attention. q_proj gives each head's query and gate ([Hq, 2D]: query then gate),
    zero-centred RMSNorm on q and k, RoPE on the first ``rotary_dim`` dims of each head (partial RoPE; with
    text-only positions transformers' M-RoPE is plain RoPE), SDPA over the KV cache with the same masks as
    ``Model``, output times sigmoid(gate), o_proj. KV at positions [start, start+T).
  * "linear_attention": Gated DeltaNet (``gdn``). in_proj_qkv / z / b / a, the causal conv (kernel K) with
    SiLU on the pre-split qkv continuing from the layer's conv state, g = -exp(A_log) * softplus(a + dt_bias)
    in float32, beta = sigmoid(b), the gated delta rule continuing from the layer's float32 recurrent state,
    gated RMSNorm times silu(z), out_proj. Both states are rewritten for the position after the chunk.
    At ``start == 0`` the states are taken as zeros (a sequence start), whatever the cache holds; at
    ``start > 0`` the cache must hold the states at exactly ``start`` (the caller's job: the prefix cache
    restores a snapshot).
  Then zero-centred RMSNorm (scale 1 + w), the softmax top-k router (renormalised) and the shared expert:
  ``attn_block`` returns x = (x + mixer(x)) + sigmoid(shared_expert_gate(h)) * shared_expert(h), and
  ``moe_block`` adds the routed experts (``model.moe_experts``, the bank layout of ``ExpertBank``). So the
  layer output is ((x + mixer) + shared) + routed in every mode and in decode: one fixed order. The shared
  expert is a dense weight on the device; the routed experts are the only offloaded weights.
- ``HybridCache``: KV per full-attention layer ([Hkv, S, D], as ``KVCache``), per linear layer a conv state
  [C, K-1] in the model dtype and a recurrent state [Hv, Dk, Dv] in float32. ``snapshot()`` / ``restore()``
  copy the states (not the KV, which stays valid per position) to/from a second set of buffers: the prefix
  cache resumes a continuation bit for bit from the end of the cached prompt.
- Chunks of one layer must run in position order (every prefill mode does), and chunk lengths must be
  multiples of ``gdn.BLOCK`` except the last (the engine validates ``chunk_tokens``); then chunked,
  layer-major, demand and resident call the same functions with the same shapes and are bitwise equal. A
  prefill may start at any position (a prefix-cache hit): every mode plans its chunks from the same start,
  and a prompt prefilled in two calls split at a multiple of ``chunk_tokens`` even equals the one-call
  prefill bit for bit (the same chunks).
- Numerics follow transformers' ``Qwen3_5MoeForCausalLM``: zero-centred RMSNorm computes (x * rsqrt) * (1 + w)
  in float32 then casts; the gated RMSNorm applies its weight in the model dtype; RoPE tables are float32
  angles cast to the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from abbench.engine.ops import gdn
from abbench.engine.config import HybridConfig
from abbench.engine.ops.kernels import rms_norm as fused_rms_norm
from abbench.engine.models.base import ModelCache, MoEModel
from abbench.engine.ops.dense import decode_attend, lower_right_causal, rope_tables, rotate_half
from abbench.engine.ops.moe import decode_route, expert_kernel, route


@dataclass
class AttnWeights:
    """Gated full attention (nn.Linear layout [out, in])."""

    q_proj: torch.Tensor  # [Hq*2D, H] per head: D query rows then D gate rows
    k_proj: torch.Tensor  # [Hkv*D, H]
    v_proj: torch.Tensor  # [Hkv*D, H]
    o_proj: torch.Tensor  # [H, Hq*D]
    q_norm: torch.Tensor  # [D] zero-centred
    k_norm: torch.Tensor  # [D] zero-centred


@dataclass
class LinearWeights:
    """Gated DeltaNet."""

    in_proj_qkv: torch.Tensor  # [C, H], C = 2*Hk*Dk + Hv*Dv (q, k, v)
    in_proj_z: torch.Tensor  # [Hv*Dv, H]
    in_proj_b: torch.Tensor  # [Hv, H]
    in_proj_a: torch.Tensor  # [Hv, H]
    conv: torch.Tensor  # [C, K] depthwise
    dt_bias: torch.Tensor  # [Hv]
    A_log: torch.Tensor  # [Hv]
    norm: torch.Tensor  # [Dv] gated RMSNorm weight (not zero-centred)
    out_proj: torch.Tensor  # [H, Hv*Dv]


@dataclass
class HybridLayerWeights:
    input_norm: torch.Tensor  # [H] zero-centred
    mixer: AttnWeights | LinearWeights
    post_norm: torch.Tensor  # [H] zero-centred
    router: torch.Tensor  # [E, H]
    shared_gate_up: torch.Tensor  # [2Is, H] gate rows then up rows
    shared_down: torch.Tensor  # [H, Is]
    shared_gate: torch.Tensor  # [1, H]


@dataclass
class HybridWeights:
    """Everything but the routed experts. ``lm_head`` is ``embed`` itself when tied."""

    embed: torch.Tensor  # [V, H]
    layers: list[HybridLayerWeights]
    norm: torch.Tensor  # [H] zero-centred
    lm_head: torch.Tensor  # [V, H]


class HybridCache(ModelCache):
    """KV of the full-attention layers and the conv/recurrent states of the linear layers (see the module
    docstring). ``k``/``v`` list the attention layers in order; ``slot[layer]`` is a layer's index there
    (attention layers) or in ``conv``/``rec`` (linear layers)."""

    def __init__(self, cfg: HybridConfig, max_context: int, device: torch.device, dtype: torch.dtype):
        self.max_context = max_context
        self.slot = {l: i for i, l in enumerate(cfg.attention_layers)}
        self.slot.update({l: i for i, l in enumerate(cfg.linear_layers)})
        kv_shape = (cfg.num_key_value_heads, max_context, cfg.head_dim)
        n_attn, n_lin = len(cfg.attention_layers), len(cfg.linear_layers)
        self.k = [torch.zeros(kv_shape, device=device, dtype=dtype) for _ in range(n_attn)]
        self.v = [torch.zeros(kv_shape, device=device, dtype=dtype) for _ in range(n_attn)]
        conv_shape = (cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
        rec_shape = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.conv = [torch.zeros(conv_shape, device=device, dtype=dtype) for _ in range(n_lin)]
        self.rec = [torch.zeros(rec_shape, device=device, dtype=torch.float32) for _ in range(n_lin)]
        self._saved_conv = [torch.zeros_like(t) for t in self.conv]
        self._saved_rec = [torch.zeros_like(t) for t in self.rec]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.conv + self.rec)

    def states(self) -> list[torch.Tensor]:
        """The live conv and recurrent states (for tests)."""
        return self.conv + self.rec

    def snapshot(self) -> None:
        """Copy the live states into the snapshot buffers."""
        for dst, src in zip(self._saved_conv + self._saved_rec, self.conv + self.rec, strict=True):
            dst.copy_(src)

    def restore(self) -> None:
        """Copy the snapshot back into the live states."""
        for dst, src in zip(self.conv + self.rec, self._saved_conv + self._saved_rec, strict=True):
            dst.copy_(src)

    def clear(self) -> None:
        for t in self.conv + self.rec + self._saved_conv + self._saved_rec:
            t.zero_()


def zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: (x / rms(x)) * (1 + w) in float32, cast back to x's dtype."""
    xf = x.float()  # [..., N]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., N]
    return (xf * (1.0 + weight.float())).to(x.dtype)  # [..., N]


def causal_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                gqa: bool) -> torch.Tensor:
    """Causal attention of q [Hq, T, D] at the last T positions of keys, values [Hkv, S, D] -> [1, Hq, T, D]
    (one query: no mask; T == S: ``is_causal``; else the lower-right causal mask)."""
    T, S = q.shape[1], keys.shape[1]
    kw = dict(scale=scale, enable_gqa=gqa)
    if T == 1:  # one query sees the whole prefix
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], **kw)
    if T == S:
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True, **kw)
    return F.scaled_dot_product_attention(q[None], keys[None], values[None],
                                          attn_mask=lower_right_causal(T, S, q.device), **kw)  # [1, Hq, T, D]


def attention_batching_exact(cfg: HybridConfig, chunk: int, k: int, starts: list[int], device: torch.device,
                             dtype: torch.dtype, scale: float) -> bool:
    """Whether one ``causal_sdpa`` call over ``k`` adjacent ``chunk``-token chunks gives every query row bit for
    bit what each chunk's own call gives, on this device and dtype, for groups starting at each of ``starts``
    (random queries, keys and values with the model's head shapes; the caller runs it inside
    ``attention_backends()``). The attention kernels compute each row from its own query and the keys up to
    its position, in key blocks counted from position 0, so this holds unless the kernel splits the keys
    differently for the two calls (FlashAttention does so only for calls too small to fill the device)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for s in starts:
        end = s + k * chunk
        q = torch.randn(hq, k * chunk, d, generator=gen).to(device, dtype)  # [Hq, kT, D]
        keys = torch.randn(hkv, end, d, generator=gen).to(device, dtype)  # [Hkv, S, D]
        values = torch.randn(hkv, end, d, generator=gen).to(device, dtype)  # [Hkv, S, D]
        whole = causal_sdpa(q, keys, values, scale, hq != hkv)  # [1, Hq, kT, D]
        for c in range(k):
            a, b = c * chunk, (c + 1) * chunk
            part = causal_sdpa(q[:, a:b], keys[:, :s + b], values[:, :s + b], scale, hq != hkv)  # [1, Hq, T, D]
            if not torch.equal(whole[:, :, a:b], part):
                return False
    return True


class HybridModel(MoEModel):
    """Dense weights, RoPE tables and the layer functions of a ``HybridConfig`` model; stateless between
    calls except for the cache passed in. Its trace adds the shared expert; its MoE half is
    :class:`~abbench.engine.models.base.MoEModel`'s (the routed experts) after the shared expert."""

    # decode's kernels (set by the Decoder, as Model's): "triton" for the norms around the mixer and the attention
    # layers' attention, and for the router's softmax and top-k; they apply: the MoE block is the routed experts
    triton_decode = True
    attention_batching = True  # attn_block_group: adjacent chunks share one attention call (layer-major)
    prefill_kernels_apply = True  # prefill's norms and router top-k may run decode's fused kernels (prefill_kernel)

    def __init__(self, cfg: HybridConfig, weights: HybridWeights, max_context: int, device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.w, self.device, self.dtype = cfg, weights, device, dtype
        self.max_context = max_context
        self.scale = cfg.head_dim**-0.5
        self.cos, self.sin = rope_tables(cfg.rotary_dim, cfg.rope_theta, max_context, device, dtype)  # [S, R] x2
        self.grouped, self.moe_kernel, self._mm = expert_kernel(device, dtype)
        self.gdn_backend = gdn.backend(device)
        # prefill CUDA graphs (steps.LayerSteps): the first halves of the DeltaNet layers and every MoE half
        self.prefill_graph_layers = frozenset(cfg.linear_layers)
        self.prefill_graph_moe = cfg.prefill_graph_moe

    def new_cache(self, max_context: int | None = None) -> HybridCache:
        return HybridCache(self.cfg, max_context or self.max_context, self.device, self.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w.embed)  # [T, H]

    # -- gated attention ----------------------------------------------------------------------------------
    def _qkv(self, aw: AttnWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H] (normed) -> q [Hq, T, D], k, v [Hkv, T, D] (q, k normed and rotated), gate [T, Hq*D]."""
        cfg = self.cfg
        T, hq, hkv, d, rd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
        qg = F.linear(x, aw.q_proj).view(T, hq, 2 * d)  # [T, Hq, 2D]
        q, gate = qg[..., :d], qg[..., d:].reshape(T, hq * d)  # [T, Hq, D], [T, Hq*D]
        q = zc_rms_norm(q, aw.q_norm, cfg.rms_norm_eps).transpose(0, 1)  # [Hq, T, D]
        k = F.linear(x, aw.k_proj).view(T, hkv, d)  # [T, Hkv, D]
        k = zc_rms_norm(k, aw.k_norm, cfg.rms_norm_eps).transpose(0, 1)  # [Hkv, T, D]
        v = F.linear(x, aw.v_proj).view(T, hkv, d).transpose(0, 1)  # [Hkv, T, D]
        q = torch.cat((q[..., :rd] * cos + rotate_half(q[..., :rd]) * sin, q[..., rd:]), dim=-1)  # [Hq, T, D]
        k = torch.cat((k[..., :rd] * cos + rotate_half(k[..., :rd]) * sin, k[..., rd:]), dim=-1)  # [Hkv, T, D]
        return q, k, v, gate

    def _attn_out(self, aw: AttnWeights, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        T = gate.shape[0]
        out = out[0].transpose(0, 1).reshape(T, -1)  # [T, Hq*D]
        return F.linear(out * torch.sigmoid(gate), aw.o_proj)  # [T, H]

    def attention(self, layer: int, x: torch.Tensor, cache: HybridCache, start: int) -> torch.Tensor:
        """Gated attention of x [T, H] (normed) at positions [start, start+T); writes the KV cache."""
        q, gate = self.attention_qkv(layer, x, cache, start)  # [Hq, T, D], [T, Hq*D]
        return self._attn_out(self.w.layers[layer].mixer, self.attention_core(layer, q, cache, start), gate)

    def attention_qkv(self, layer: int, x: torch.Tensor, cache: HybridCache,
                      start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (normed) at positions [start, start+T) -> (q [Hq, T, D], gate [T, Hq*D]); writes its K and V
        into the cache at those positions."""
        aw, i = self.w.layers[layer].mixer, cache.slot[layer]
        end = start + x.shape[0]
        q, k, v, gate = self._qkv(aw, x, self.cos[start:end], self.sin[start:end])
        cache.k[i][:, start:end] = k
        cache.v[i][:, start:end] = v
        return q, gate

    def attention_core(self, layer: int, q: torch.Tensor, cache: HybridCache, start: int) -> torch.Tensor:
        """The queries q [Hq, T, D] at positions [start, start+T) over the cache's keys and values [0, start+T)
        -> [1, Hq, T, D]."""
        i, end = cache.slot[layer], start + q.shape[1]
        gqa = self.cfg.num_attention_heads != self.cfg.num_key_value_heads
        return causal_sdpa(q, cache.k[i][:, :end], cache.v[i][:, :end], self.scale, gqa)

    # -- Gated DeltaNet -----------------------------------------------------------------------------------
    def linear_mixer(self, layer: int, x: torch.Tensor, conv_state: torch.Tensor,
                     rec_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gated DeltaNet of x [T, H] (normed) from the given states -> (out [T, H], conv state, recurrent state)."""
        cfg, lw = self.cfg, self.w.layers[layer].mixer
        T = x.shape[0]
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        qkv = F.linear(x, lw.in_proj_qkv)  # [T, C]
        z = F.linear(x, lw.in_proj_z).view(T, hv, dv)  # [T, Hv, Dv]
        b = F.linear(x, lw.in_proj_b)  # [T, Hv]
        a = F.linear(x, lw.in_proj_a)  # [T, Hv]
        qkv, conv_state = gdn.causal_conv(qkv, conv_state, lw.conv)  # [T, C], [C, K-1]
        q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)  # [T, Hk*Dk] x2, [T, Hv*Dv]
        beta = torch.sigmoid(b)  # [T, Hv]
        g = -lw.A_log.float().exp() * F.softplus(a.float() + lw.dt_bias.float())  # [T, Hv] float32
        o, rec_state = gdn.gated_delta_rule(q.view(T, hk, dk), k.view(T, hk, dk), v.view(T, hv, dv), g, beta,
                                            rec_state)  # [T, Hv, Dv], [Hv, Dk, Dv] float32
        o = self.gated_output_norm(o, z, lw.norm)  # [T, Hv, Dv]
        return F.linear(o.reshape(T, hv * dv), lw.out_proj), conv_state, rec_state  # [T, H]

    def gated_output_norm(self, o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The DeltaNet output o [T, Hv, Dv] through the gated RMSNorm, gate z [T, Hv, Dv] (silu)."""
        return gdn.gated_rms_norm(o, z, weight, self.cfg.rms_norm_eps)  # [T, Hv, Dv]

    def linear_attention(self, layer: int, x: torch.Tensor, cache: HybridCache, start: int) -> torch.Tensor:
        i = cache.slot[layer]
        if start == 0:  # a sequence start: no history, whatever the cache holds (zeros in place: the same
            # values as fresh zeros, and the step then reads and writes the same buffers at every start)
            cache.conv[i].zero_()
            cache.rec[i].zero_()
        out, conv, rec = self.linear_mixer(layer, x, cache.conv[i], cache.rec[i])  # [T, H]
        cache.conv[i].copy_(conv)
        cache.rec[i].copy_(rec)
        return out

    # -- the layer halves ---------------------------------------------------------------------------------
    def _post_mixer(self, layer: int, x: torch.Tensor, mixed: torch.Tensor | None = None, decode: bool = False,
                    lookup=None):
        """x after the mixer residual [T, H] (or before it, with the mixer's output ``mixed`` [T, H] to add) ->
        (x + shared expert [T, H], h [T, H], top_w [T, k], top_ids [T, k]). ``decode``: one decode token, through
        the decode kernels the Decoder chose (the residual add and the norm in one kernel, the router's top-k in
        another, for "triton"; ``lookup``: ``decode_route``'s)."""
        cfg, lw = self.cfg, self.w.layers[layer]
        fused = (self.decode_attention_kernel if decode else self.prefill_kernel) == "triton"
        if fused and mixed is not None:
            x, h = fused_rms_norm(mixed, lw.post_norm, cfg.rms_norm_eps, residual=x, plus_one=True)  # [T, H] x2
        else:
            x = x if mixed is None else x + mixed  # [T, H]
            h = zc_rms_norm(x, lw.post_norm, cfg.rms_norm_eps)  # [T, H]
        top_w, top_ids = decode_route(self.decode_router_kernel if decode else self.prefill_kernel, h, lw.router,
                                      cfg.num_experts_per_tok, True, self.bias_of(layer), lookup)  # [T, k] x2
        gu = F.linear(h, lw.shared_gate_up)  # [T, 2Is]
        i_s = gu.shape[-1] // 2
        shared = F.linear(F.silu(gu[:, :i_s]) * gu[:, i_s:], lw.shared_down)  # [T, H]
        shared = torch.sigmoid(F.linear(h, lw.shared_gate)) * shared  # [T, H]
        if self.trace is not None:  # a traced prefill (abbench.engine.ops.trace): observe, change nothing
            self.trace(layer, "router", top_ids)
            self.trace(layer, "shared_expert", shared)
        return x + shared, h, top_w, top_ids

    def _input_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """A prefill chunk's first norm, x [T, H] -> [T, H]: torch's ops or, with ``prefill_kernel`` "triton", one
        kernel."""
        if self.prefill_kernel == "triton":
            return fused_rms_norm(x, self.w.layers[layer].input_norm, self.cfg.rms_norm_eps, plus_one=True)
        return zc_rms_norm(x, self.w.layers[layer].input_norm, self.cfg.rms_norm_eps)

    def _after_mixer(self, layer: int, x: torch.Tensor, a: torch.Tensor):
        """``_post_mixer`` of a prefill chunk x [T, H] with its mixer's output a [T, H]: the residual add apart, or
        (``prefill_kernel`` "triton") in the norm's kernel."""
        return self._post_mixer(layer, x, a) if self.prefill_kernel == "triton" else self._post_mixer(layer, x + a)

    def attn_block(self, layer: int, x: torch.Tensor, cache: HybridCache, start: int):
        """First half of a layer: x [T, H] at positions [start, start+T) -> (x + mixer + shared expert [T, H],
        MoE input h [T, H], router weights [T, k], router expert ids [T, k])."""
        cfg = self.cfg
        hn = self._input_norm(layer, x)  # [T, H]
        if cfg.layer_types[layer] == "full_attention":
            a = self.attention(layer, hn, cache, start)  # [T, H]
        else:
            a = self.linear_attention(layer, hn, cache, start)  # [T, H]
        if self.trace is not None:
            self._trace_layer = layer
            self.trace(layer, "attention", a)
        return self._after_mixer(layer, x, a)

    def cache_only(self, layer: int, x: torch.Tensor, cache: HybridCache, start: int) -> bool:
        """What ``attn_block`` writes into the cache for x [T, H] at [start, start+T), and nothing else, where that
        is less than the whole first half: a full-attention layer's K and V (the same calls as ``attn_block``'s).
        False, with nothing done, for a DeltaNet layer (its states need the whole mixer)."""
        if self.cfg.layer_types[layer] != "full_attention":
            return False
        self.attention_qkv(layer, self._input_norm(layer, x), cache, start)
        return True

    def attn_block_group(self, layer: int, xs: list[torch.Tensor], cache: HybridCache,
                         starts: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """``attn_block`` of a full-attention layer for adjacent chunks xs [T_c, H] at ``starts`` (each chunk
        starts where the one before ends) with one attention call over all their queries: the norms,
        projections, KV writes, output gates and the rest of the layer run per chunk with the shapes of
        ``attn_block``, so each chunk's result equals ``attn_block``'s wherever the attention kernel computes
        every query row of the joint call as it does in the chunk's own call (``attention_batching_exact``)."""
        cfg, lw = self.cfg, self.w.layers[layer]
        assert cfg.layer_types[layer] == "full_attention", "attention batching is for full-attention layers"
        qg = [self.attention_qkv(layer, self._input_norm(layer, x), cache, s)
              for x, s in zip(xs, starts, strict=True)]  # (q [Hq, T_c, D], gate [T_c, Hq*D]) per chunk
        out = self.attention_core(layer, torch.cat([q for q, _ in qg], dim=1), cache, starts[0])  # [1, Hq, sum T, D]
        results, o = [], 0
        for x, (q, gate) in zip(xs, qg, strict=True):
            T = q.shape[1]
            a = self._attn_out(lw.mixer, out[:, :, o:o + T], gate)  # [T, H]
            o += T
            if self.trace is not None:
                self._trace_layer = layer
                self.trace(layer, "attention", a)
            results.append(self._after_mixer(layer, x, a))
        return results

    guesses_experts = True

    def predict_experts(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """A guess of the experts [B, k] int64 ``layer`` will route decode tokens x [B, H] to, from the residual
        stream before it (the previous layer's, after its mixer and shared expert): ``layer``'s zero-centred norm
        and router applied as if ``layer``'s mixer and shared expert added nothing (the decode router's kernels).
        Only the decode prefetch and ``tools.predict_check`` read it; no output depends on it."""
        lw, eps = self.w.layers[layer], self.cfg.rms_norm_eps
        h = (fused_rms_norm(x, lw.post_norm, eps, plus_one=True) if self.decode_router_kernel == "triton" else
             zc_rms_norm(x, lw.post_norm, eps))
        return decode_route(self.decode_router_kernel, h, lw.router, self.cfg.num_experts_per_tok, True,
                            self.bias_of(layer))[1]

    def decode_attn_block(self, layer: int, x: torch.Tensor, cache: HybridCache, pos_t: torch.Tensor,
                          kv_len: int, lookup=None):
        """``attn_block`` for one token x [1, H] at the position held by ``pos_t`` (LongTensor [1] on the
        device), with static shapes and no host sync: attention layers write KV at pos and attend over cache
        positions [0, kv_len) with those > pos masked out (kv_len >= pos + 1); linear layers take one
        recurrent step, updating their states in place. Same results as ``attn_block(layer, x, cache, pos)``
        up to SDPA's handling of the masked tail. ``lookup``: ``decode_route``'s."""
        cfg, lw = self.cfg, self.w.layers[layer]
        if self.decode_attention_kernel == "triton":
            hn = fused_rms_norm(x, lw.input_norm, cfg.rms_norm_eps, plus_one=True)  # [1, H]
        else:
            hn = zc_rms_norm(x, lw.input_norm, cfg.rms_norm_eps)  # [1, H]
        i = cache.slot[layer]
        if cfg.layer_types[layer] == "full_attention":
            aw = lw.mixer
            cos, sin = self.cos.index_select(0, pos_t), self.sin.index_select(0, pos_t)  # [1, R] x2
            q, k, v, gate = self._qkv(aw, hn, cos, sin)  # [Hq, 1, D], [Hkv, 1, D] x2, [1, Hq*D]
            cache.k[i].index_copy_(1, pos_t, k)
            cache.v[i].index_copy_(1, pos_t, v)
            out = decode_attend(self.decode_attention_kernel, q, cache.k[i][:, :kv_len], cache.v[i][:, :kv_len],
                                pos_t, self.scale)[None]  # [1, Hq, 1, D]
            mixed = self._attn_out(aw, out, gate)  # [1, H]
        else:
            mixed, conv, rec = self.linear_mixer(layer, hn, cache.conv[i], cache.rec[i])  # [1, H]
            cache.conv[i].copy_(conv)
            cache.rec[i].copy_(rec)
        return self._post_mixer(layer, x, mixed, decode=True, lookup=lookup)

    def logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """Final zero-centred norm and lm_head of x_last [1, H] -> float32 logits [V]."""
        h = zc_rms_norm(x_last, self.w.norm, self.cfg.rms_norm_eps)  # [1, H]
        return F.linear(h, self.w.lm_head)[0].float()  # [V]
