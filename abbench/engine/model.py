"""The Qwen3-MoE decoder, one token batch (one request) at a time, with its KV cache.

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
- ``Model.trace`` (None unless a request asks for a layer trace, :mod:`abbench.engine.trace`) is called from
  ``attn_block`` and ``moe_block`` with each sub-block's output; it observes, the arithmetic is unchanged.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import MAX_GROUPED_MM_GROUPS, ModelConfig
from .decode_kernels import attention_split_kv, qk_norm_rope_store, rms_norm as fused_rms_norm, route_topk


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


class KVCache:
    """Preallocated keys and values, per layer [n_kv, max_context, head_dim] (head-major, as SDPA reads)."""

    def __init__(self, cfg: ModelConfig, max_context: int, device: torch.device, dtype: torch.dtype):
        shape = (cfg.num_key_value_heads, max_context, cfg.head_dim)
        self.max_context = max_context
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends():
    """Context for running layers: SDPA may use flash, memory-efficient or math kernels, not cuDNN."""
    return sdpa_kernel(_SDPA_BACKENDS)


def lower_right_causal(T: int, S: int, device: torch.device):
    """The mask of T queries at positions [S-T, S) over keys [0, S): causal, aligned bottom right. On CUDA
    torch's ``causal_lower_right`` (SDPA serves it with the flash kernel, nothing materialised); elsewhere the
    boolean mask that ``causal_lower_right`` materialises there itself (the same SDPA call, bit for bit:
    checked on CPU in float32 and bf16, with and without grouped heads), without importing
    ``torch.nn.attention.bias``, which pulls in torch._dynamo: ~1.8 s of every CPU engine's start."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(T, S)
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)  # [T, S]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # [..., N]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., N]
    return weight * xf.to(x.dtype)  # [..., N]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [..., D]


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool,
          bias: torch.Tensor | None = None):
    """Softmax top-k router. Returns (weights [T, k] in h.dtype, expert ids [T, k] int64). ``bias`` [E] float32
    (random weights with ``router_skew`` only: :func:`router_skew_bias`) is added to the logits in float32."""
    logits = F.linear(h, router)  # [T, E]
    if bias is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    else:
        probs = torch.softmax(logits.float() + bias, dim=-1)  # [T, E]
    top_w, top_ids = torch.topk(probs, top_k, dim=-1)  # [T, k], [T, k]
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)  # [T, k]
    return top_w.to(h.dtype), top_ids


def decode_gqa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
               scale: float) -> torch.Tensor:
    """One decode token's grouped-query attention: q [Hq, 1, D] over keys, values [Hkv, L, D] with the
    positions where ``hidden`` [L] is true masked out -> [Hq, 1, D]. Two batched matmuls per KV head group
    (query head h reads KV head h // (Hq/Hkv), as transformers' repeat_kv) and a float32 softmax over [Hkv,
    G, L] scores: K and V are read in place, never expanded to Hq heads or upcast (SDPA with a mask and
    ``enable_gqa`` falls back to its math kernel on CUDA, which does both: at a 128K KV length that is ~50 KB
    of temporaries per position and the whole cache re-read in float32 every step)."""
    hq, _, d = q.shape
    hkv = keys.shape[0]
    qg = q.reshape(hkv, hq // hkv, d)  # [Hkv, G, D]
    scores = torch.bmm(qg, keys.transpose(1, 2)).float() * scale  # [Hkv, G, L]
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).to(values.dtype)  # [Hkv, G, L]
    return torch.bmm(probs, values).reshape(hq, 1, d)  # [Hq, 1, D]


