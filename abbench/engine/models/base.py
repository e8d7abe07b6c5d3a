"""The model interface the runtime drives, with every optional hook defaulted, so the runtime never asks a
model by name whether it has one.

Every family (:mod:`~abbench.engine.models.qwen3_moe`, :mod:`~abbench.engine.models.hybrid`,
:mod:`~abbench.engine.models.qwen4`) subclasses :class:`MoEModel` and its cache subclasses :class:`ModelCache`.
What the runtime calls of a model:

- ``embed(ids [T]) -> [T, W]``; ``attn_block(layer, x, cache, start) -> (x, h, top_w, top_ids)`` (attention or
  the mixer, writing the cache at [start, start+T), then the router); ``moe_block(x, h, top_w, top_ids,
  gate_up, down) -> x`` (the routed experts from whatever weights the caller passes: a streamed layer buffer,
  the decode slot cache, resident experts); ``logits(x_last [1, W]) -> [V]`` float32; their decode forms
  ``decode_attn_block`` / ``decode_moe``; ``new_cache`` where the family has its own cache.
- The hooks, defaulted here: ``prepare_decode(cache, token_id, pos)`` (host-side work before a decode step),
  ``prepare_layer_window(layer, cache, spans)`` (what a layer visit's chunks need uploaded before the next
  layer's bank copy is queued), ``bias_of(layer)`` (the router's logit bias), ``trace`` (a layer trace's
  observer while a traced request prefills), and the capabilities ``triton_decode`` (decode's Triton kernels
  serve it), ``attention_batching`` (adjacent chunks may share one attention call: ``attn_block_group``),
  ``prefill_graph_layers`` / ``prefill_graph_moe`` (which prefill half-steps replay from CUDA graphs).
- A cache's hook, defaulted in :class:`ModelCache`: ``write_tokens(start, ids)`` (models that read token ids
  inside their layers keep them per position).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from abbench.engine.ops.moe import moe_experts


class ModelCache:
    """What every family's cache offers the runtime beyond its tensors (module docstring)."""

    max_context: int
    # a batched decode's view: every sequence's cache of a layer as one tensor ``pool_k[l]`` / ``pool_v[l]``
    # [C, ...] with this cache at row ``index`` (Qwen3-MoE's ``KVCache.pooled``); None where caches stand alone
    pool_k: list[torch.Tensor] | None = None
    pool_v: list[torch.Tensor] | None = None
    index = 0

    def write_tokens(self, start: int, ids: torch.Tensor) -> None:
        """Record the token ids of positions [start, start + len(ids)); only models that read them keep them."""


class MoEModel:
    """The interface and the defaults of every family's model (module docstring)."""

    cfg: Any
    device: torch.device
    dtype: torch.dtype
    trace: Callable[[int, str, torch.Tensor], None] | None = None  # set by the runtime while a traced request
    _trace_layer = -1  # the layer of the last attn_block call (moe_block is called for the same layer next)
    # decode's kernels, set by the Decoder: "triton" for the attention half's norms, rope, cache write and
    # attention (EngineConfig.decode_attention), and for the router's softmax and top-k (decode_experts)
    decode_attention_kernel = "torch"
    decode_router_kernel = "torch"
    # prefill's attention half: "triton" runs its norms, rope, cache write and router top-k as decode's fused kernels
    # (EngineConfig.prefill_kernels; Qwen3-MoE, ``prefill_kernels_apply``), set by the engine
    prefill_kernel = "torch"
    prefill_kernels_apply = False
    triton_decode = False  # decode's Triton kernels apply: the MoE block is the routed experts alone
    attention_batching = False  # attn_block_group: adjacent chunks share one attention call (layer-major)
    prefill_graph_layers: frozenset[int] = frozenset()  # layers whose first half replays from a prefill graph
    prefill_graph_moe = False  # every MoE half replays from a prefill graph
    router_bias: list[torch.Tensor] | None = None  # random weights with router_skew: ops.moe.router_skew_bias
    _mm: Callable[..., torch.Tensor]

    def bias_of(self, layer: int) -> torch.Tensor | None:
        """The router's logit bias [E] float32 of ``layer``; None for unskewed routing."""
        return None if self.router_bias is None else self.router_bias[layer]

    batched_decode = False  # ``decode_attn_rows``: several sequences' decode tokens through a layer at once
    guesses_experts = False  # ``predict_experts``: a guess of a layer's experts one layer ahead (decode prefetch)

    def predict_experts(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """A guess of the experts [B, k] ``layer`` will route decode tokens x [B, H] to, from the residual stream
        before it; only where ``guesses_experts``."""
        raise NotImplementedError(f"{type(self).__name__} makes no guess of a layer's experts")

    def decode_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 logits [B, V] of decode tokens x [B, H] (``logits`` of each)."""
        return torch.stack([self.logits(x[i:i + 1]) for i in range(x.shape[0])])

    def prepare_decode(self, cache: Any, token_id: int, pos: int) -> None:
        """Host-side work before the decode step of ``token_id`` at ``pos`` (outside any CUDA graph)."""

    def cache_only(self, layer: int, x: torch.Tensor, cache: Any, start: int) -> bool:
        """Write only what ``attn_block`` would write into the cache for x at [start, ...), by the same calls,
        where that is less than the whole first half (a prefill chunk whose layer output nothing reads); True
        when done, False (nothing done) where the model has no such shortcut for this layer."""
        return False

    def prepare_layer_window(self, layer: int, cache: Any, spans: list[tuple[int, int]]) -> None:
        """Upload what ``layer``'s visit of the chunks ``spans`` needs from the host, ahead of its bank copy."""

    def moe_block(self, x: torch.Tensor, h: torch.Tensor, top_w: torch.Tensor, top_ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Second half of a layer: x + the routed experts(h) [T, H]. ``top_ids`` index the first dim of
        gate_up [G, 2I, H] / down [G, H, I]."""
        y = moe_experts(h, top_w, top_ids, gate_up, down, self._mm)  # [T, H]
        out = x + y  # [T, H]
        if self.trace is not None:
            self.trace(self._trace_layer, "experts", y)
            self.trace(self._trace_layer, "residual", out)
        return out
