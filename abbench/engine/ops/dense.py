"""Dense ops every model family builds on: RMSNorm, RoPE tables and rotation, the lower-right causal mask of
chunked prefill, SDPA's kernel choice, and one decode token's grouped-query attention.

- ``attention_backends()``: the context the layers run in: SDPA may use flash, memory-efficient or math
  kernels, not cuDNN (it builds an execution plan for every new shape, i.e. every decode step's KV length:
  measured on an H200, 35 ms/token decode became 70-160 ms/token on lengths not seen before).
- ``lower_right_causal(T, S, device)``: the mask of T queries at positions [S-T, S) over keys [0, S).
- ``rms_norm(x [..., N], weight [N], eps)``: float32 statistics, cast back (transformers' Qwen3 RMSNorm).
- ``rope_tables(dim, theta, max_context, ...)``: cos, sin [S, dim]; ``rotate_half(x [..., D])``.
- ``decode_gqa(q [Hq, 1, D], keys, values [Hkv, L, D], hidden [L], scale)`` -> [Hq, 1, D]; ``decode_attend``
  picks it ("torch") or the split-KV Triton kernel of :mod:`abbench.engine.ops.kernels` ("triton").
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from abbench.engine.ops.kernels import attention_split_kv


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


def rope_tables(dim: int, theta: float, max_context: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin [S, dim] exactly as transformers computes them: float32 angles, cast to the model dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [dim/2]
    pos = torch.arange(max_context, dtype=torch.float)  # [S]
    freqs = pos[:, None] * inv_freq[None, :]  # [S, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, dim]
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)  # [S, dim] x2
