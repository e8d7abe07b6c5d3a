"""Decode: one token at a time through the decode slot cache (or resident experts); the token is chosen by
:mod:`abbench.engine.ops.sampling`.

Contract:
- ``Decoder(model, store, kv, graphs)``; ``decoder.step(token_id, pos, cancel) -> logits [V] float32`` runs
  the token at position ``pos`` through every layer, writing its KV. The step has static shapes: the token
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
  * **whole step with the misses on the device** (``misses="device"``, Triton's experts): per layer, after the
    router's kernel also looks the routed experts up in the slot cache's device-side table (the host's LRU
    policy: ``decode_kernels.route_topk``'s ``lookup``), and the experts' kernels read the misses from the
    registered host bank over PCIe (an FP8 bank's as FP8 with their row scales, dequantized in the kernels to the
    bits the host's copy would leave), computing with them while they store them into their slots
    (``decode_kernels.moe_one_token``'s ``fetch``), so the step is one graph that never waits for the host
    and the copies overlap the hit experts' work. The same policy as the host's, so
    the two ways pick the same slots and decode bitwise alike; ``step(misses=...)`` chooses per step, each
    side catching up with the other's changes first (``SlotCache.sync_device`` / ``sync_host``). The
    default is the engine's (``EngineConfig.decode_misses``: "auto" = device with Triton's experts);
  * on CUDA, when ``graphs`` is true, each of these pieces is captured once per ``kv_len`` as a CUDA graph
    and replayed (the whole step as one graph; per layer one graph for the attention half and one for the
    MoE half), which removes the per-kernel launch cost that dominates eager decode (~80 kernels a layer).
- Decode kernels (``EngineConfig.decode_experts`` / ``decode_attention``; default "auto": "triton" on CUDA for
  a model whose decode they serve (``Model.triton_decode``: Qwen3-MoE and the Qwen3.5/3.6 hybrid) at a head
  dimension they take, with Triton installed; otherwise "grouped" / "torch"). ``self.kernels`` names what runs.
  * ``experts="triton"``: the router's softmax/top-k as one kernel (``decode_kernels.route_topk``) and the
    routed experts as a GEMV over the k routed experts with the residual added (``decode_kernels.moe_one_token``)
    instead of ``Model.moe_block``'s grouped GEMM over every expert;
  * ``attention="triton"``: split-KV flash decoding up to the device-held position
    (``decode_kernels.attention_split_kv``) instead of ``decode_gqa``; for Qwen3-MoE also the norms, q/k norms,
    RoPE and cache write fused (``Model.decode_attn_block``), for the hybrid its norms around the mixer.
  Every way of running a step uses the same kernels, so they stay bitwise equal among themselves (not to the
  torch kernels' decode: other summation orders). On the H200 a resident Qwen3-30B-A3B step went from 0.402 to
  0.147 ms a layer (results/20261201n-h200-decode-kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from abbench.engine.ops import kernels as decode_kernels
from abbench.engine.config import DECODE_ATTENTION, DECODE_EXPERTS, DECODE_MISSES
from abbench.engine.runtime.experts import ExpertStore
from abbench.engine.runtime.graphs import GraphCache
from abbench.engine.models.qwen3_moe import KVCache, Model
from abbench.engine.ops.dense import attention_backends
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


class Decoder:
    """Static buffers and the step functions of decode; see the module docstring."""

    def __init__(self, model: Model, store: ExpertStore, kv: KVCache | list[KVCache], graphs: bool,
                 experts: str = "grouped", attention: str = "torch", misses: str = "host"):
        # the sequences' caches (one per sequence the engine may run at once); a step runs over one of them,
        # ``self.kv`` (its graphs are its own: every key names the cache)
        self.caches = list(kv) if isinstance(kv, (list, tuple)) else [kv]
        self.model, self.store, self.kv, self.cache = model, store, self.caches[0], 0
        experts = self._auto(experts, "grouped", True)
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
        self.token = torch.zeros(1, dtype=torch.long, device=dev)  # [1]
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # [1]
        self.x = [torch.zeros(1, cfg.stream_width, dtype=model.dtype, device=dev)
                  for _ in range(self.n_layers + 1)]  # [1, W] input of each layer, and the last output (W = H,
        # or hc*H for Qwen4-Exp's hyper-connection streams)
        # the attention half's outputs (x, h, top_w, top_ids) per (layer, kv_len): a graph's outputs live in
        # the memory it was captured with, and the MoE half's graph for that kv_len reads exactly those
        self.mid: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.slot_ids = torch.zeros(self.n_layers, 1, self.k, dtype=torch.long, device=dev)  # [L, 1, k]
        self.logits = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=dev)  # [V]
        # a graph cannot hold a host read-back: with the looped expert kernel (no grouped GEMM for this
        # device/dtype), or a grouped GEMM that reads its offsets back (float32 on CUDA in torch 2.11), every
        # step runs eagerly
        self.graphs = (GraphCache(dev) if graphs and dev.type == "cuda" and model.grouped
                       and probe_graph_capture(dev, model.dtype) else None)
        self.host_ids = torch.zeros(self.n_layers, 1, self.k, dtype=torch.long,
                                    pin_memory=dev.type == "cuda")  # [L, 1, k] slot ids on their way up
        self.steps = {"whole": 0, "per_layer": 0}

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
        ``decode_kernels.moe_one_token``. ValueError for an unknown name, a model whose MoE block is its own,
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
                gate_up: torch.Tensor, down: torch.Tensor, fetch: tuple | None = None) -> torch.Tensor:
            return decode_kernels.moe_one_token(h, top_w, top_ids, gate_up, down, residual=x, fetch=fetch)  # [1, H]

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
            if not decode_kernels.have_triton():
                raise ValueError("decode_attention 'triton' needs Triton (a CUDA build of torch ships it)")
            if not decode_kernels.attention_applies(self.model.cfg.head_dim):
                raise ValueError(f"decode_attention 'triton' needs a power-of-two head dimension of at least 16; "
                                 f"{self.model.cfg.name} has {self.model.cfg.head_dim}")
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

    # -- pieces (each static-shape and sync-free) ---------------------------------------------------------
    def _whole(self, kv_len: int, on_device: bool) -> None:
        m, table = self.model, (self.table if on_device else None)
        if table is not None:
            table.tick.add_(1)
        x = m.embed(self.token)  # [1, W]
        for layer in range(self.n_layers):
            gate_up, down = self.store.decode_weights(layer)  # resident or identity slots: expert e in row e
            if table is None:
                x, h, top_w, top_ids = m.decode_attn_block(layer, x, self.kv, self.pos, kv_len)  # [1, H] x2, [1, k] x2
                x = self.moe(x, h, top_w, top_ids, gate_up, down)  # [1, H]
            else:  # the router's kernel looks its experts up in the slot table; the experts' kernels read the
                # misses from the host bank and leave them in their slots
                x, h, top_w, _ = m.decode_attn_block(layer, x, self.kv, self.pos, kv_len, lookup=table.layer(layer))
                slot_ids, fetch = self.store.decode_fetch(layer)  # [1, k] slot ids, the misses
                x = self.moe(x, h, top_w, slot_ids, gate_up, down, fetch=fetch)  # [1, H]
        self.logits.copy_(m.logits(x))

    def _embed(self) -> None:
        self.x[0].copy_(self.model.embed(self.token))

    def _attn(self, layer: int, kv_len: int) -> None:
        self.mid[self.cache, layer, kv_len] = self.model.decode_attn_block(layer, self.x[layer], self.kv, self.pos,
                                                                           kv_len)

    def _moe(self, layer: int, kv_len: int) -> None:
        x, h, top_w, _ = self.mid[self.cache, layer, kv_len]
        gate_up, down = self.store.decode_weights(layer)  # [S, 2I, H], [S, H, I]
        self.x[layer + 1].copy_(self.moe(x, h, top_w, self.slot_ids[layer], gate_up, down))

    def _head(self) -> None:
        self.logits.copy_(self.model.logits(self.x[self.n_layers]))

    def _run(self, key: tuple, fn: Callable[[], None]) -> None:
        if self.graphs is None:
            fn()
        else:
            self.graphs.run(key, fn)

    # -- warm-up ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def warm(self, token_id: int = 0) -> list[int]:
        """Two throwaway steps at the last position of every KV-length bucket (``kv_buckets``): the first runs
        each piece eagerly, the second captures its graph. They write KV, states, token history and slots at
        those positions: the caller resets the engine afterwards. With a device-side slot table, both ways of
        handling misses (a request may ask for either). Every sequence cache's graphs. Returns the buckets."""
        buckets = kv_buckets(self.kv.max_context)
        ways = [self.misses] + ([w for w in ("host", "device") if w != self.misses] if self.table is not None else [])
        for cache in range(len(self.caches)):
            for kv_len in buckets:
                for misses in ways:
                    for _ in range(2):
                        self.step(token_id, kv_len - 1, misses=misses, cache=cache)
        return buckets

    # -- a step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, token_id: int, pos: int, cancel: CancelLike = None, misses: str | None = None,
             cache: int = 0) -> torch.Tensor:
        """Decode ``token_id`` at ``pos`` in the sequence cache ``cache``; returns the logits [V] float32 (a view of
        a static buffer, valid until the next step). ``misses``: who handles the slot cache's misses in this step
        (``check_misses``)."""
        self.cache, self.kv = cache, self.caches[cache]
        store, kv_len = self.store, kv_len_for(pos, self.kv.max_context)
        on_device = self.check_misses(misses) == "device"
        self.token.fill_(token_id)
        self.pos.fill_(pos)
        self.model.prepare_decode(self.kv, token_id, pos)  # host-side work of a step (Qwen4-Exp: PLE rows staged)
        if store.cuda and store.resident is None:  # slot writes below go after any prefill copy still queued
            torch.cuda.current_stream(store.device).wait_stream(store.copy_stream)
        with attention_backends():
            check_cancel(cancel)
            if self._no_misses(on_device):
                self.steps["whole"] += 1
                if on_device:
                    store.slots.sync_device()  # the host's lookups or flush since the last device-side step
                self._run(("whole", cache, kv_len, on_device), lambda: self._whole(kv_len, on_device))
                if on_device:
                    self.table.ahead = self.table.uncounted = True
                return self.logits
            self.steps["per_layer"] += 1
            self._run(("embed",), self._embed)
            for layer in range(self.n_layers):
                if layer:
                    check_cancel(cancel)
                self._run(("attn", cache, layer, kv_len), lambda: self._attn(layer, kv_len))
                routed = self.mid[cache, layer, kv_len][3][0].tolist()  # host sync: which experts this token needs
                self.host_ids[layer, 0] = torch.tensor(store.decode_experts(layer, routed))
                self.slot_ids[layer].copy_(self.host_ids[layer], non_blocking=True)
                self._run(("moe", cache, layer, kv_len), lambda: self._moe(layer, kv_len))
            self._run(("head",), self._head)
            return self.logits
