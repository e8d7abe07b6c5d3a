"""The Qwen3-MoE decoder, one token batch (one request) at a time, with its KV cache. Its ops are
:mod:`abbench.engine.ops.dense` and :mod:`abbench.engine.ops.moe`; the other families build on this model.

Contract:
- ``Model`` holds the dense (non-expert) weights on the compute device and the RoPE tables. Its layer is
  split in two so that the prefill modes can fetch experts between the halves:
  ``attn_block(l, x, kv, start)`` runs attention (writing the KV cache at positions [start, start+T)) and
  the router, ``moe_block(...)`` runs the routed experts from whatever weight tensors the caller passes
  (a streamed layer buffer, the decode slot cache, or resident weights). Every mode calls exactly these
  functions with the same shapes, which is why their results are bitwise equal on one device.
- A chunk of T tokens at positions [p, p+T) attends to the KV cache [0, p+T) with a lower-right causal
  mask (``is_causal`` when p == 0; ``lower_right_causal`` otherwise: on CUDA torch's ``causal_lower_right``,
  which SDPA serves with the flash kernel; no mask for T == 1). Callers run the layers inside ``attention_backends()``, which leaves out
  cuDNN attention: it builds an execution plan for every new shape, i.e. for every decode step's KV
  length (measured on an H200: 35 ms/token decode became 70-160 ms/token on lengths not seen before).
- Decode has its own attention (``decode_attention``/``decode_attn_block``): static shapes, the position in a
  device tensor, attention over a fixed KV length with later positions masked, so a step can be captured
  as a CUDA graph. Every arm decodes through it, so decode ids are comparable across prefill modes.
- The experts run through one grouped-GEMM path (``moe_experts``): assignments sorted by expert with a
  stable argsort, group ends from ``searchsorted`` (no host sync, unlike CUDA ``bincount``),
  ``torch._grouped_mm`` on [G, N, K] weights passed as a transposed view (K-contiguous, no copy), and a
  deterministic combine (un-permute with ``index_copy_``, weighted sum over the k slots) instead of
  atomics. Where ``torch._grouped_mm`` fails for the device/dtype, a per-expert loop computes the same
  thing (with a host sync) and ``Model.moe_kernel`` says so.
- Numerics follow transformers' ``Qwen3MoeForCausalLM``: RMSNorm in float32 then cast, router softmax in
  float32, top-k weights renormalised when ``norm_topk_prob`` and cast back to the model dtype.
- ``Model.trace`` (None unless a request asks for a layer trace, :mod:`abbench.engine.ops.trace`) is called from
  ``attn_block`` and ``moe_block`` with each sub-block's output; it observes, the arithmetic is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from abbench.engine.config import ModelConfig
from abbench.engine.ops.dense import decode_attend, lower_right_causal, rms_norm, rope_tables, rotate_half
from abbench.engine.ops.batch_attention import (
    attention_rows, linear_rows, qk_norm_rope_store_rows, split_plan, split_plans,
)
from abbench.engine.ops.kernels import rms_norm as fused_rms_norm, route_topk
from abbench.engine.models.base import ModelCache, MoEModel
from abbench.engine.ops.moe import decode_route, expert_kernel, route


@dataclass
class LayerWeights:
    """Dense weights of one decoder layer (nn.Linear layout: [out, in])."""

    input_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [Hq*D, H]
    k_proj: torch.Tensor  # [Hkv*D, H]
    v_proj: torch.Tensor  # [Hkv*D, H]
    o_proj: torch.Tensor  # [H, Hq*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [H]
    router: torch.Tensor  # [E, H]


@dataclass
class DenseWeights:
    """Everything but the experts. ``lm_head`` is ``embed`` itself when the embeddings are tied."""

    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]


class KVCache(ModelCache):
    """Preallocated keys and values, per layer [n_kv, max_context, head_dim] (head-major, as SDPA reads). The
    caches of an engine's sequences are rows of one pool per layer (``pooled``): ``pool_k[l]`` [C, n_kv,
    max_context, head_dim], this cache's layer ``pool_k[l][index]``, so a batched decode kernel reaches every
    sequence's cache from one tensor."""

    def __init__(self, cfg: ModelConfig, max_context: int, device: torch.device, dtype: torch.dtype,
                 pool: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None, index: int = 0):
        shape = (1, cfg.num_key_value_heads, max_context, cfg.head_dim)
        self.max_context = max_context
        self.pool_k, self.pool_v = pool if pool is not None else (
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)])
        self.index = index
        self.k = [t[index] for t in self.pool_k]  # [n_kv, max_context, head_dim] per layer
        self.v = [t[index] for t in self.pool_v]

    @classmethod
    def pooled(cls, cfg: ModelConfig, n: int, max_context: int, device: torch.device,
               dtype: torch.dtype) -> list[KVCache]:
        """``n`` caches, the rows of one pool per layer."""
        shape = (n, cfg.num_key_value_heads, max_context, cfg.head_dim)
        pool = ([torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)],
                [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)])
        return [cls(cfg, max_context, device, dtype, pool, i) for i in range(n)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Model(MoEModel):
    """Dense weights, RoPE tables and the layer functions. Stateless between calls except for ``kv``."""

    triton_decode = True  # decode's Triton kernels apply: the MoE block is the routed experts alone
    prefill_kernels_apply = True  # prefill's attention half may run decode's fused kernels (prefill_kernel)

    def __init__(self, cfg: ModelConfig, weights: DenseWeights, max_context: int, device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.w, self.device, self.dtype = cfg, weights, device, dtype
        self.max_context = max_context
        self.scale = cfg.head_dim**-0.5
        self.cos, self.sin = rope_tables(cfg.head_dim, cfg.rope_theta, max_context, device, dtype)  # [S, D] x2
        self.grouped, self.moe_kernel, self._mm = expert_kernel(device, dtype)
        self.max_split = split_plan(max_context)[1]  # the longest split range any decode bucket uses
        self._plans: dict[int, torch.Tensor] = {}
        self._no_index = torch.zeros(1, dtype=torch.long, device=device)  # a one-cache view's index
        # prefill_kernel "triton": positions [max_context] and cache indices (all 0: one cache) int64 on the device
        self._positions: torch.Tensor | None = None
        self._one_cache: torch.Tensor | None = None
        # prefill CUDA graphs (steps.LayerSteps): none (ModelConfig.prefill_graph_moe says why)
        self.prefill_graph_moe = cfg.prefill_graph_moe

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w.embed)  # [T, H]

    def write_kv(self, layer: int, x: torch.Tensor, kv: KVCache, start: int) -> None:
        """The keys and values of x [T, H] (already normed) at positions [start, start+T) into the KV cache."""
        cfg, lw = self.cfg, self.w.layers[layer]
        if self.prefill_kernel == "triton":  # the kernel that writes them in ``attention``, its q left unread
            self._qk_rope_store(layer, x, kv, start)
            return
        T, hkv, d = x.shape[0], cfg.num_key_value_heads, cfg.head_dim
        end = start + T
        k = F.linear(x, lw.k_proj).view(T, hkv, d)  # [T, Hkv, D]
        v = F.linear(x, lw.v_proj).view(T, hkv, d)  # [T, Hkv, D]
        k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps).transpose(0, 1)  # [Hkv, T, D]
        cos, sin = self.cos[start:end], self.sin[start:end]  # [T, D]
        k = k * cos + rotate_half(k) * sin  # [Hkv, T, D]
        kv.k[layer][:, start:end] = k
        kv.v[layer][:, start:end] = v.transpose(0, 1)

    def _qk_rope_store(self, layer: int, x: torch.Tensor, kv: KVCache, start: int) -> torch.Tensor:
        """``prefill_kernel`` "triton": the projections of x [T, H] (normed), then one kernel for the q/k norms,
        the rope at positions [start, start+T) and the K/V cache write (decode's, a token a row) -> q [Hq, T, D]."""
        lw, T = self.w.layers[layer], x.shape[0]
        if self._positions is None:
            self._positions = torch.arange(self.max_context, device=self.device)
            self._one_cache = torch.zeros(self.max_context, dtype=torch.long, device=self.device)
        q = qk_norm_rope_store_rows(F.linear(x, lw.q_proj), F.linear(x, lw.k_proj), F.linear(x, lw.v_proj),
                                    lw.q_norm, lw.k_norm, self.cos, self.sin, self._positions[start:start + T],
                                    self._one_cache[:T], kv.k[layer][None], kv.v[layer][None],
                                    self.cfg.rms_norm_eps)  # [T, Hq, D]
        return q.transpose(0, 1)  # [Hq, T, D]

    def attention(self, layer: int, x: torch.Tensor, kv: KVCache, start: int) -> torch.Tensor:
        """Self-attention of x [T, H] (already normed) at positions [start, start+T); writes the KV cache."""
        cfg, lw = self.cfg, self.w.layers[layer]
        T, hq, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        end = start + T
        if self.prefill_kernel == "triton":
            q = self._qk_rope_store(layer, x, kv, start)  # [Hq, T, D]
        else:
            q = F.linear(x, lw.q_proj).view(T, hq, d)  # [T, Hq, D]
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps).transpose(0, 1)  # [Hq, T, D]
            cos, sin = self.cos[start:end], self.sin[start:end]  # [T, D]
            q = q * cos + rotate_half(q) * sin  # [Hq, T, D]
            self.write_kv(layer, x, kv, start)
        keys = kv.k[layer][None, :, :end]  # [1, Hkv, end, D]
        values = kv.v[layer][None, :, :end]  # [1, Hkv, end, D]
        gqa = hq != hkv
        if T == 1:  # one query sees the whole prefix
            out = F.scaled_dot_product_attention(q[None], keys, values, scale=self.scale, enable_gqa=gqa)
        elif start == 0:  # square: top-left and bottom-right causal coincide
            out = F.scaled_dot_product_attention(q[None], keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=gqa)
        else:  # queries [start, end) over keys [0, end): bottom-right aligned causal mask
            out = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=lower_right_causal(T, end, x.device),
                                                 scale=self.scale, enable_gqa=gqa)
        out = out[0].transpose(0, 1).reshape(T, hq * d)  # [T, Hq*D]
        return F.linear(out, lw.o_proj)  # [T, H]

    def decode_attention(self, layer: int, x: torch.Tensor, kv: KVCache, pos: torch.Tensor,
                         kv_len: int) -> torch.Tensor:
        """Attention of one token x [1, H] (already normed) at the position held by ``pos`` (int64 [1] on the
        device), writing its KV there; it attends over cache positions [0, kv_len) with those after ``pos``
        masked out. Shapes depend on ``kv_len`` only and nothing is read back to the host, so a decode step
        can be captured as a CUDA graph and replayed at any position below kv_len. Grouped-query attention
        as two batched matmuls per KV head group (each query head h reads KV head h // (Hq/Hkv), as
        transformers' repeat_kv), scores softmaxed in float32."""
        cfg, lw = self.cfg, self.w.layers[layer]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if self.decode_attention_kernel == "triton":  # a batch of one (``decode_attn_rows``' kernels)
            return self._attention_rows(layer, x, kv.k[layer][None], kv.v[layer][None], pos, self._no_index,
                                        self.decode_plan(kv_len))
        else:
            q = F.linear(x, lw.q_proj).view(1, hq, d)  # [1, Hq, D]
            k = F.linear(x, lw.k_proj).view(1, hkv, d)  # [1, Hkv, D]
            v = F.linear(x, lw.v_proj).view(1, hkv, d)  # [1, Hkv, D]
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps).transpose(0, 1)  # [Hq, 1, D]
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps).transpose(0, 1)  # [Hkv, 1, D]
            cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)  # [1, D]
            q = q * cos + rotate_half(q) * sin  # [Hq, 1, D]
            k = k * cos + rotate_half(k) * sin  # [Hkv, 1, D]
            kv.k[layer].index_copy_(1, pos, k)
            kv.v[layer].index_copy_(1, pos, v.transpose(0, 1))
        keys, values = kv.k[layer][:, :kv_len], kv.v[layer][:, :kv_len]  # [Hkv, L, D] each
        out = decode_attend(self.decode_attention_kernel, q, keys, values, pos, self.scale).reshape(1, hq * d)
        return F.linear(out, lw.o_proj)  # [1, H]

    def _attention_rows(self, layer: int, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        pos: torch.Tensor, index: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        """Decode attention of B tokens x [B, H] (normed) over the layer's pooled caches [C, Hkv, S, D] (token b
        in cache index[b] at pos[b], with its split plan) -> [B, H]: every projection a GEMV per token
        (``linear_rows``), the q/k norms, RoPE and cache write one kernel, split-KV attention per token; each
        token's bits as alone (:mod:`abbench.engine.ops.batch_attention`)."""
        cfg, lw = self.cfg, self.w.layers[layer]
        b, hq, d = x.shape[0], cfg.num_attention_heads, cfg.head_dim
        q = qk_norm_rope_store_rows(linear_rows(x, lw.q_proj), linear_rows(x, lw.k_proj), linear_rows(x, lw.v_proj),
                                    lw.q_norm, lw.k_norm, self.cos, self.sin, pos, index, keys, values,
                                    cfg.rms_norm_eps)  # [B, Hq, D]
        out = attention_rows(q, keys, values, pos, index, plan, self.scale, self.max_split)  # [B, Hq, D]
        return linear_rows(out.reshape(b, hq * d), lw.o_proj)  # [B, H]

    def decode_plan(self, kv_len: int) -> torch.Tensor:
        """The split plan [1, 2] int32 on the device of a step over ``kv_len`` keys (``split_plan``), kept per
        length (so a captured step reads a fixed tensor)."""
        plan = self._plans.get(kv_len)
        if plan is None:
            plan = self._plans[kv_len] = split_plans([kv_len], device=self.device)
        return plan

    batched_decode = True  # ``decode_attn_rows``: B sequences' tokens through a layer's attention half at once

    def decode_attn_rows(self, layer: int, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         pos: torch.Tensor, index: torch.Tensor, plan: torch.Tensor):
        """``decode_attn_block`` (Triton's kernels) for B tokens of B sequences: x [B, H], the layer's pooled
        caches ``KVCache.pool_k[layer]`` / ``pool_v[layer]`` [C, Hkv, S, D], pos and index [B] int64 (each token's
        position and cache), plan [B, 2] int32 (each token's ``split_plan`` of its bucket) -> (x, h [B, H],
        router weights, expert ids [B, k]). Each token gets the bits ``decode_attn_block`` gives it alone."""
        cfg, lw = self.cfg, self.w.layers[layer]
        eps = cfg.rms_norm_eps
        a = self._attention_rows(layer, fused_rms_norm(x, lw.input_norm, eps), keys, values, pos, index, plan)
        x, h = fused_rms_norm(a, lw.post_norm, eps, residual=x)  # [B, H] x2
        top_w, top_ids = route_topk(linear_rows(h, lw.router), cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                    h.dtype, self.bias_of(layer))  # [B, k] x2
        return x, h, top_w, top_ids

    guesses_experts = True

    def predict_experts(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """A guess of the experts [B, k] int64 ``layer`` will route decode tokens x [B, H] to, from the residual
        stream before it (the previous layer's, after its attention): ``layer``'s norm and router applied as if
        the rest of the previous layer and ``layer``'s attention added nothing (the decode router's kernels).
        Only the decode prefetch (``Decoder``'s ``prefetch``) and ``tools.predict_check`` read it; no output
        depends on it."""
        lw, eps = self.w.layers[layer], self.cfg.rms_norm_eps
        h = fused_rms_norm(x, lw.post_norm, eps) if self.decode_router_kernel == "triton" else rms_norm(
            x, lw.post_norm, eps)
        return decode_route(self.decode_router_kernel, h, lw.router, self.cfg.num_experts_per_tok,
                            self.cfg.norm_topk_prob, self.bias_of(layer))[1]

    def decode_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``logits`` of decode tokens x [B, H] -> float32 [B, V]: with Triton's decode kernels the final norm and
        lm_head per token (``rms_norm`` rows, ``linear_rows``: a token's bits as alone), else torch's."""
        if self.decode_attention_kernel != "triton":
            return super().decode_logits(x)
        return linear_rows(fused_rms_norm(x, self.w.norm, self.cfg.rms_norm_eps), self.w.lm_head).float()

    def decode_attn_block(self, layer: int, x: torch.Tensor, kv: KVCache, pos: torch.Tensor, kv_len: int,
                          lookup=None):
        """``attn_block`` for one decode token (see ``decode_attention``): x [1, H] -> (x [1, H], h [1, H],
        router weights [1, k], router expert ids [1, k]); ``lookup``: ``decode_route``'s. With Triton's attention
        and router, a batch of one of ``decode_attn_rows`` (so a token decoded alone and in a batch agree)."""
        cfg, lw = self.cfg, self.w.layers[layer]
        eps = cfg.rms_norm_eps
        if self.decode_attention_kernel == "triton" and self.decode_router_kernel == "triton" and lookup is None:
            return self.decode_attn_rows(layer, x, kv.k[layer][None], kv.v[layer][None], pos, self._no_index,
                                         self.decode_plan(kv_len))
        if self.decode_attention_kernel == "triton":  # each norm one kernel, the residual add in the second
            a = self.decode_attention(layer, fused_rms_norm(x, lw.input_norm, eps), kv, pos, kv_len)  # [1, H]
            x, h = fused_rms_norm(a, lw.post_norm, eps, residual=x)  # [1, H] x2
        else:
            x = x + self.decode_attention(layer, rms_norm(x, lw.input_norm, eps), kv, pos, kv_len)
            h = rms_norm(x, lw.post_norm, eps)  # [1, H]
        top_w, top_ids = decode_route(self.decode_router_kernel, h, lw.router, cfg.num_experts_per_tok,
                                      cfg.norm_topk_prob, self.bias_of(layer), lookup)  # [1, k] x2
        return x, h, top_w, top_ids

    def cache_only(self, layer: int, x: torch.Tensor, kv: KVCache, start: int) -> bool:
        """What ``attn_block`` writes into the cache for x [T, H] at [start, start+T), and nothing else: the
        layer's keys and values, by the same calls. True: done."""
        self.write_kv(layer, self._input_norm(layer, x), kv, start)
        return True

    def _input_norm(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """A prefill chunk's first norm, x [T, H] -> [T, H]: torch's ops or, with ``prefill_kernel`` "triton", one
        kernel."""
        norm = fused_rms_norm if self.prefill_kernel == "triton" else rms_norm
        return norm(x, self.w.layers[layer].input_norm, self.cfg.rms_norm_eps)

    def attn_block(self, layer: int, x: torch.Tensor, kv: KVCache, start: int):
        """First half of a layer: x [T, H] -> (x after attention residual [T, H], MoE input h [T, H],
        router weights [T, k], router expert ids [T, k])."""
        cfg, lw = self.cfg, self.w.layers[layer]
        a = self.attention(layer, self._input_norm(layer, x), kv, start)  # [T, H]
        if self.prefill_kernel == "triton":  # the residual add and the norm one kernel, the router's top-k another
            x, h = fused_rms_norm(a, lw.post_norm, cfg.rms_norm_eps, residual=x)  # [T, H] x2
            top_w, top_ids = route_topk(F.linear(h, lw.router), cfg.num_experts_per_tok, cfg.norm_topk_prob, h.dtype,
                                        self.bias_of(layer))  # [T, k] x2
        else:
            x = x + a  # [T, H]
            h = rms_norm(x, lw.post_norm, cfg.rms_norm_eps)  # [T, H]
            top_w, top_ids = route(h, lw.router, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                   self.bias_of(layer))  # [T, k] x2
        if self.trace is not None:
            self._trace_layer = layer
            self.trace(layer, "attention", a)
            self.trace(layer, "router", top_ids)
        return x, h, top_w, top_ids

    def logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head of the last position's hidden state [1, H] -> float32 logits [V]."""
        h = rms_norm(x_last, self.w.norm, self.cfg.rms_norm_eps)  # [1, H]
        return F.linear(h, self.w.lm_head)[0].float()  # [V]
