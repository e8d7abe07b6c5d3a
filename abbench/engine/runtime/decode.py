"""Decode: one token per sequence at a time through the decode slot cache (or resident experts), one sequence
or a batch of them in one step; the tokens are chosen by :mod:`abbench.engine.ops.sampling`.

Contract:
- ``Decoder(model, store, caches, graphs)``; ``decoder.step(token_id, pos, cancel, misses, cache) -> logits [V]
  float32`` runs the token at position ``pos`` of the sequence cache ``cache`` through every layer, writing its
  KV (and a hybrid's states). ``step_batch(items)`` does the same for several sequences at once (below). The
  step has static shapes: the token
  and the position sit in device buffers, attention runs over a KV length ``kv_len`` (the smallest power of
  two >= pos + 1, at least 1,024, at most the cache) with later positions masked (``Model.decode_attn_block``),
  and the experts run through the same grouped-GEMM code as prefill (``Model.moe_block``) over one layer's
  weights: resident experts [E, ...] or the layer's slot block [S, ...], so no call has more than
  num_experts groups.
- Three ways to run a step, all calling the same functions with the same shapes, so their results are
  bitwise equal (checked on CPU and on CUDA):
  * **whole step** when no expert can miss (resident, or a slot cache that holds every expert of every layer
    with expert e in slot e): embedding, all layers and the logits in one go, no host sync;
  * **per layer** when experts can miss and the host handles the misses (``misses="host"``): per layer the
    attention half runs, the router's choice is read back (one host sync per layer), the host looks up the
    slot cache, copies the misses from the host bank into the layer's slots (counted), writes the slot ids
    to a device buffer, and the MoE half runs;
  * **whole step with the misses on the device** (``misses="device"``, Triton's experts): per layer, the
    experts' first kernel looks the routed experts up in the slot cache's device-side table (the host's LRU
    policy), and the experts' kernels read the misses from the registered host bank over PCIe (an FP8 bank's as
    FP8 with their row scales, dequantized in the kernels to the bits the host's copy would leave), computing
    with them while they store them into their slots (``decode_kernels.moe_tokens``' ``lookup`` and ``host``),
    so the step is one graph that never waits for the host
    and the copies overlap the hit experts' work. The same policy as the host's, so
    the two ways pick the same slots and decode bitwise alike; ``step(misses=...)`` chooses per step, each
    side catching up with the other's changes first (``SlotCache.sync_device`` / ``sync_host``). The
    default is the engine's (``EngineConfig.decode_misses``: "auto" = device with Triton's experts);
  * on CUDA, when ``graphs`` is true, each of these pieces is captured once per (sequence cache, ``kv_len``) as a
    CUDA graph and replayed (the whole step as one graph; per layer one graph for the attention half and one
    for the MoE half; the embedding and the head), which removes the per-kernel launch cost that dominates
    eager decode (~80 kernels a layer). Every sequence cache has its own static buffers (token, position, the
    activations between pieces, slot ids, logits) and its own graphs, in a memory pool of its own: the
    attention half's outputs live in its graph's pool until the MoE half reads them, and in a batch other
    caches' pieces run in between; one shared pool would let a graph captured later place those outputs in
    memory another cache's graph uses as scratch. So at most C x (2 + buckets x (2 x layers + 2)) graphs for C
    caches (``kv_buckets``; the whole step per way of handling misses), and C pools of a step's temporaries
    (the largest at the longest ``kv_len``: tens of MB with the torch attention at 128K positions, by estimate,
    not measured; they come out of the memory plan's runtime reserve). ``warm`` captures every cache's graphs,
    so every graph a batch replays.
- **A batched step** (``step_batch(items) -> [DecodeResult]``, ``DecodeItem(token_id, pos, cache, cancel,
  misses)``: B sequences, one per cache) gives each sequence bitwise the logits of its solo step: each runs the
  same pieces, with the same shapes, over its own cache and buffers, and its experts are the same weights
  wherever they sit. The items' order is the order of their slot lookups in every layer (each layer's LRU is
  touched only by that layer's lookups, so it evolves as if the steps ran one after another in that order).
  * items whose host handles their misses run **layer-outer**: per layer, every item's attention half, then one
    host read of all their routed experts (one sync per layer for the batch, not one per sequence; ``syncs``
    counts the reads), then per item in order its lookup (``ExpertStore.decode_experts``: an expert an
    earlier item just loaded is a hit, so the union of the batch's experts is copied once) and at once its MoE
    half, before the next item's lookup can evict a slot it reads. On CUDA the miss copies go on the compute
    stream, behind the MoE halves already queued, so a later item's copy into a slot runs after every earlier
    read of it; then each item's head into its own logits;
  * items whose step runs whole (nothing can miss, or the device handles the misses) replay their whole-step
    graphs back to back with no host sync in between;
  * the items are taken in list order in runs of either kind (an item the device serves between host-served
    ones splits the layer-outer run, so the lookup order stays the list's);
  * the logits stay in each cache's buffer; the caller samples after the batch.
  * **Cancellation** is checked before each item's step and, in the layer-outer run, before each of its layers
    from the second on: a cancelled item leaves the remaining layers (its result holds ``Cancelled``; its cache
    is as a cancelled solo step leaves it), the others go on. A whole step is not interrupted.
  * **Failures**: an exception raised by one item's own work (its attention half, its lookup and copies, its
    MoE half, its head, its whole step) ends that item's step only, as it ended that step alone. An exception
    from the batch's shared routing read (where an asynchronous CUDA error of any item surfaces) is no one
    item's: every item still in the run gets it.
  * **Accounting**: each miss copy is charged to the item whose lookup missed (``DecodeResult.traffic`` /
    ``lookups``: the store's counters before and after that item's ``decode_experts``); an item that hits what
    an earlier item loaded is charged the hit only. Device-handled items: the device table's hit and miss
    counts are copied on the device before and after each one's step (no sync), and ``settle(results)``,
    called after sampling, reads them once, charges each item and folds the counts into the store.
  * **Batched compute** (``self.batched``: Qwen3-MoE with Triton's experts and attention, its caches rows of
    one pool, ``KVCache.pooled``): consecutive items that run whole the same way (resident, a complete slot
    cache, or misses on the device) run as **one batched step** (``_together``): every layer's attention half
    over all their tokens at once (``Model.decode_attn_rows``: each projection a GEMV per token, the q/k norms,
    RoPE and cache writes one kernel, split-KV attention per token over its own cache with its own split plan,
    read on the device), then the routed experts of all their tokens (``decode_kernels.moe_tokens``: each
    expert's weights read once for every token routed to it, the batch's experts looked up in the slot table
    once each, a miss read over PCIe once and left in its slot; an expert the slots cannot take this step, when
    the batch routes to more experts than a layer has slots, read from the host uncached), then the logits
    (``Model.decode_logits``). One graph per (batch size, way), whatever the positions. Every kernel computes a
    token's values from that token's inputs alone, in an order fixed by compile-time sizes that do not depend
    on the batch (``max_tokens`` = the number of caches), and a solo step runs the same kernels as a batch of
    one, so a sequence's bits are the same alone and in any batch. The device's lookups of a batched step are
    charged per token (each expert to the first token routed to it; ``settle``). Items whose host handles their
    misses still run layer-outer, a one-token step each (they share the routing read and the union's copies).
  * **Batched experts, layer-outer** (``self.rows_batched``: Triton's experts without the batched attention half,
    i.e. the Qwen3.5/3.6 hybrid, whose DeltaNet states and attention are per cache): such a run goes layer by
    layer with no host sync (``_rows_step``): each item's attention half exactly as in its solo step (its
    cache's graph of that piece, per (cache, layer, kv_len)), its outputs into its cache's rows, then one piece
    for the layer's experts of all the items' tokens at once (``moe_tokens`` over the rows the batch's cache
    indices pick, read on the device: one graph per (layer, batch size, way)), then each item's head. So each
    item's bits are its solo step's, each expert is read once for the batch, and the launches are L x (B + 1)
    graphs a step instead of B. Qwen4-Exp decodes a token per sequence (its experts are torch's).
- **Prefetch** (``prefetch``, ``EngineConfig.decode_prefetch``; misses on the device, a model that
  ``guesses_experts``): in a device-handled whole step (one sequence's, or a batched step of Qwen3-MoE), between
  each layer's attention half and its experts, the next layer's experts are guessed from the residual stream
  (``Model.predict_experts``) and, on a side stream forked inside the step's graph, looked up in that layer's
  slot table and the ones it lacks copied in from the host bank (``decode_kernels.prefetch_experts``; the
  table's ``prefetch_layer``: stamped one step old, so the step's own lookup may evict a wrong guess, and
  counted apart), beside this layer's experts and the next attention half; the main stream waits for it before
  the next layer's experts. The next lookup finds the right guesses as hits; a slot holds the bank's bits
  whoever copied them, so every output is bitwise the same with or without it. The copies are charged as
  traffic (``settle``; each expert to the first token guessed to it in a batch), not as lookups. The
  layer-outer batches (the hybrid's) and the host's way run without it.
- Decode kernels (``EngineConfig.decode_experts`` / ``decode_attention``; default "auto": "triton" on CUDA for
  a model whose decode they serve (``Model.triton_decode``: Qwen3-MoE and the Qwen3.5/3.6 hybrid) at a head
  dimension they take, with Triton installed; otherwise "grouped" / "torch"). ``self.kernels`` names what runs.
  * ``experts="triton"``: the router's softmax/top-k as one kernel (``decode_kernels.route_topk``) and the
    routed experts as GEMVs over the routed experts only, grouped by expert, with the residual added
    (``decode_kernels.moe_tokens``) instead of ``Model.moe_block``'s grouped GEMM over every expert;
  * ``attention="triton"``: split-KV flash decoding up to the device-held position
    (``decode_kernels.attention_split_kv``) instead of ``decode_gqa``; for Qwen3-MoE also the norms, q/k norms,
    RoPE and cache write fused (``Model.decode_attn_block``), for the hybrid its norms around the mixer.
  Every way of running a step uses the same kernels, so they stay bitwise equal among themselves (not to the
  torch kernels' decode: other summation orders). On the H200 a resident Qwen3-30B-A3B step went from 0.402 to
  0.147 ms a layer (results/20261201n-h200-decode-kernels).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from abbench.engine.ops import kernels as decode_kernels
from abbench.engine.config import DECODE_ATTENTION, DECODE_EXPERTS, DECODE_MISSES
from abbench.engine.runtime.experts import ExpertStore, SlotStats, Traffic
from abbench.engine.runtime.graphs import GraphCache
from abbench.engine.models.qwen3_moe import KVCache, Model
from abbench.engine.ops.dense import attention_backends
from abbench.engine.ops.batch_attention import split_plan
from abbench.engine.ops.moe import probe_graph_capture
from abbench.engine.contract import CancelLike, check_cancel

MIN_KV_LEN = 1024


def kv_buckets(max_context: int) -> list[int]:
    """Every attention length a decode step can use with a cache of ``max_context`` positions, ascending
    (each one :func:`kv_len_for` gives from the position after the last)."""
    out: list[int] = []
    while not out or out[-1] < max_context:
        out.append(kv_len_for(out[-1] if out else 0, max_context))
    return out


def kv_len_for(pos: int, max_context: int) -> int:
    """The attention length of a decode step at ``pos``: a power of two >= pos + 1 (>= MIN_KV_LEN), capped at
    the cache length. Few distinct values, so few graphs; at most 2x the keys actually needed."""
    n = MIN_KV_LEN
    while n < pos + 1:
        n *= 2
    return min(n, max_context)


@dataclass
class DecodeItem:
    """One sequence's token in a batched decode step (``Decoder.step_batch``)."""

    token_id: int
    pos: int
    cache: int = 0  # its sequence cache: an index into ``Decoder.caches``
    cancel: CancelLike = None
    misses: str | None = None  # who handles its slot cache's misses (``Decoder.check_misses``); None: the default


