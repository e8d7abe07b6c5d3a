"""Builds the right decoder and caches for a ModelConfig: ``build_model(...) -> (model, caches)``.

Contract: a plain ``ModelConfig`` gives ``model.Model`` with a ``model.KVCache``; a ``HybridConfig``
(Qwen3.5/3.6-MoE) gives ``hybrid.HybridModel`` with a ``hybrid.HybridCache``; a ``Qwen4Config`` (Qwen4-Exp)
gives ``qwen4.Qwen4Model`` with a ``qwen4.Qwen4Cache``. Both models have the methods
``prefill`` and ``decode`` call; the routed experts go into ``bank`` either way. ``weights`` is
"random:SEED" or a local checkpoint directory.
"""

from __future__ import annotations

import torch

from abbench.engine.config import ModelConfig
from abbench.engine.models.bank import ExpertBank
from abbench.engine.models.hybrid import HybridCache, HybridModel
from abbench.engine.models.qwen3_moe import KVCache, Model
from abbench.engine.ops.moe import router_skew_bias
from abbench.engine.models.qwen4 import Qwen4Cache, Qwen4Model
from abbench.engine.models.qwen4_weights import load_qwen4_checkpoint, random_qwen4_weights
from abbench.engine.models.weights import (
    load_checkpoint, load_hybrid_checkpoint, random_hybrid_weights, random_weights,
)


def build_model(mc: ModelConfig, weights: str, bank: ExpertBank, max_context: int, device: torch.device,
                dtype: torch.dtype, router_skew: float = 0.0,
                caches: int = 1) -> tuple[Model | HybridModel | Qwen4Model, list]:
    """The model and ``caches`` sequence caches (``new_caches``); ``router_skew`` > 0 (random weights only)
    concentrates the routing (:func:`~abbench.engine.ops.moe.router_skew_bias`)."""
    model = _build(mc, weights, bank, max_context, device, dtype)
    if router_skew > 0:
        if not weights.startswith("random:"):
            raise ValueError("router_skew applies to random weights only (a checkpoint's router is its own)")
        model.router_bias = router_skew_bias(mc.num_experts, mc.num_hidden_layers, router_skew,
                                             int(weights.split(":", 1)[1]), device)
    return model, new_caches(mc, caches, max_context, device, dtype)


def new_caches(mc: ModelConfig, n: int, max_context: int, device: torch.device,
               dtype: torch.dtype) -> list[KVCache | HybridCache | Qwen4Cache]:
    """The caches of ``n`` sequences: Qwen3-MoE's as rows of one pool per layer (``KVCache.pooled``, which its
    batched decode reads), the other families' one by one."""
    if not (mc.is_qwen4 or mc.is_hybrid):
        return KVCache.pooled(mc, n, max_context, device, dtype)
    return [new_cache(mc, max_context, device, dtype) for _ in range(n)]


def new_cache(mc: ModelConfig, max_context: int, device: torch.device,
              dtype: torch.dtype) -> KVCache | HybridCache | Qwen4Cache:
    """One sequence's cache for ``mc``'s family (the engine keeps one per sequence it may run at once)."""
    if mc.is_qwen4:
        return Qwen4Cache(mc, max_context, device, dtype)
    if mc.is_hybrid:
        return HybridCache(mc, max_context, device, dtype)
    return KVCache(mc, max_context, device, dtype)


def _build(mc: ModelConfig, weights: str, bank: ExpertBank, max_context: int, device: torch.device,
           dtype: torch.dtype) -> Model | HybridModel | Qwen4Model:
    seed = int(weights.split(":", 1)[1]) if weights.startswith("random:") else None
    if mc.is_qwen4:
        dense = (random_qwen4_weights(mc, seed, bank, device, dtype) if seed is not None
                 else load_qwen4_checkpoint(weights, mc, bank, device, dtype))
        return Qwen4Model(mc, dense, max_context, device, dtype)
    if mc.is_hybrid:
        dense = (random_hybrid_weights(mc, seed, bank, device, dtype) if seed is not None
                 else load_hybrid_checkpoint(weights, mc, bank, device, dtype))
        return HybridModel(mc, dense, max_context, device, dtype)
    dense = (random_weights(mc, seed, bank, device, dtype) if seed is not None
             else load_checkpoint(weights, mc, bank, device, dtype))
    return Model(mc, dense, max_context, device, dtype)
