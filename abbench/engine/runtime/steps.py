"""The layer step every prefill mode runs, eager or replayed from CUDA graphs, and layer-major attention batching.

Contract:
- ``LayerSteps(model, graphs, graph_tokens)`` runs one chunk through one layer in two halves, the calls every
  prefill mode makes: ``attn(layer, x, kv, start)`` (the model's ``attn_block``; returns the router's expert
  ids [T, k], which demand loading reads back) and ``moe(x, gate_up, down)`` (``moe_block`` over the experts
  the caller passes), which writes the layer's output into ``x`` in place. ``layer(...)`` is both;
  ``attn_only`` the first half of a step whose output nothing reads (counted in ``moe_skipped``);
  ``hold_mid``/``resume`` keep a first half aside for a later MoE half.
- CUDA graphs (``graphs`` a :class:`~abbench.engine.runtime.graphs.GraphCache`): a chunk of exactly ``graph_tokens``
  tokens runs the half-steps whose shapes and addresses are fixed from static buffers: the first half of
  every layer in ``model.prefill_graph_layers`` (the hybrid's Gated DeltaNet layers: norms, projections, conv,
  delta rule, shared expert and router; the state buffers are the cache's own) and, where
  ``model.prefill_graph_moe`` (the hybrid), the MoE half of every layer (keyed by the expert tensors it
  reads: the two streamed layer buffers, or each layer's resident experts).
  The input is copied into a static buffer, the halves meet in static buffers, the output is copied back. The
  rest (attention layers' first halves, whose shapes grow with the position; a prompt's last, shorter chunk;
  traced requests) runs eagerly and meets the MoE graph in the same static buffers. Measured on the H200
  (Qwen3.5-35B-A3B shape): one DeltaNet layer step launches ~90 kernels and costs more host time than GPU
  time eagerly, so a layer-major pass over one DeltaNet layer's 64 chunks ran at the host's pace while the
  GPU idled (docs/hybrid-at-the-floor.md). Whether a piece runs eagerly or from a graph depends only on
  the chunk's length and the layer, never on the prefill mode, so every mode still makes the same calls in
  the same shapes and the modes stay bitwise equal; eager and replayed pieces run the same kernels (checked
  on CUDA by the engine tests).
- Attention batching (``plan_attention_groups``, layer-major only): ``k`` adjacent chunks of one window share
  one attention call in a full-attention layer (``attn_block_group``) when all of these hold, otherwise each
  chunk runs alone and the group is counted as a fallback with its reason:
  1. ``exact``: on this device the joint call computes every query row bit for bit as the chunk's own call
     (``hybrid.attention_batching_exact``, probed once per chunk length at start) -- "not-bit-identical";
  2. the window has ``k`` chunks left -- "window-end";
  3. every chunk of the group is a full chunk -- "short-chunk";
  4. the group ends at or below ``max_context`` tokens, where the joint call pays -- "long-context".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from abbench.engine.runtime.graphs import GraphCache

FALLBACK_REASONS = ("not-bit-identical", "window-end", "short-chunk", "long-context")


@dataclass
class BatchingStats:
    """Attention groups of k > 1 chunks run as one call, and groups that fell back to one call per chunk."""

    batched: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)


def plan_attention_groups(window: list[tuple[int, int]], k: int, chunk_tokens: int, max_context: int,
                          exact: bool, stats: BatchingStats | None = None) -> list[list[int]]:
    """The chunks of ``window`` [(a, b)) as groups of indices that share one attention call (see the module
    docstring's rule); groups of one run alone. Counts into ``stats``."""
    if k <= 1:
        return [[c] for c in range(len(window))]
    groups: list[list[int]] = []
    c = 0
    while c < len(window):
        group = list(range(c, min(c + k, len(window))))
        reason = None
        if not exact:
            reason = "not-bit-identical"
        elif len(group) < k:
            reason = "window-end"
        elif any(window[i][1] - window[i][0] != chunk_tokens for i in group):
            reason = "short-chunk"
        elif window[group[-1]][1] > max_context:
            reason = "long-context"
        if reason is None:
            groups.append(group)
            if stats is not None:
                stats.batched += 1
        else:
            groups.extend([i] for i in group)
            if stats is not None:
                stats.fallbacks[reason] = stats.fallbacks.get(reason, 0) + 1
        c += len(group)
    return groups


class LayerSteps:
    """See the module docstring. One per engine (its static buffers are reused by every request)."""

    def __init__(self, model, graphs: GraphCache | None = None, graph_tokens: int | None = None):
        self.model, self.graphs, self.T = model, graphs, graph_tokens
        self._mid: tuple[torch.Tensor, ...] | None = None
        self.static_mid: tuple[torch.Tensor, ...] | None = None
        # routing counts [L, E] int64 on the device, when the engine tracks them (prefill mode auto): every
        # chunk's routed expert ids are added after its first half, without a host sync
        self.route_counts: torch.Tensor | None = None
        self.moe_skipped = 0  # chunks whose MoE half was left out (``attn_only``), lifetime
        if graphs is not None:
            cfg, dev, dt = model.cfg, model.device, model.dtype
            T, W, H, k = graph_tokens, cfg.stream_width, cfg.hidden_size, cfg.num_experts_per_tok
            self.xin = torch.zeros(T, W, device=dev, dtype=dt)  # [T, W] a graphed first half's input
            self.static_mid = (torch.zeros(T, W, device=dev, dtype=dt), torch.zeros(T, H, device=dev, dtype=dt),
                               torch.zeros(T, k, device=dev, dtype=dt),
                               torch.zeros(T, k, device=dev, dtype=torch.long))  # x, h [T, H]; top_w, top_ids [T, k]
            self.xout = torch.zeros(T, W, device=dev, dtype=dt)  # [T, W] the MoE half's output

    @property
    def replays(self) -> int:
        return 0 if self.graphs is None else self.graphs.replays

    def _graphed(self, x: torch.Tensor) -> bool:
        return self.graphs is not None and x.shape[0] == self.T and self.model.trace is None

    def _store_mid(self, mid: tuple[torch.Tensor, ...]) -> None:
        for dst, src in zip(self.static_mid, mid, strict=True):
            dst.copy_(src)

    def track_routing(self) -> None:
        cfg = self.model.cfg
        self.route_counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.long,
                                        device=self.model.device)  # [L, E]

    def _count(self, layer: int) -> None:
        if self.route_counts is not None:
            ids = self._mid[3].reshape(-1)  # [T*k]
            self.route_counts[layer].scatter_add_(0, ids, torch.ones_like(ids))

    def attn(self, layer: int, x: torch.Tensor, kv, start: int) -> torch.Tensor:
        """The first half of ``layer`` for x [T, W] at [start, start+T); returns the routed expert ids [T, k]."""
        self._attn(layer, x, kv, start)
        self._count(layer)
        return self._mid[3]

    def _attn(self, layer: int, x: torch.Tensor, kv, start: int) -> None:
        model = self.model
        if not self._graphed(x):
            self._mid = model.attn_block(layer, x, kv, start)
            return
        self._mid = self.static_mid
        if layer in model.prefill_graph_layers:
            self.xin.copy_(x)
            key = ("prefill-attn", layer, start == 0, self.T, kv.conv[kv.slot[layer]].data_ptr())
            self.graphs.run(key, lambda: self._store_mid(model.attn_block(layer, self.xin, kv, start)))
        else:
            self._store_mid(model.attn_block(layer, x, kv, start))

    def set_mid(self, layer: int, x: torch.Tensor, mid: tuple[torch.Tensor, ...]) -> None:
        """Take ``layer``'s first half computed elsewhere (a batched attention group) for chunk x."""
        if self._graphed(x):
            self._store_mid(mid)
            self._mid = self.static_mid
        else:
            self._mid = mid
        self._count(layer)

    def attn_only(self, layer: int, x: torch.Tensor, kv, start: int) -> None:
        """What ``layer`` writes into the cache for x, where nothing reads the layer's output (the last layer of a
        chunk that is not its prompt's last): the model's ``cache_only`` (a full-attention layer's keys and
        values, by the calls the first half makes: no queries, attention, output, shared expert or router), or
        else the whole first half; never the MoE half. Counted in ``moe_skipped``; where the router does not run,
        its routing is not counted in ``route_counts``."""
        if not self.model.cache_only(layer, x, kv, start):
            self.attn(layer, x, kv, start)
        self._mid = None
        self.moe_skipped += 1

    def hold_mid(self) -> tuple[torch.Tensor, ...]:
        """A copy of the first half just computed (``attn``), to be taken up later by ``resume``: a graphed chunk's
        half lives in the static buffers, which the next chunk's first half overwrites."""
        held = tuple(t.clone() for t in self._mid)
        self._mid = None
        return held

    def resume(self, x: torch.Tensor, mid: tuple[torch.Tensor, ...]) -> None:
        """Take up chunk x's first half held by ``hold_mid`` (its routing was counted when it was computed)."""
        if self._graphed(x):
            self._store_mid(mid)
            self._mid = self.static_mid
        else:
            self._mid = mid

    def moe(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """The MoE half over ``gate_up`` [G, 2I, H], ``down`` [G, H, I]; the layer's output goes into x."""
        model, mid = self.model, self._mid
        if mid is not None and mid is self.static_mid and model.prefill_graph_moe:
            key = ("prefill-moe", self.T, gate_up.data_ptr(), down.data_ptr())
            self.graphs.run(key, lambda: self.xout.copy_(model.moe_block(*mid, gate_up, down)))
            x.copy_(self.xout)
        else:
            x.copy_(model.moe_block(*mid, gate_up, down))
        self._mid = None

    def layer(self, layer: int, x: torch.Tensor, kv, start: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.attn(layer, x, kv, start)
        self.moe(x, gate_up, down)