def decode_attend(kernel: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """One decode token's attention over the bucket ``keys``/``values`` [Hkv, L, D], positions after ``pos``
    (int64 [1] on the device) masked: ``decode_gqa`` ("torch") or the split-KV Triton kernel
    (``decode_kernels.attention_split_kv``, "triton", ``EngineConfig.decode_attention``) -> [Hq, 1, D]."""
    if kernel == "triton":
        return attention_split_kv(q, keys, values, pos, scale)
    after = torch.arange(keys.shape[1], device=pos.device) > pos  # [L] positions not yet written
    return decode_gqa(q, keys, values, after, scale)


def decode_route(kernel: str, h: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool,
                 bias: torch.Tensor | None = None, lookup=None):
    """``route`` for one decode token h [1, H]: its torch ops ("torch") or, for "triton"
    (``EngineConfig.decode_experts``), the router matmul and one kernel for softmax, top-k and renormalisation
    (``decode_kernels.route_topk``) -> (weights [1, k] in h.dtype, expert ids [1, k] int64). ``lookup`` (a
    ``decode_kernels.SlotLookup``, "triton" only): the same kernel looks the experts up in the slot table."""
    if kernel == "triton":
        return route_topk(F.linear(h, router), top_k, norm_topk_prob, h.dtype, bias, lookup=lookup)
    if lookup is not None:
        raise ValueError("a slot lookup in the router needs the Triton router (decode_experts 'triton')")
    return route(h, router, top_k, norm_topk_prob, bias)


def router_skew_bias(num_experts: int, num_layers: int, skew: float, seed: int,
                     device: torch.device) -> list[torch.Tensor] | None:
    """Per layer a router logit bias [E] float32 that concentrates routing as trained routers do: each layer ranks
    its experts in a seeded random order and expert of rank r gets -skew x ln(r), which multiplies its softmax
    weight by r^-skew (a Zipf-like preference of exponent ``skew``). None for skew 0 (uniform random routing)."""
    if skew <= 0:
        return None
    out = []
    for layer in range(num_layers):
        gen = torch.Generator(device="cpu").manual_seed(seed * 7_919 + layer)
        rank = torch.empty(num_experts, dtype=torch.float32)
        rank[torch.randperm(num_experts, generator=gen)] = torch.arange(1, num_experts + 1, dtype=torch.float32)
        out.append((-skew * rank.log()).to(device))  # [E]
    return out


class TooManyGroups(ValueError):
    """A grouped GEMM was asked for more groups than CUDA's kernel takes (on any device, so CPU tests see it)."""


def check_groups(w: torch.Tensor) -> None:
    if w.shape[0] > MAX_GROUPED_MM_GROUPS:
        raise TooManyGroups(f"grouped GEMM over {w.shape[0]} groups > {MAX_GROUPED_MM_GROUPS} (CUDA's "
                            "torch._grouped_mm limit); pass one layer's experts or slots")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [M, K] in group order times their group's ``w[g]`` [N, K] (nn.Linear layout) -> [M, N].
    ``offs`` [G] int32 holds each group's end row. At most MAX_GROUPED_MM_GROUPS groups, on every device."""
    check_groups(w)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)  # [M, N]