@dataclass(eq=False)
class DecodeResult:
    """One item's part of a batched step: its logits [V] float32 (its cache's buffer, valid until that cache's next
    step) or the exception that ended its step (then no logits), how it ran ("whole" / "per_layer"; "" when it
    never started), and what it is charged with: the expert copies and slot lookups its own lookups made (those
    the device made are added by ``Decoder.settle``)."""

    logits: torch.Tensor | None = None
    error: BaseException | None = None
    way: str = ""
    traffic: Traffic = field(default_factory=Traffic)
    lookups: SlotStats = field(default_factory=SlotStats)
    counts_row: int | None = None  # device-side lookups: rows 2r (before its step) and 2r + 1 (after) of counts_at
    prefetched: int = 0  # experts the prefetch copied in for it (also in ``traffic``; ``settle``)


class _Buffers:
    """One sequence cache's static buffers: a step's token and position, the activations between its pieces, the
    slot ids of its experts (on their way up, and on the device) and its logits. Each cache has its own, so the
    steps of several sequences can be in flight together (the per-layer path of a batch runs every sequence's
    attention half before any MoE half; a batch's logits are sampled after the batch) and every graph reads and
    writes addresses no other cache's step touches."""

    def __init__(self, model: Model, n_layers: int, k: int):
        cfg, dev = model.cfg, model.device
        self.token = torch.zeros(1, dtype=torch.long, device=dev)  # [1]
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # [1]
        self.x = [torch.zeros(1, cfg.stream_width, dtype=model.dtype, device=dev)
                  for _ in range(n_layers + 1)]  # [1, W] input of each layer, and the last output (W = H,
        # or hc*H for Qwen4-Exp's hyper-connection streams)
        self.slot_ids = torch.zeros(n_layers, 1, k, dtype=torch.long, device=dev)  # [L, 1, k]
        # [L, 1, k] slot ids on their way up (pinned on CUDA): written by the host, read by a copy queued on the
        # stream. Per cache, because in a batch the next sequence's ids are written before this one's copy ran;
        # the same cache's next write to a layer's row comes after a host sync (the next layer's routing read,
        # or the sampling after the step), so the copy that read it has run
        self.host_ids = torch.zeros(n_layers, 1, k, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.logits = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=dev)  # [V]


class _BatchBuffers:
    """A batched step's static buffers (``Decoder._batch_step``), row i for the batch's i-th item: token, position,
    cache index and split plan (filled from pinned staging rows with one copy each), the batch's logits and
    each token's hits and misses in the slot table."""

    def __init__(self, model: Model, n: int):
        dev, pin = model.device, model.device.type == "cuda"
        self.token = torch.zeros(n, dtype=torch.long, device=dev)  # [C]
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.index = torch.zeros(n, dtype=torch.long, device=dev)
        self.plan = torch.zeros(n, 2, dtype=torch.int32, device=dev)  # [C, 2] (nsplits, split)
        self.stage = torch.zeros(3, n, dtype=torch.long, pin_memory=pin)  # token, pos, index on their way up
        self.stage_plan = torch.zeros(n, 2, dtype=torch.int32, pin_memory=pin)
        self.logits = torch.zeros(n, model.cfg.vocab_size, dtype=torch.float32, device=dev)  # [C, V]
        self.token_counts = torch.zeros(decode_kernels.next_pow2(n), 2, dtype=torch.long, device=dev)


class _RowBuffers:
    """The layer-outer batched step's rows (``Decoder._rows_step``): every cache's layer inputs x[l] [C, W], and the
    attention half's outputs of the layer being stepped (x after the mixer [C, W], h [C, H], router weights and
    expert ids [C, k]), row c for cache c; the batch's cache indices on the device (staged), each token's hits
    and misses."""

    def __init__(self, model: Model, n: int, n_layers: int, k: int):
        cfg, dev = model.cfg, model.device
        self.x = [torch.zeros(n, cfg.stream_width, dtype=model.dtype, device=dev) for _ in range(n_layers + 1)]
        self.mid = torch.zeros(n, cfg.stream_width, dtype=model.dtype, device=dev)
        self.h = torch.zeros(n, cfg.hidden_size, dtype=model.dtype, device=dev)
        self.top_w = torch.zeros(n, k, dtype=model.dtype, device=dev)
        self.top_ids = torch.zeros(n, k, dtype=torch.long, device=dev)
        self.index = torch.zeros(n, dtype=torch.long, device=dev)
        self.stage = torch.zeros(n, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.token_counts = torch.zeros(decode_kernels.next_pow2(n), 2, dtype=torch.long, device=dev)


class Decoder:
    """Static buffers and the step functions of decode; see the module docstring."""

    def __init__(self, model: Model, store: ExpertStore, kv: KVCache | list[KVCache], graphs: bool,
                 experts: str = "grouped", attention: str = "torch", misses: str = "host", prefetch: bool = False):
        # the sequences' caches (one per sequence the engine may run at once), each with its own buffers and
        # graphs; ``self.cache`` / ``self.kv``: the one stepped last (``logits`` is its buffer)
        self.caches = list(kv) if isinstance(kv, (list, tuple)) else [kv]
        self.model, self.store, self.kv, self.cache = model, store, self.caches[0], 0
        self.max_tokens = len(self.caches)  # the most tokens a step takes: every kernel is compiled for that many
        experts = self._auto(experts, "grouped", True)
        if store.slots is not None and store.slots.fp8 and experts != "triton":
            raise ValueError(f"FP8 slots are read by decode's Triton experts (decode_experts 'triton'); this engine "
                             f"decodes with {experts!r} (slot_dtype 'model' keeps the slots in the compute dtype)")
        # resident FP8 experts (fp8_dequant 'gemm', 'w8a8'): Triton's experts read their values and scales as FP8
        # slots'; torch's read them dequantized (ExpertStore.decode_weights)
        self.reads_fp8 = experts == "triton"
        attention = self._auto(attention, "torch", decode_kernels.attention_applies(model.cfg.head_dim))
        self.moe = self._moe_function(experts)
        model.decode_attention_kernel = self._attention_kernel(attention)
        model.decode_router_kernel = "triton" if experts == "triton" else "torch"
        self.kernels = f"experts={experts}, attention={attention}"  # what ran, for the request stats
        cfg, dev = model.cfg, model.device
        # who handles the slot cache's misses by default: None (resident experts), "host" or "device" (module
        # docstring); a request may ask for the other (``step(misses=...)``) where the experts are Triton's
        # (an FP8 bank with block scales: the host's; the device-side fetch dequantizes per-row scales only)
        self.table = (store.slots.attach_table(cfg.num_experts_per_tok)
                      if store.slots is not None and experts == "triton" and store.bank.block is None else None)
        self.misses = None
        if store.slots is not None:
            if misses not in DECODE_MISSES:
                raise ValueError(f"decode_misses must be one of {DECODE_MISSES}, got {misses!r}")
            self.misses = self._valid_misses(("device" if self.table is not None else "host") if misses == "auto"
                                             else misses)  # judged as a request's choice is
        self.n_layers, self.k = cfg.num_hidden_layers, cfg.num_experts_per_tok
        self.bufs = [_Buffers(model, self.n_layers, self.k) for _ in self.caches]  # one set per sequence cache
        # the attention half's outputs (x, h, top_w, top_ids) per (cache, layer, kv_len): a graph's outputs live
        # in the memory it was captured with, and the MoE half's graph for that kv_len reads exactly those
        self.mid: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        # a graph cannot hold a host read-back: with the looped expert kernel (no grouped GEMM for this
        # device/dtype), or a grouped GEMM that reads its offsets back (float32 on CUDA in torch 2.11), every
        # step runs eagerly. One GraphCache, so one memory pool, per sequence cache (module docstring)
        self.graphs = ([GraphCache(dev) for _ in self.caches]
                       if graphs and dev.type == "cuda" and model.grouped and probe_graph_capture(dev, model.dtype)
                       else None)
        # the device table's hit/miss counts either side of each device-handled item of a batch (``settle``)
        self.counts_at = (torch.zeros(2 * len(self.caches), 4, dtype=torch.long, device=dev)
                          if self.table is not None else None)  # [2C, 4]: hits, misses, prefetch's two counts
        # B sequences' tokens through each layer at once (``_together``): Qwen3-MoE with Triton's experts and
        # attention, its caches rows of one pool
        self.batched = (experts == "triton" and attention == "triton" and model.batched_decode
                        and len(self.caches) > 1 and self.caches[0].pool_k is not None
                        and all(c.pool_k is self.caches[0].pool_k and c.index == i for i, c in enumerate(self.caches)))
        self.batch = _BatchBuffers(model, len(self.caches)) if self.batched else None
        # other models with Triton's experts (the Qwen3.5/3.6 hybrid): layer-outer, each sequence's attention
        # half as alone, then the experts of all their tokens at once (``_rows_step``)
        self.rows_batched = experts == "triton" and not self.batched and len(self.caches) > 1
        self.rows = (_RowBuffers(model, len(self.caches), cfg.num_hidden_layers, cfg.num_experts_per_tok)
                     if self.rows_batched else None)
        self.batch_graphs = (GraphCache(dev) if (self.batched or self.rows_batched) and self.graphs is not None
                             else None)
        # the prefetch (module docstring): each layer's experts guessed from the residual stream one layer ahead
        # and brought into its slots on a side stream while the compute goes on
        self.prefetch = self._prefetch_built = bool(prefetch)
        if self.prefetch:
            if self.table is None or self.misses != "device":
                raise ValueError("decode_prefetch brings experts into the slots the device looks up: it needs "
                                 "offloaded experts with the misses on the device (decode_misses 'device' or auto, "
                                 "Triton's experts)")
            if not model.guesses_experts:
                raise ValueError(f"decode_prefetch: {cfg.name}'s decode has no guess of the next layer's experts "
                                 "(Qwen3-MoE and the Qwen3.5/3.6 hybrid have)")
            self.pf_ids = torch.zeros(self.n_layers, len(self.caches) * self.k, dtype=torch.long, device=dev)
            self.pf_bufs = [decode_kernels.PrefetchBuffers.empty(len(self.caches), self.k, dev)
                            for _ in range(self.n_layers)]
            self.pf_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
            if self.batch is not None:
                self.batch.pf_token_counts = torch.zeros_like(self.batch.token_counts)
        self._batch_counts: list[tuple[torch.Tensor, list[tuple[DecodeResult, int]]]] = []
        self.steps = {"whole": 0, "per_layer": 0, "batched": 0}  # (batched: runs of several items, each "whole")
        self.syncs = 0  # host reads of device results: the routing of a per-layer layer, the counts' snapshots

    def set_prefetch(self, on: bool) -> None:
        """Turn the prefetch on or off between steps, in a decoder built with it (its buffers and side stream);
        each setting's steps are graphs of their own, captured when first run. For a measure of both on one
        engine (``tools.gpucheck_batch --decode-prefetch both``)."""
        if on and not self._prefetch_built:
            raise ValueError("set_prefetch: this decoder was built without the prefetch (decode_prefetch)")
        self.prefetch = bool(on)

    def _auto(self, choice: str, fallback: str, shape_ok: bool) -> str:
        """"auto": "triton" on CUDA for a model whose decode the Triton kernels serve, at a shape they take
        (``shape_ok``), with Triton installed; otherwise ``fallback``. Any other choice as given."""
        if choice != "auto":
            return choice
        usable = (self.model.device.type == "cuda" and self.model.triton_decode and shape_ok
                  and decode_kernels.have_triton())
        return "triton" if usable else fallback

    def _moe_function(self, experts: str) -> Callable[..., torch.Tensor]:
        """The MoE half of a decode step: ``Model.moe_block`` or, for "triton", the same residual around
        ``decode_kernels.moe_tokens``. ValueError for an unknown name, a model whose MoE block is its own,
        or no Triton."""
        if experts not in DECODE_EXPERTS:
            raise ValueError(f"decode_experts must be one of {DECODE_EXPERTS}, got {experts!r}")
        if experts == "grouped":
            return self.model.moe_block
        if not self.model.triton_decode:
            raise ValueError(f"decode_experts 'triton' needs a model whose MoE block is the routed experts alone "
                             f"(Qwen3-MoE, Qwen3.5/3.6); {self.model.cfg.name} has its own")
        if not decode_kernels.have_triton():
            raise ValueError("decode_experts 'triton' needs Triton (a CUDA build of torch ships it)")

        def moe(x: torch.Tensor, h: torch.Tensor, top_w: torch.Tensor, top_ids: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, lookup=None, host: tuple | None = None,
                token_counts: torch.Tensor | None = None, slot_scales: tuple | None = None) -> torch.Tensor:
            return decode_kernels.moe_tokens(h, top_w, top_ids, gate_up, down, residual=x, lookup=lookup, host=host,
                                             max_tokens=self.max_tokens, token_counts=token_counts,
                                             slot_scales=slot_scales)  # [B, H]

        return moe

    def _attention_kernel(self, attention: str) -> str:
        """``model.decode_attend``'s kernel; ValueError for an unknown name, a model whose decode attention is
        its own (Qwen4-Exp's sparse indexer), or no Triton."""
        if attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {attention!r}")
        if attention == "triton":
            if not self.model.triton_decode:
                raise ValueError(f"decode_attention 'triton' needs full attention over the cache (Qwen3-MoE, "
                                 f"Qwen3.5/3.6); {self.model.cfg.name} attends its own way")
            decode_kernels.require_attention_kernels("decode_attention", self.model.cfg.name, self.model.cfg.head_dim)
        return attention

    @property
    def mode(self) -> str:
        return "cuda-graphs" if self.graphs is not None else "eager"

    def check_misses(self, misses: str | None) -> str | None:
        """A request's choice of who handles the misses ("host", "device" or None: the engine's default), as it
        will run (None with resident experts). ValueError for an unknown name or "device" without Triton's
        experts."""
        if misses is None or self.misses is None:
            return self.misses
        return self._valid_misses(misses)

    def _valid_misses(self, misses: str) -> str:
        """``misses`` if this engine can handle misses that way; ValueError otherwise (``check_misses``)."""
        if misses not in ("host", "device"):
            raise ValueError(f"decode_misses must be 'host' or 'device', got {misses!r}")
        if misses == "device" and self.store.bank.block is not None:
            raise ValueError("decode_misses 'device' dequantizes an FP8 bank's misses with per-row scales; a bank "
                             "with an FP8 checkpoint's block scales has its misses copied and dequantized by the "
                             "host's path (decode_misses 'host')")
        if misses == "device" and self.table is None:
            raise ValueError(f"decode_misses 'device' needs decode_experts 'triton' (its kernels read the slot ids "
                             f"on the device); this engine decodes with {self.kernels}")
        return misses

    def _no_misses(self, on_device: bool) -> bool:
        """Whether a step can run whole: nothing can miss, or misses are handled on the device."""
        slots = self.store.slots
        return self.store.resident is not None or on_device or (slots is not None and slots.complete)

    @property
    def logits(self) -> torch.Tensor:
        """The logits buffer [V] float32 of the cache stepped last (``self.cache``)."""
        return self.bufs[self.cache].logits

    # -- pieces (each static-shape and sync-free) ---------------------------------------------------------
    def _whole(self, c: int, kv_len: int, on_device: bool) -> None:
        m, b, kv, table = self.model, self.bufs[c], self.caches[c], (self.table if on_device else None)
        prefetch = table is not None and self.prefetch
        if table is not None:
            table.next_tick(prefetch)
        x = m.embed(b.token)  # [1, W]
        for layer in range(self.n_layers):
            # resident or identity slots: expert e in row e
            gate_up, down, scales = self.store.decode_weights(layer, self.reads_fp8)
            x, h, top_w, top_ids = m.decode_attn_block(layer, x, kv, b.pos, kv_len)  # [1, H] x2, [1, k] x2
            if prefetch:
                self._prefetch(layer, x, 1, None)
            if table is None:
                x = self.moe(x, h, top_w, top_ids, gate_up, down,
                             **({} if scales is None else {"slot_scales": scales}))  # [1, H]
            else:  # the experts' kernels look the routed experts up in the slot table, read the misses from the
                # host bank and leave them in their slots
                x = self.moe(x, h, top_w, top_ids, gate_up, down, lookup=table.layer(layer),
                             host=self.store.decode_host(layer), slot_scales=scales)  # [1, H]
        b.logits.copy_(m.decode_logits(x)[0])

    def _prefetch(self, layer: int, x: torch.Tensor, n: int, token_counts: torch.Tensor | None) -> None:
        """In a device-handled step, between ``layer``'s attention half and its experts: wait for the prefetch of
        ``layer``'s experts (queued at the layer before), then guess the next layer's from x [n, H] (the residual
        stream after ``layer``'s attention, ``Model.predict_experts``) and queue their prefetch on the side stream
        (``decode_kernels.prefetch_experts``), to run beside ``layer``'s experts and the next attention half. The
        side stream reads only buffers kept here, the table, the bank and the slots (nothing allocated on it), and
        every prefetch is waited for before its layer's experts run, so a captured step joins every fork."""
        side, main = self.pf_stream, torch.cuda.current_stream(self.model.device) if self.pf_stream else None
        if side is not None and layer > 0:
            main.wait_stream(side)  # this layer's prefetch, queued at the layer before
        nxt = layer + 1
        if nxt >= self.n_layers:
            return
        ids = self.pf_ids[nxt, : n * self.k].view(n, self.k)
        ids.copy_(self.model.predict_experts(nxt, x))

        def run() -> None:
            gate_up, down, scales = self.store.decode_weights(nxt, self.reads_fp8)
            decode_kernels.prefetch_experts(ids, self.table.prefetch_layer(nxt), self.store.decode_host(nxt), gate_up,
                                            down, self.pf_bufs[nxt], self.max_tokens, token_counts=token_counts,
                                            slot_scales=scales)

        if side is None:
            run()
            return
        side.wait_stream(main)
        with torch.cuda.stream(side):
            run()

    def _embed(self, c: int) -> None:
        b = self.bufs[c]
        b.x[0].copy_(self.model.embed(b.token))

    def _attn(self, c: int, layer: int, kv_len: int) -> None:
        b = self.bufs[c]
        self.mid[c, layer, kv_len] = self.model.decode_attn_block(layer, b.x[layer], self.caches[c], b.pos, kv_len)

    def _moe(self, c: int, layer: int, kv_len: int) -> None:
        b = self.bufs[c]
        x, h, top_w, _ = self.mid[c, layer, kv_len]
        gate_up, down, scales = self.store.decode_weights(layer, self.reads_fp8)  # [S, 2I, H], [S, H, I]
        b.x[layer + 1].copy_(self.moe(x, h, top_w, b.slot_ids[layer], gate_up, down,
                                      **({} if scales is None else {"slot_scales": scales})))

    def _head(self, c: int) -> None:
        b = self.bufs[c]
        b.logits.copy_(self.model.decode_logits(b.x[self.n_layers])[0])

    def _run(self, c: int, key: tuple, fn: Callable[[], None]) -> None:
        if self.graphs is None:
            fn()
        else:
            self.graphs[c].run(key, fn)

    # -- warm-up ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def warm(self, token_id: int = 0, every_way: bool = False) -> list[int]:
        """Two throwaway steps at the last position of every KV-length bucket (``kv_buckets``): the first runs
        each piece eagerly, the second captures its graph. They write KV, states, token history and slots at
        those positions: the caller resets the engine afterwards. The engine's own way of handling misses, and
        with ``every_way`` (a server whose requests may choose: ``--allow-request-overrides``) the other too,
        where a device-side slot table gives one; otherwise a request that asks for the other captures that
        way's graphs when it first runs them. The host-handled way is per layer, two graphs a layer, bucket and
        cache: 1,536 for qwen3-30b-a3b-half with 8 caches and 4 buckets, where the device's way captures 32 whole
        steps; the warm-up of both ways took 48.9 s on the H200 (its split not measured). Every sequence cache's
        graphs: a batched step replays the same per-cache pieces a solo step of that cache does, so this
        captures every graph ``step_batch`` uses (a complete slot cache's whole step, host-handled, is captured
        when it first happens). Returns the buckets."""
        buckets = kv_buckets(self.caches[0].max_context)
        ways = [self.misses] + ([w for w in ("host", "device") if w != self.misses]
                                if every_way and self.table is not None else [])
        for cache in range(len(self.caches)):
            for kv_len in buckets:
                for misses in ways:
                    for _ in range(2):
                        self.step(token_id, kv_len - 1, misses=misses, cache=cache)
        if self.batched or self.rows_batched:  # every batched step's graphs: each batch size (and for the
            # layer-outer one, each cache's attention half at each bucket)
            for misses in ways:
                if misses == "host" and not self._no_misses(False):
                    continue  # (host-handled misses run layer-outer, per item: the graphs above)
                for n in range(2, len(self.caches) + 1):
                    for kv_len in buckets if self.rows_batched and n == len(self.caches) else buckets[:1]:
                        for _ in range(2):
                            self.step_batch([DecodeItem(token_id, kv_len - 1, c, misses=misses) for c in range(n)],
                                            attribute=False)
        return buckets

    # -- a step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, token_id: int, pos: int, cancel: CancelLike = None, misses: str | None = None,
             cache: int = 0) -> torch.Tensor:
        """Decode ``token_id`` at ``pos`` in the sequence cache ``cache``; returns the logits [V] float32 (a view of
        the cache's static buffer, valid until its next step). ``misses``: who handles the slot cache's misses in
        this step (``check_misses``). A batch of one (``step_batch``) whose exception is raised; the device
        table's counts are left for ``ExpertStore.collect_decode_counts``."""
        r = self.step_batch([DecodeItem(token_id, pos, cache, cancel, misses)], attribute=False)[0]
        if r.error is not None:
            raise r.error
        return r.logits

    @torch.no_grad()
    def step_batch(self, items: Sequence[DecodeItem], attribute: bool = True) -> list[DecodeResult]:
        """One decode step of every item (each a different sequence cache), in list order: the order of their
        slot lookups. Returns one ``DecodeResult`` per item; an item's exception (its cancel flag included) ends
        its own step only, an exception no one item raised ends every item still running (module docstring).
        ``attribute``: snapshot the device table's counts either side of each device-handled item so that
        ``settle`` can charge them (a solo ``step`` leaves them to ``collect_decode_counts``)."""
        caches = [it.cache for it in items]
        if len(set(caches)) != len(caches) or not all(0 <= c < len(self.caches) for c in caches):
            raise ValueError(f"a batched decode step takes one token per sequence cache (0 to "
                             f"{len(self.caches) - 1}), got caches {caches}")
        results = [DecodeResult() for _ in items]
        on_device: list[bool] = []
        for it, r in zip(items, results):
            try:
                on_device.append(self.check_misses(it.misses) == "device")
            except ValueError as exc:
                r.error = exc
                on_device.append(False)
        store = self.store
        if store.cuda and store.resident is None:  # slot writes below go after any prefill copy still queued
            torch.cuda.current_stream(store.device).wait_stream(store.copy_stream)
        todo = [i for i, r in enumerate(results) if r.error is None]
        with attention_backends():
            while todo:
                i = todo[0]
                if self._no_misses(on_device[i]):
                    n = 1  # the items after it that run whole the same way join it in one batched step
                    while ((self.batched or self.rows_batched) and n < len(todo) and on_device[todo[n]] == on_device[i]
                           and self._no_misses(on_device[todo[n]])):
                        n += 1
                    if n > 1:
                        self._together(todo[:n], items, results, on_device[i], attribute)
                    else:
                        self._whole_item(i, items[i], results[i], on_device[i], attribute)
                    todo = todo[n:]
                    continue
                # the slot cache can miss and this item's host handles it, so it is not complete: every next item
                # whose host handles its misses joins the layer-outer run (one that the device handles runs whole
                # after it, in list order)
                n = 1
                while n < len(todo) and not on_device[todo[n]]:
                    n += 1
                self._per_layer(todo[:n], items, results)
                todo = todo[n:]
        if items:
            self.cache = items[-1].cache
            self.kv = self.caches[self.cache]
        return results

    def _prepare(self, it: DecodeItem) -> None:
        b = self.bufs[it.cache]
        b.token.fill_(it.token_id)
        b.pos.fill_(it.pos)
        self.model.prepare_decode(self.caches[it.cache], it.token_id, it.pos)  # host-side work of a step (Qwen4-
        # Exp: PLE rows staged in the cache's own buffers)

    def _whole_item(self, i: int, it: DecodeItem, r: DecodeResult, on_device: bool, attribute: bool) -> None:
        """Item ``i``'s whole step: one graph (or its eager pieces), no host sync; the next item's is queued right
        behind it."""
        c, table = it.cache, self.table
        kv_len = kv_len_for(it.pos, self.caches[c].max_context)
        try:
            check_cancel(it.cancel)
            self._prepare(it)
            r.way = "whole"
            self.steps["whole"] += 1
            if on_device:
                self.store.slots.sync_device()  # the host's lookups or flush since the last device-side step
                if attribute:
                    self.counts_at[2 * i, :2].copy_(table.counts)
                    self.counts_at[2 * i, 2:].copy_(table.pf_counts)
            try:
                self._run(c, ("whole", c, kv_len, on_device, self.prefetch),
                          lambda: self._whole(c, kv_len, on_device))
            finally:
                if on_device:
                    table.ahead = table.uncounted = True
            if on_device and attribute:
                self.counts_at[2 * i + 1, :2].copy_(table.counts)
                self.counts_at[2 * i + 1, 2:].copy_(table.pf_counts)
                r.counts_row = i
            r.logits = self.bufs[c].logits
        except Exception as exc:  # noqa: BLE001 - this item's step ends; the others go on
            r.error = exc

    def _batch_fn(self, n: int, on_device: bool) -> None:
        """The batched step's piece: the first ``n`` rows of the batch buffers through every layer at once."""
        m, bb = self.model, self.batch
        table = self.table if on_device else None
        prefetch = table is not None and self.prefetch
        if table is not None:
            table.next_tick(prefetch)
            bb.token_counts.zero_()
            if prefetch:
                bb.pf_token_counts.zero_()
        pool_k, pool_v = self.caches[0].pool_k, self.caches[0].pool_v
        pos, index, plan = bb.pos[:n], bb.index[:n], bb.plan[:n]
        x = m.embed(bb.token[:n])  # [B, H]
        for layer in range(self.n_layers):
            gate_up, down, scales = self.store.decode_weights(layer, self.reads_fp8)
            x, h, top_w, top_ids = m.decode_attn_rows(layer, x, pool_k[layer], pool_v[layer], pos, index, plan)
            if prefetch:
                self._prefetch(layer, x, n, bb.pf_token_counts)
            if table is None:
                x = self.moe(x, h, top_w, top_ids, gate_up, down, slot_scales=scales)  # [B, H]
            else:
                x = self.moe(x, h, top_w, top_ids, gate_up, down, lookup=table.layer(layer),
                             host=self.store.decode_host(layer), token_counts=bb.token_counts, slot_scales=scales)
        bb.logits[:n].copy_(m.decode_logits(x))

    def _together(self, run: list[int], items: Sequence[DecodeItem], results: list[DecodeResult], on_device: bool,
                  attribute: bool) -> None:
        """The items ``run`` (each runs whole, the same way) as one batched step, each item's bits its solo step's:
        ``_batch_step`` (Qwen3-MoE: every layer over all their tokens at once, one graph per (batch size, way),
        whatever the positions) or ``_rows_step`` (layer-outer: each item's attention half as alone, then the
        layer's experts of all their tokens at once). Either way each expert is read once for the batch and the
        slot table is looked up once per layer for the batch's experts (``moe_tokens``). An exception in the step
        is the batch's: every item of the run gets it."""
        live = []
        for i in run:
            try:
                check_cancel(items[i].cancel)
                self._prepare(items[i])
                live.append(i)
            except Exception as exc:  # noqa: BLE001 - this item's step ends; the others go on
                results[i].error = exc
        if len(live) < 2:
            for i in live:
                self._whole_item(i, items[i], results[i], on_device, attribute)
            return
        n, table = len(live), self.table
        bufs = self.batch if self.batched else self.rows
        try:
            if on_device:
                self.store.slots.sync_device()
            self.steps["batched"] += 1
            self.steps["whole"] += n
            try:
                (self._batch_step if self.batched else self._rows_step)([items[i] for i in live], on_device)
            finally:
                if on_device:
                    table.ahead = table.uncounted = True
            counts = None
            if on_device and attribute:
                counts = (torch.cat([bufs.token_counts[:n], bufs.pf_token_counts[:n]], dim=1)
                          if self.prefetch and self.batched else bufs.token_counts[:n].clone())
        except Exception as exc:  # noqa: BLE001 - no one item's
            for i in live:
                results[i].error = exc
            return
        if counts is not None:
            self._batch_counts.append((counts, [(results[i], row) for row, i in enumerate(live)]))
        for row, i in enumerate(live):
            results[i].way = "whole"
            results[i].logits = self.batch.logits[row] if self.batched else self.bufs[items[i].cache].logits

    def _batch_step(self, batch: list[DecodeItem], on_device: bool) -> None:
        """Stage the batch's tokens, positions, caches and split plans (one copy each), then replay its graph."""
        bb, n = self.batch, len(batch)
        for row, it in enumerate(batch):
            bb.stage[0, row], bb.stage[1, row], bb.stage[2, row] = it.token_id, it.pos, it.cache
            bb.stage_plan[row] = torch.tensor(split_plan(kv_len_for(it.pos, self.caches[it.cache].max_context)),
                                              dtype=torch.int32)
        bb.token[:n].copy_(bb.stage[0, :n], non_blocking=True)
        bb.pos[:n].copy_(bb.stage[1, :n], non_blocking=True)
        bb.index[:n].copy_(bb.stage[2, :n], non_blocking=True)
        bb.plan[:n].copy_(bb.stage_plan[:n], non_blocking=True)
        if self.batch_graphs is None:
            self._batch_fn(n, on_device)
        else:
            self.batch_graphs.run(("batch", n, on_device, self.prefetch), lambda: self._batch_fn(n, on_device))

    def _rows_attn(self, c: int, layer: int, kv_len: int) -> None:
        """Cache ``c``'s attention half of ``layer`` (``decode_attn_block``, as its solo step runs it), from its row
        of the layer's inputs into its rows of the attention half's outputs."""
        rows, b = self.rows, self.bufs[c]
        x, h, top_w, top_ids = self.model.decode_attn_block(layer, rows.x[layer][c:c + 1], self.caches[c], b.pos,
                                                            kv_len)
        rows.mid[c:c + 1].copy_(x)
        rows.h[c:c + 1].copy_(h)
        rows.top_w[c:c + 1].copy_(top_w)
        rows.top_ids[c:c + 1].copy_(top_ids)

    def _rows_moe(self, layer: int, n: int, on_device: bool) -> None:
        """The experts of ``layer`` for the batch's ``n`` caches (``rows.index``) at once, into their rows of the
        next layer's inputs."""
        rows, table = self.rows, (self.table if on_device else None)
        idx = rows.index[:n]
        gate_up, down, scales = self.store.decode_weights(layer, self.reads_fp8)
        x, h = rows.mid.index_select(0, idx), rows.h.index_select(0, idx)
        top_w, top_ids = rows.top_w.index_select(0, idx), rows.top_ids.index_select(0, idx)
        if table is None:
            out = self.moe(x, h, top_w, top_ids, gate_up, down, slot_scales=scales)  # [B, H]
        else:
            if layer == 0:  # (a step's one tick of the table, as a whole step's)
                table.next_tick()
                rows.token_counts.zero_()
            out = self.moe(x, h, top_w, top_ids, gate_up, down, lookup=table.layer(layer),
                           host=self.store.decode_host(layer), token_counts=rows.token_counts, slot_scales=scales)
        rows.x[layer + 1].index_copy_(0, idx, out)

    def _rows_step(self, batch: list[DecodeItem], on_device: bool) -> None:
        """Layer-outer with no host sync: per layer each item's attention half (its cache's graph of that piece),
        then the experts of all their tokens at once (one graph per (layer, batch size, way)); then each item's
        head."""
        rows, n = self.rows, len(batch)
        caches = [it.cache for it in batch]
        kv = [kv_len_for(it.pos, self.caches[it.cache].max_context) for it in batch]
        for row, c in enumerate(caches):
            rows.stage[row] = c
        rows.index[:n].copy_(rows.stage[:n], non_blocking=True)
        for c in caches:
            self._run(c, ("embed_rows", c), lambda c=c: rows.x[0][c:c + 1].copy_(self.model.embed(self.bufs[c].token)))
        for layer in range(self.n_layers):
            for c, k in zip(caches, kv):
                self._run(c, ("attn_rows", c, layer, k), lambda c=c, k=k: self._rows_attn(c, layer, k))
            piece = lambda: self._rows_moe(layer, n, on_device)  # noqa: E731
            if self.batch_graphs is None:
                piece()
            else:
                self.batch_graphs.run(("moe_rows", layer, n, on_device), piece)
        for c in caches:
            self._run(c, ("head_rows", c), lambda c=c: self.bufs[c].logits.copy_(
                self.model.decode_logits(rows.x[self.n_layers][c:c + 1])[0]))

    def _per_layer(self, run: list[int], items: Sequence[DecodeItem], results: list[DecodeResult]) -> None:
        """The items ``run`` (their hosts handle their misses), layer-outer: per layer every item's attention half,
        one host read of all their routed experts, then per item in order its lookup (and miss copies) and its
        MoE half; then each item's head."""
        live = []
        for i in run:
            it, r = items[i], results[i]
            try:
                check_cancel(it.cancel)
                self._prepare(it)
                r.way = "per_layer"
                self.steps["per_layer"] += 1
                self._run(it.cache, ("embed", it.cache), lambda c=it.cache: self._embed(c))
                live.append(i)
            except Exception as exc:  # noqa: BLE001 - this item's step ends; the others go on
                r.error = exc
        kv_len = {i: kv_len_for(items[i].pos, self.caches[items[i].cache].max_context) for i in run}
        for layer in range(self.n_layers):
            attended = []
            for i in live:
                c, n = items[i].cache, kv_len[i]
                try:
                    if layer:  # a cancel seen now takes this item out of the remaining layers only
                        check_cancel(items[i].cancel)
                    self._run(c, ("attn", c, layer, n), lambda: self._attn(c, layer, n))
                    attended.append(i)
                except Exception as exc:  # noqa: BLE001
                    results[i].error = exc
            live = attended
            if not live:
                return
            try:
                routed = self._routing([self.mid[items[i].cache, layer, kv_len[i]][3] for i in live])
            except Exception as exc:  # noqa: BLE001 - no one item's (an asynchronous CUDA error surfaces at a sync)
                for i in live:
                    results[i].error = exc
                return
            done = []
            for i, ids in zip(live, routed, strict=True):
                c, n = items[i].cache, kv_len[i]
                try:
                    # the lookup may evict a slot that an earlier item of this batch reads in this layer: that
                    # item's MoE half was queued before this lookup's copies, on the same stream (the miss copies
                    # go on the current stream: ``ExpertStore.decode_experts``), so it has read the slot first.
                    # An expert an earlier item just loaded is a hit: the batch's union is copied once
                    self._lookup(layer, c, ids, results[i])
                    self._run(c, ("moe", c, layer, n), lambda: self._moe(c, layer, n))
                    done.append(i)
                except Exception as exc:  # noqa: BLE001
                    results[i].error = exc
            live = done
        for i in live:
            c = items[i].cache
            try:
                self._run(c, ("head", c), lambda: self._head(c))
                results[i].logits = self.bufs[c].logits
            except Exception as exc:  # noqa: BLE001
                results[i].error = exc

    def _routing(self, top_ids: list[torch.Tensor]) -> list[list[int]]:
        """The routed expert ids [1, k] of each item, read to the host at once: the layer's one host sync."""
        self.syncs += 1
        return torch.cat(top_ids).tolist()  # [B, k]

    def _lookup(self, layer: int, c: int, ids: list[int], r: DecodeResult) -> None:
        """Make ``ids`` resident in ``layer``'s slots (copying the misses) and write their slot ids for cache
        ``c``'s MoE half; the copies and lookups are charged to ``r`` (its lookup missed)."""
        store, b = self.store, self.bufs[c]
        life, seen = store.lifetime, store.slot_lifetime  # (the store replaces neither during a step)
        h2d, d2d, copies, hits, misses = life.h2d_bytes, life.d2d_bytes, life.expert_copies, seen.hits, seen.misses
        try:
            slots = store.decode_experts(layer, ids)
        finally:
            r.traffic.h2d_bytes += life.h2d_bytes - h2d
            r.traffic.d2d_bytes += life.d2d_bytes - d2d
            r.traffic.expert_copies += life.expert_copies - copies
            r.lookups.hits += seen.hits - hits
            r.lookups.misses += seen.misses - misses
        b.host_ids[layer, 0] = torch.tensor(slots)
        b.slot_ids[layer].copy_(b.host_ids[layer], non_blocking=True)

    def settle(self, results: Sequence[DecodeResult]) -> None:
        """After a batch (once its logits were read): charge each device-handled item with the lookups the device
        made in its step (one read of the counts' snapshots either side of it; each miss one expert copied, as
        ``ExpertStore.collect_decode_counts`` counts it), then fold the device table's counts into the store's
        accounting. Counts of device-side steps run without snapshots (a solo ``step``) are folded but charged to
        no item; an item whose step raised is charged nothing (its counts are folded all the same)."""
        for counts, rows in self._batch_counts:  # batched steps: each token's own hits and misses (and the
            # experts the prefetch copied in for it: traffic, not lookups)
            per_token = counts.tolist()
            self.syncs += 1
            for r, row in rows:
                hits, misses, *pf = per_token[row]
                fetched = pf[1] if pf else 0
                r.prefetched += fetched
                copies = misses + fetched
                r.lookups.hits += hits
                r.lookups.misses += misses
                r.traffic.h2d_bytes += copies * self.store.bank.expert_bytes
                r.traffic.expert_copies += copies
        self._batch_counts.clear()
        mine = [r for r in results if r.counts_row is not None]
        if mine:
            snaps = self.counts_at.tolist()  # [2C, 4]
            self.syncs += 1
            for r in mine:
                (h0, m0, _, p0), (h1, m1, _, p1) = snaps[2 * r.counts_row], snaps[2 * r.counts_row + 1]
                r.prefetched += p1 - p0
                copies = m1 - m0 + p1 - p0
                r.lookups.hits += h1 - h0
                r.lookups.misses += m1 - m0
                r.traffic.h2d_bytes += copies * self.store.bank.expert_bytes
                r.traffic.expert_copies += copies
                r.counts_row = None
        self.store.collect_decode_counts()