def looped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Same as ``grouped_mm`` with one matmul per non-empty group (reads offs on the host)."""
    check_groups(w)
    out = x.new_empty(x.shape[0], w.shape[1])  # [M, N]
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[g])  # [m_g, N]
        start = end
    return out


def moe_experts(h: torch.Tensor, top_w: torch.Tensor, top_ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, mm=grouped_mm) -> torch.Tensor:
    """SwiGLU experts for h [T, H] routed to ``top_ids`` [T, k] (indices into the first dim of the weights)
    with ``top_w`` [T, k]. ``gate_up`` [G, 2I, H] (gate rows first), ``down`` [G, H, I]. Returns [T, H]."""
    T, k = top_ids.shape
    G, two_i, _ = gate_up.shape
    flat = top_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k] assignment indices, grouped by expert
    groups = torch.arange(G, device=flat.device, dtype=flat.dtype)  # [G]
    offs = torch.searchsorted(flat[order], groups, right=True).to(torch.int32)  # [G] end row of each group
    xs = h[order // k]  # [T*k, H] token rows in group order
    gu = mm(xs, gate_up, offs)  # [T*k, 2I]
    act = F.silu(gu[:, : two_i // 2]) * gu[:, two_i // 2:]  # [T*k, I]
    ys = mm(act, down, offs)  # [T*k, H]
    y = torch.empty_like(ys).index_copy_(0, order, ys)  # [T*k, H] back in (token, slot) order
    return (y.view(T, k, -1) * top_w.unsqueeze(-1)).sum(dim=1)  # [T, H]


def probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device/dtype and agrees with the per-expert loop."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(24, 32, generator=gen).to(device, dtype)  # [M, K]
        w = torch.randn(4, 16, 32, generator=gen).to(device, dtype)  # [G, N, K]
        offs = torch.tensor([5, 5, 17, 24], dtype=torch.int32, device=device)  # [G]
        a, b = grouped_mm(x, w, offs).float(), looped_mm(x, w, offs).float()  # [M, N]
        return bool(torch.allclose(a, b, rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.lru_cache(maxsize=None)
def probe_graph_capture(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm can be captured in a CUDA graph on this device/dtype. It runs for float32 on
    CUDA too (torch 2.11), but through a fallback that reads the group offsets back to the host, which graph
    capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph capture"); the bf16 kernel on
    Hopper captures. False off CUDA and wherever the capture fails (the failed capture is discarded, and with it
    torch's "The CUDA Graph is empty" warning, which is this probe's expected outcome, not a fault). Asked once
    per process for each (device, dtype): every engine and decoder built afterwards reuses the answer."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        return _capture_grouped_mm(device, dtype)


def _capture_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    x = torch.ones(24, 32, device=device, dtype=dtype)  # [M, K]
    w = torch.ones(4, 16, 32, device=device, dtype=dtype)  # [G, N, K]
    offs = torch.tensor([5, 5, 17, 24], dtype=torch.int32, device=device)  # [G]
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            grouped_mm(x, w, offs)  # warm up outside the capture, as every captured piece is
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = grouped_mm(x, w, offs)  # [M, N]
        graph.replay()
        torch.cuda.synchronize(device)
        return bool(torch.all(y == 32))  # ones . ones over K=32 (exact in any float dtype)
    except (RuntimeError, NotImplementedError, TypeError):
        torch.cuda.synchronize(device)
        return False


def rope_tables(dim: int, theta: float, max_context: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin [S, dim] exactly as transformers computes them: float32 angles, cast to the model dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [dim/2]
    pos = torch.arange(max_context, dtype=torch.float)  # [S]
    freqs = pos[:, None] * inv_freq[None, :]  # [S, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, dim]
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)  # [S, dim] x2


def expert_kernel(device: torch.device, dtype: torch.dtype):
    """(grouped GEMM works, its name for reports, the mm function every MoE call uses) on this device/dtype.
    Decode captures CUDA graphs only where :func:`probe_graph_capture` says the grouped GEMM captures."""
    grouped = probe_grouped_mm(device, dtype)
    name = "torch._grouped_mm" if grouped else "per-expert loop (torch._grouped_mm failed)"
    return grouped, name, grouped_mm if grouped else looped_mm


class Model:
    """Dense weights, RoPE tables and the layer functions. Stateless between calls except for ``kv``."""

    trace = None  # Callable[[layer, block, tensor], None] while a traced request prefills (runtime sets it)
    _trace_layer = -1  # the layer of the last attn_block call (moe_block is called for the same layer next)
    # decode's kernels, set by the Decoder: "triton" for the attention half's norms, rope, cache write and attention
    # (EngineConfig.decode_attention), and for the router's softmax and top-k (EngineConfig.decode_experts)
    decode_attention_kernel = "torch"
    decode_router_kernel = "torch"
    # decode's Triton kernels apply: the MoE block is the routed experts alone, decode attends over the whole cache
    triton_decode = True
    router_bias: list[torch.Tensor] | None = None  # random weights with router_skew: router_skew_bias

    def bias_of(self, layer: int) -> torch.Tensor | None:
        return None if self.router_bias is None else self.router_bias[layer]

    def __init__(self, cfg: ModelConfig, weights: DenseWeights, max_context: int, device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.w, self.device, self.dtype = cfg, weights, device, dtype
        self.max_context = max_context
        self.scale = cfg.head_dim**-0.5
        self.cos, self.sin = rope_tables(cfg.head_dim, cfg.rope_theta, max_context, device, dtype)  # [S, D] x2
        self.grouped, self.moe_kernel, self._mm = expert_kernel(device, dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w.embed)  # [T, H]

    def attention(self, layer: int, x: torch.Tensor, kv: KVCache, start: int) -> torch.Tensor:
        """Self-attention of x [T, H] (already normed) at positions [start, start+T); writes the KV cache."""
        cfg, lw = self.cfg, self.w.layers[layer]
        T, hq, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        end = start + T
        q = F.linear(x, lw.q_proj).view(T, hq, d)  # [T, Hq, D]
        k = F.linear(x, lw.k_proj).view(T, hkv, d)  # [T, Hkv, D]
        v = F.linear(x, lw.v_proj).view(T, hkv, d)  # [T, Hkv, D]
        q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps).transpose(0, 1)  # [Hq, T, D]
        k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps).transpose(0, 1)  # [Hkv, T, D]
        cos, sin = self.cos[start:end], self.sin[start:end]  # [T, D]
        q = q * cos + rotate_half(q) * sin  # [Hq, T, D]
        k = k * cos + rotate_half(k) * sin  # [Hkv, T, D]
        kv.k[layer][:, start:end] = k
        kv.v[layer][:, start:end] = v.transpose(0, 1)
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
        if self.decode_attention_kernel == "triton":  # q/k norms, rope and the cache write in one kernel
            q = qk_norm_rope_store(F.linear(x, lw.q_proj), F.linear(x, lw.k_proj), F.linear(x, lw.v_proj),
                                   lw.q_norm, lw.k_norm, self.cos, self.sin, pos, kv.k[layer], kv.v[layer],
                                   cfg.rms_norm_eps)  # [Hq, 1, D]
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

    def decode_attn_block(self, layer: int, x: torch.Tensor, kv: KVCache, pos: torch.Tensor, kv_len: int,
                          lookup=None):
        """``attn_block`` for one decode token (see ``decode_attention``): x [1, H] -> (x [1, H], h [1, H],
        router weights [1, k], router expert ids [1, k]); ``lookup``: ``decode_route``'s."""
        cfg, lw = self.cfg, self.w.layers[layer]
        eps = cfg.rms_norm_eps
        if self.decode_attention_kernel == "triton":  # each norm one kernel, the residual add in the second
            a = self.decode_attention(layer, fused_rms_norm(x, lw.input_norm, eps), kv, pos, kv_len)  # [1, H]
            x, h = fused_rms_norm(a, lw.post_norm, eps, residual=x)  # [1, H] x2
        else:
            x = x + self.decode_attention(layer, rms_norm(x, lw.input_norm, eps), kv, pos, kv_len)
            h = rms_norm(x, lw.post_norm, eps)  # [1, H]
        top_w, top_ids = decode_route(self.decode_router_kernel, h, lw.router, cfg.num_experts_per_tok,
                                      cfg.norm_topk_prob, self.bias_of(layer), lookup)  # [1, k] x2
        return x, h, top_w, top_ids

    def attn_block(self, layer: int, x: torch.Tensor, kv: KVCache, start: int):
        """First half of a layer: x [T, H] -> (x after attention residual [T, H], MoE input h [T, H],
        router weights [T, k], router expert ids [T, k])."""
        cfg, lw = self.cfg, self.w.layers[layer]
        a = self.attention(layer, rms_norm(x, lw.input_norm, cfg.rms_norm_eps), kv, start)  # [T, H]
        x = x + a  # [T, H]
        h = rms_norm(x, lw.post_norm, cfg.rms_norm_eps)  # [T, H]
        top_w, top_ids = route(h, lw.router, cfg.num_experts_per_tok, cfg.norm_topk_prob, self.bias_of(layer))  # [T, k] x2
        if self.trace is not None:
            self._trace_layer = layer
            self.trace(layer, "attention", a)
            self.trace(layer, "router", top_ids)
        return x, h, top_w, top_ids

    def moe_block(self, x: torch.Tensor, h: torch.Tensor, top_w: torch.Tensor, top_ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Second half of a layer: x + experts(h). ``top_ids`` index the first dim of gate_up/down."""
        y = moe_experts(h, top_w, top_ids, gate_up, down, self._mm)  # [T, H]
        out = x + y  # [T, H]
        if self.trace is not None:
            self.trace(self._trace_layer, "experts", y)
            self.trace(self._trace_layer, "residual", out)
        return out

    def logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head of the last position's hidden state [1, H] -> float32 logits [V]."""
        h = rms_norm(x_last, self.w.norm, self.cfg.rms_norm_eps)  # [1, H]
        return F.linear(h, self.w.lm_head)[0].float()  # [V]
