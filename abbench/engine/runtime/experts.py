"""Expert offload on the device: the prefill double buffer, the decode slot cache, and byte accounting (the
host bank itself is :mod:`abbench.engine.models.bank`).

Contract:
- ``ExpertStore`` owns what lives on the compute device:
  * two layer buffers for prefill. ``stream_layers(order)`` yields (layer, gate_up, down) for each layer
    of ``order`` while the copy of the next one runs on a separate CUDA stream (events order copy after
    the compute that last read the buffer, and compute after its copy); on CPU the same code copies
    synchronously.
  * ``prime(layer)``: the first layer's copy started before its prefill asks for it (a request has arrived and
    is being parsed and tokenized, the engine idle): ``stream_layers`` whose first layer it is takes it instead
    of copying again. Anything else that writes the first buffer (demand loading, a stream starting elsewhere,
    the bandwidth probe) or ``drop_prime`` drops it. Its traffic is counted when it is taken, as the taking
    prefill's first copy, or when it is dropped (``primes_taken``, ``primes_dropped``).
  * ``load_experts(layer, ids)``: demand loading of some experts into a layer buffer at their index.
  * a decode slot cache (``SlotCache``) of ``slots_per_layer`` slots for every layer, one block per layer,
    LRU within the layer: ``decode_experts(layer, ids)`` makes the routed experts resident and returns their
    slot indices; ``decode_weights(layer)`` is what decode's experts read (that layer's block, or the
    resident experts), so no grouped call ever sees more than num_experts groups. Hits and misses are
    counted per request and for the engine's lifetime (``SlotStats``).
  * or the slot cache's bookkeeping on the device (``DeviceSlotTable``, ``SlotCache.attach_table``): decode's
    Triton path looks up and fills the slots itself (``moe_tokens``' lookup and host reads, the
    misses read from the registered host bank over PCIe by the kernel), so a step never waits for the host.
    The host's view (``lru``, ``free``, ``loaded``) is pulled from the table when the host next needs it, and
    the table's hit/miss counts are folded into the accounting by ``collect_decode_counts``.
  * ``share_buffers`` (``EngineConfig.slots_share_buffers``): the two layer buffers and the slot cache are views of
    one allocation, the larger of the two layouts. Whatever writes a buffer (a streamed layer, a prime, demand
    loading, the bandwidth probe) first makes the slot cache forget what it holds (``slot_flushes``), so decode
    after a prefill starts cold; the writes are ordered after the compute queued so far, which includes the last
    decode step that read the slots. One sequence at a time: no decode runs while a buffer holds a layer.
  * resident mode: every layer's experts on the device from the start (on CPU the bank itself).
  * optional ``d2d_from_slot_cache``: experts already in the slot cache reach a layer buffer by a
    device-to-device copy instead of from the host.
  * an FP8 bank (``ExpertBank.fp8``): every copy from the host moves the FP8 values and their scales (into a
    staging area of one layer on CUDA; on CPU the bank is read in place) and is dequantized into the buffer or
    slot on the same stream (``bank.dequantize_into``), so the device computes in its own dtype and every path
    sees the same values. With ``dequant_on_compute`` (``EngineConfig.fp8_dequant = "compute"``, the default)
    a streamed layer that comes whole from the host is the exception: its copy fills the stage only, and
    ``stream_layers`` dequantizes it into its buffer on the compute stream when the layer's turn comes (after
    waiting for the copy), then issues the next layer's copy into the stage, so the dequantization's kernels
    never run beside the compute (there, on the H200, they had slowed it: docs/fp8.md). The stage then exists
    on every device. The staging area is shared by the copy stream and the compute stream's copies, which
    already wait for the copy stream (``load_experts`` here, ``Decoder.step_batch`` before its slot writes). On CUDA
    the dequantization is one Triton kernel (``decode_kernels.dequantize_fp8``, the same bits). Decode's
    device-side fetch reads a per-row-scaled FP8 bank's misses as FP8 and dequantizes them in its kernels
    (``decode_host``); a block-scaled bank's misses are the host's. With ``fp8_slots`` (``EngineConfig.slot_dtype``)
    the decode slots keep the bank's float8 values and row scales as they are (half the bytes of a slot in the
    compute dtype), and decode's Triton experts dequantize what they read (``decode_weights``' scales); a prefill
    copy from such a slot (``d2d_from_slot_cache``) is dequantized on the way.
  * ``fp8_gemm_math`` (``EngineConfig.fp8_dequant`` "gemm" or "w8a8", an FP8 bank with per-row scales): nothing
    is dequantized into a buffer. The prefill buffers and resident experts hold the bank's float8 values and row
    scales as they are (``ops.moe.Fp8Experts``, about half the bytes), copies move them unchanged, and the
    prefill's grouped GEMM reads them in that math (``moe.fp8_grouped_mm``); no stage. Decode reads resident
    experts the way it reads FP8 slots. A copy from slots in the compute dtype cannot fill such a buffer: it comes from the host.
- Accounting: every expert copy adds to ``lifetime`` and ``request`` (``Traffic``): host->device bytes,
  device->device bytes, and the number of experts copied. ``bank_bytes`` is one full pass over all layers.
  ``measure_h2d_gbps`` times host->device copies of layer banks (not counted as traffic).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from abbench.engine.config import ModelConfig
from abbench.engine.models.bank import FP8, ExpertBank, dequantize_into
from abbench.engine.ops import kernels as decode_kernels
from abbench.engine.ops.moe import Fp8Experts


@dataclass
class Traffic:
    """Expert bytes moved: host->device, device->device, and the number of experts copied."""

    h2d_bytes: int = 0
    d2d_bytes: int = 0
    expert_copies: int = 0

    def minus(self, other: Traffic) -> Traffic:
        return Traffic(self.h2d_bytes - other.h2d_bytes, self.d2d_bytes - other.d2d_bytes,
                       self.expert_copies - other.expert_copies)

    def snapshot(self) -> Traffic:
        return Traffic(self.h2d_bytes, self.d2d_bytes, self.expert_copies)


class SlotCache:
    """Decode-time expert slots on the device: ``slots_per_layer`` slots for every layer, in one block per
    layer (``gate_up[l]`` [S, 2I, H], ``down[l]`` [S, H, I]) so that a grouped GEMM over one layer's slots has
    S <= num_experts groups whatever the total. Least-recently-used eviction within the layer.

    When a layer has a slot for every expert (S == num_experts), expert e lives in slot e: decode then
    routes exactly as over resident experts, and once every expert of every layer has been loaded
    (``complete``) no step needs the host any more."""

    def __init__(self, cfg: ModelConfig, slots_per_layer: int, device: torch.device, dtype: torch.dtype,
                 fp8: bool = False, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None):
        e_i, h, n_layers = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_hidden_layers
        if not cfg.num_experts_per_tok <= slots_per_layer <= cfg.num_experts:
            raise ValueError(f"slots_per_layer must be in [{cfg.num_experts_per_tok}, {cfg.num_experts}], "
                             f"got {slots_per_layer}")
        self.slots_per_layer, self.num_experts = slots_per_layer, cfg.num_experts
        self.identity = slots_per_layer == cfg.num_experts
        self.fp8 = fp8  # the slots hold an FP8 bank's float8 values, with its row scales beside them
        dtype = FP8 if fp8 else dtype
        # (``alloc``: where the tensors come from, e.g. views of memory the prefill buffers share; what a slot
        # holds before its expert is copied in is never read)
        new = alloc or (lambda shape, dt: torch.zeros(shape, device=device, dtype=dt))
        S = slots_per_layer
        self.gate_up = [new((S, 2 * e_i, h), dtype) for _ in range(n_layers)]  # [S, 2I, H] each
        self.down = [new((S, h, e_i), dtype) for _ in range(n_layers)]  # [S, H, I] each
        self.gate_up_scale = [new((S, 2 * e_i), torch.float32) for _ in range(n_layers)
                              ] if fp8 else None  # [S, 2I] float32 each
        self.down_scale = [new((S, h), torch.float32) for _ in range(n_layers)] if fp8 else None  # [S, H]
        self.n_layers = n_layers
        self.flush()

    @property
    def capacity(self) -> int:
        return self.slots_per_layer * self.n_layers

    def flush(self) -> None:
        self.lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(self.n_layers)]  # expert -> slot
        self.free = [list(range(self.slots_per_layer - 1, -1, -1)) for _ in range(self.n_layers)]
        self.loaded = 0  # (layer, expert) pairs present
        if self.table is not None:
            self.table.ahead = False  # what the device's steps did is gone too: the host's empty view is the one
        self.changed()

    # -- the device-side table ------------------------------------------------------------------------
    table: DeviceSlotTable | None = None

    host_ahead = False  # the host changed the bookkeeping since the device table was last pushed

    def attach_table(self, top_k: int) -> DeviceSlotTable:
        """A device-side copy of the bookkeeping for decode's device-side lookups; idempotent. Either side may
        run lookups: each brings its view up to date from the other before it does (``sync_device``,
        ``sync_host``), so switching between them costs one small copy, not one per lookup."""
        if self.table is None:
            self.table = DeviceSlotTable(self.n_layers, self.num_experts, self.slots_per_layer, top_k,
                                         self.gate_up[0].device)
            self.table.push(self.lru, self.free)
        return self.table

    def changed(self) -> None:
        """The host changed the bookkeeping (flush, a host-side lookup): the device table is now behind."""
        self.host_ahead = self.table is not None

    def sync_device(self) -> None:
        """Before device-side lookups: push the host's changes, if any (a small host->device copy)."""
        if self.table is not None and self.host_ahead:
            self.sync_host()  # (never both ahead: the device is only ever ahead after a sync_device)
            self.table.push(self.lru, self.free)
            self.host_ahead = False

    def sync_host(self) -> None:
        """Before host-side use: pull the device's changes, if any (one device read)."""
        if self.table is not None and self.table.ahead:
            self.lru, self.free = self.table.pull()
            self.loaded = sum(len(d) for d in self.lru)

    @property
    def complete(self) -> bool:
        """Every expert of every layer is in its slot (only possible when S == num_experts)."""
        self.sync_host()
        return self.identity and self.loaded == self.n_layers * self.num_experts

    def layer_slots(self, layer: int) -> dict[int, int]:
        """{expert: slot} of this layer's experts in the cache."""
        self.sync_host()
        return dict(self.lru[layer])


class DeviceSlotTable:
    """A slot cache's bookkeeping as device tensors, read and written by decode's kernels inside the step's
    graph (``decode_kernels.route_topk``'s lookup): per layer ``slot_of`` [E] int32 (an expert's slot, -1 if absent),
    ``expert_of`` [S] int32 (a slot's expert, -1 if free) and ``stamp`` [S] int64 (recency: tick * STAMP_STEP +
    rank within the step; a free slot s holds s - S so free slots go first, lowest first); ``tick`` [1] the
    step (the graph adds 1); ``counts`` [2] hits and misses since the last ``take_counts``; ``slots`` [L, k]
    and ``src`` [L, k] each layer's lookup result for the experts kernel and the fetch. The same policy as the
    host's ``OrderedDict`` LRU, so either side can take over from the other (``push`` / ``pull``).

    Prefetch (``Decoder``'s ``prefetch``, ``decode_kernels.prefetch_experts``): ``pf_tick`` [1] the step's tick
    less one (``prefetch_layer``'s lookups stamp what they place as if the step before had used it: the newest
    of what the step's own lookup may evict, never protected from it; a prefetch evicts only what the step
    before did not use either) and ``pf_counts`` [2] the prefetched experts already there and those copied in,
    since the last ``take_prefetched``. The host's LRU knows nothing of it: with prefetch the two ways' slots
    differ (``pull`` still gives the host the device's view)."""

    def __init__(self, n_layers: int, num_experts: int, slots_per_layer: int, top_k: int, device: torch.device):
        L, E, S = n_layers, num_experts, slots_per_layer
        self.identity = S == E
        self.slot_of = torch.full((L, E), -1, dtype=torch.int32, device=device)
        self.expert_of = torch.full((L, S), -1, dtype=torch.int32, device=device)
        self.stamp = torch.zeros((L, S), dtype=torch.int64, device=device)
        self.tick = torch.zeros(1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)
        self.pf_tick = torch.zeros(1, dtype=torch.int64, device=device)
        self.pf_counts = torch.zeros(2, dtype=torch.int64, device=device)
        self.slots = torch.zeros((L, top_k), dtype=torch.long, device=device)
        self.src = torch.full((L, top_k), -1, dtype=torch.int32, device=device)
        self.ahead = False  # device steps ran since the host's view was last pulled
        self.uncounted = False  # device steps ran since the counts were last taken

    def push(self, lru: list[OrderedDict[int, int]], free: list[list[int]]) -> None:
        """Write the host's view: each layer's experts in recency order (oldest first), its free slots."""
        L, S = self.expert_of.shape
        E = self.slot_of.shape[1]
        slot_of = torch.full((L, E), -1, dtype=torch.int32)
        expert_of = torch.full((L, S), -1, dtype=torch.int32)
        stamp = torch.arange(S, dtype=torch.int64).repeat(L, 1) - S  # free slots: s - S
        for layer, order in enumerate(lru):
            for rank, (e, slot) in enumerate(order.items()):
                slot_of[layer, e], expert_of[layer, slot], stamp[layer, slot] = slot, e, rank
        assert self.identity or all(set(free[layer]) == set(range(S)) - set(lru[layer].values())
                                    for layer in range(L))  # (with a slot per expert, slot e is expert e's)
        self.slot_of.copy_(slot_of)
        self.expert_of.copy_(expert_of)
        self.stamp.copy_(stamp)
        self.tick.fill_(S // decode_kernels.STAMP_STEP + 1)  # later steps' stamps above every rank pushed
        self.ahead = False

    def pull(self) -> tuple[list[OrderedDict[int, int]], list[list[int]]]:
        """The host's view of the table (one device read): per layer {expert: slot} oldest first, free slots
        in the order the host pops them."""
        expert_of, stamp = self.expert_of.cpu(), self.stamp.cpu()
        lru, free = [], []
        for owners, stamps in zip(expert_of.tolist(), stamp.tolist()):
            used = sorted((st, slot, e) for slot, (e, st) in enumerate(zip(owners, stamps)) if e >= 0)
            lru.append(OrderedDict((e, slot) for _, slot, e in used))
            free.append(sorted((slot for slot, e in enumerate(owners) if e < 0), reverse=True))
        self.ahead = False
        return lru, free

    def take_prefetched(self) -> int:
        """Experts the prefetch copied in since the last call (one device read, none when no step ran since the
        counts were last taken; call it before ``take_counts``), and zero its counts."""
        if not self.uncounted:
            return 0
        copied = int(self.pf_counts[1].item())
        self.pf_counts.zero_()
        return copied

    def take_counts(self) -> tuple[int, int]:
        """(hits, misses) since the last call (one device read, none when no lookup ran), and zero them."""
        if not self.uncounted:
            return 0, 0
        hits, misses = self.counts.tolist()
        self.counts.zero_()
        self.uncounted = False
        return int(hits), int(misses)

    def layer(self, layer: int) -> decode_kernels.SlotLookup:
        """``layer``'s table for a lookup inside the router's kernel (``decode_kernels.route_topk``'s
        ``lookup``): its result lands in ``slots[layer]`` / ``src[layer]``."""
        self.uncounted = True
        return decode_kernels.SlotLookup(self.slot_of[layer], self.expert_of[layer], self.stamp[layer], self.tick,
                                         self.counts, self.slots[layer], self.src[layer], self.identity)

    def prefetch_layer(self, layer: int) -> decode_kernels.SlotLookup:
        """``layer``'s table for ``decode_kernels.prefetch_experts``: the step's tick less one (``pf_tick``, which
        ``next_tick`` keeps) and the prefetch's own counts (class docstring)."""
        self.uncounted = True
        return decode_kernels.SlotLookup(self.slot_of[layer], self.expert_of[layer], self.stamp[layer], self.pf_tick,
                                         self.pf_counts, self.slots[layer], self.src[layer], self.identity)

    def next_tick(self, prefetch: bool = False) -> None:
        """A device-side step begins (queued, or captured in its graph): tick + 1, and with ``prefetch`` the
        prefetch's tick, one behind."""
        self.tick.add_(1)
        if prefetch:
            torch.sub(self.tick, 1, out=self.pf_tick)


class _Pool:
    """Tensors carved one after another out of one byte allocation (``storage``), each at an ``ALIGN``-byte offset;
    without ``storage`` a dry run: meta tensors, and ``offset`` the bytes the layout needs."""

    ALIGN = 256

    def __init__(self, storage: torch.Tensor | None = None):
        self.storage, self.offset = storage, 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        start = -(-self.offset // self.ALIGN) * self.ALIGN
        n = math.prod(shape) * dtype.itemsize
        self.offset = start + n
        if self.storage is None:
            return torch.empty(shape, dtype=dtype, device="meta")
        return self.storage[start:start + n].view(dtype).view(shape)


@dataclass
class SlotStats:
    """Decode slot-cache lookups: routed (layer, expert) pairs found in the cache, and those copied in."""

    hits: int = 0
    misses: int = 0


class ExpertStore:
    """Device side of the expert offload; see the module docstring."""

    def __init__(self, bank: ExpertBank, device: torch.device, slots_per_layer: int, resident: bool,
                 d2d_from_slot_cache: bool, fp8_slots: bool = False, dequant_on_compute: bool = False,
                 fp8_gemm_math: str | None = None, share_buffers: bool = False):
        cfg = bank.cfg
        self.bank, self.device, self.d2d_from_slot_cache = bank, device, d2d_from_slot_cache
        self.cuda = device.type == "cuda"
        self.lifetime, self.request = Traffic(), Traffic()
        self.slot_lifetime, self.slot_request = SlotStats(), SlotStats()
        self.prefetched = 0  # experts the decode prefetch copied in (``collect_decode_counts``), lifetime
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (before, after) each streamed wait
        self._prime: tuple[int, Traffic] | None = None  # (layer, its traffic, not yet counted) in buffer 0
        self.primes_taken = self.primes_dropped = 0  # lifetime
        self.slot_flushes = 0  # lifetime: the slots forgotten because a buffer sharing their memory was written
        self.startup_h2d_bytes = 0
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        dt = bank.compute_dtype
        if fp8_gemm_math and not (bank.fp8 and bank.block is None):
            raise ValueError("a grouped GEMM over FP8 (fp8_dequant 'gemm', 'w8a8') reads an FP8 bank's values and "
                             "per-row scales: the bank is not one (an FP8 checkpoint's block scales are dequantized "
                             "by a pass)")
        # the prefill's grouped GEMM reads the FP8 values and scales, in this math ("bf16", "fp8"); None: it reads
        # weights dequantized into the compute dtype
        self.fp8_gemm_math = fp8_gemm_math
        fp8_in_gemm = fp8_gemm_math is not None
        if share_buffers and (resident or d2d_from_slot_cache):
            raise ValueError("the slots share the prefill buffers' memory only with a slot cache (not resident) and "
                             "no copies from the slots into the buffers (d2d_from_slot_cache)")
        # the buffers and the slots in one allocation (``share_buffers``): views of one pool, else their own

        def buffers(new: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> tuple[list, list]:
            if fp8_in_gemm:
                return ([Fp8Experts(new((e, 2 * i, h), FP8), new((e, 2 * i), torch.float32), fp8_gemm_math)
                         for _ in range(2)],
                        [Fp8Experts(new((e, h, i), FP8), new((e, h), torch.float32), fp8_gemm_math) for _ in range(2)])
            return [new((e, 2 * i, h), dt) for _ in range(2)], [new((e, h, i), dt) for _ in range(2)]

        def slot_cache(new: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None) -> SlotCache:
            return SlotCache(cfg, slots_per_layer, device, dt, fp8=fp8_slots, alloc=new)

        self.share_buffers = share_buffers
        pool: torch.Tensor | None = None
        if share_buffers:
            sizes = []
            for layout in (buffers, slot_cache):  # a dry run of each, then one allocation of the larger
                dry = _Pool()
                layout(dry.take)
                sizes.append(dry.offset)
            pool = torch.empty(max(sizes), dtype=torch.uint8, device=device)
            self.buf_gate_up, self.buf_down = buffers(_Pool(pool).take)
        else:
            self.buf_gate_up, self.buf_down = buffers(  # (FP8 values and their scales: never read before written)
                lambda shape, dtype: (torch.zeros if dtype == dt else torch.empty)(shape, device=device, dtype=dtype))
        if fp8_in_gemm:
            dequant_on_compute = False
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        # FP8 on CUDA: where a copy lands before it is dequantized (gate_up, down, their scales; one layer)
        self.stage: tuple[torch.Tensor, ...] | None = None
        # one Triton kernel per dequantization on CUDA (the same bits as the torch composition, a fifth of its
        # memory traffic: a streamed layer's dequantization overlaps the compute, and shares the copy stream)
        self.fused_dequant = bank.fp8 and self.cuda and decode_kernels.have_triton()
        self._dequant = decode_kernels.dequantize_fp8 if self.fused_dequant else dequantize_into
        # an FP8 bank's streamed layers dequantized on the compute stream, at the layer's turn, not on the copy
        # stream beside the compute (``stream_layers``); the stage is then needed on every device
        self.dequant_on_compute = bank.fp8 and dequant_on_compute
        self._staged: list[int | None] = [None, None]  # per layer buffer: the layer waiting in the stage for it
        if bank.fp8 and (self.cuda or self.dequant_on_compute) and not fp8_in_gemm:
            self.stage = (torch.empty((e, 2 * i, h), device=device, dtype=FP8),
                          torch.empty((e, h, i), device=device, dtype=FP8),
                          torch.empty(bank.gate_up_scale[0].shape, device=device, dtype=torch.float32),
                          torch.empty(bank.down_scale[0].shape, device=device, dtype=torch.float32))
        self.resident: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.slots: SlotCache | None = None
        if resident:
            if self.cuda or bank.fp8:  # all experts on the device in its dtype, copied (and dequantized) once
                self.resident = []
                for l in range(cfg.num_hidden_layers):
                    if fp8_in_gemm:  # as the bank keeps them
                        gu = Fp8Experts.empty(e, 2 * i, h, device, fp8_gemm_math)
                        dn = Fp8Experts.empty(e, h, i, device, fp8_gemm_math)
                    else:
                        gu = torch.empty((e, 2 * i, h), device=device, dtype=dt)
                        dn = torch.empty((e, h, i), device=device, dtype=dt)
                    self._h2d(gu, dn, l, 0, e, count=False)
                    self.resident.append((gu, dn))
                self.startup_h2d_bytes = bank.bank_bytes if self.cuda else 0
            else:  # the compute device is the host: the bank itself is resident
                self.resident = list(zip(bank.gate_up, bank.down))
        else:
            if fp8_slots and not (bank.fp8 and bank.block is None):
                raise ValueError("FP8 slots hold an FP8 bank's values and per-row scales: the bank is not one")
            self.slots = slot_cache(_Pool(pool).take if pool is not None else None)  # (the same memory's start)

    # -- accounting -----------------------------------------------------------------------------------
    def _count(self, h2d: int = 0, d2d: int = 0, experts: int = 0) -> None:
        for t in (self.lifetime, self.request):
            t.h2d_bytes += h2d
            t.d2d_bytes += d2d
            t.expert_copies += experts

    def begin_request(self) -> None:
        self.collect_decode_counts()  # device-side lookups since the last request belong to the lifetime
        self.request = Traffic()
        self.slot_request = SlotStats()
        self._stalls = []

    def copy_stall_seconds(self) -> float | None:
        """GPU time the compute stream spent waiting for streamed layer copies since ``begin_request`` (CUDA
        timing events on either side of each wait; the caller has synchronised). None off CUDA."""
        if not self.cuda:
            return None
        return sum(a.elapsed_time(b) for a, b in self._stalls) / 1e3

    # -- copies ---------------------------------------------------------------------------------------
    def _h2d(self, gate_up: torch.Tensor, down: torch.Tensor, layer: int, a: int, b: int,
             count: bool = True) -> None:
        """Experts [a, b) of ``layer`` from the host bank into ``gate_up`` / ``down`` ([b - a, ...] on the device,
        the compute dtype), on the current stream, counted as b - a experts' bytes: a copy, or for FP8 a copy of
        the values and scales (into the staging area on CUDA) and their dequantization; into ``Fp8Experts``
        (``fp8_gemm_math``) the values and scales as they are."""
        bank = self.bank
        if isinstance(gate_up, Fp8Experts):
            gate_up.copy_(Fp8Experts(bank.gate_up[layer][a:b], bank.gate_up_scale[layer][a:b]), non_blocking=True)
            down.copy_(Fp8Experts(bank.down[layer][a:b], bank.down_scale[layer][a:b]), non_blocking=True)
        elif not bank.fp8:
            gate_up.copy_(bank.gate_up[layer][a:b], non_blocking=True)
            down.copy_(bank.down[layer][a:b], non_blocking=True)
        else:
            src = self._stage(layer, a, b)
            self._dequant(gate_up, src[0], src[2], bank.block)
            self._dequant(down, src[1], src[3], bank.block)
        if count:
            self._count(h2d=(b - a) * bank.expert_bytes, experts=b - a)

    def _stage(self, layer: int, a: int, b: int) -> tuple[torch.Tensor, ...]:
        """An FP8 bank's experts [a, b) of ``layer`` as they are (gate_up, down values; their scales): copied into
        the staging area on the current stream where there is one, else the host bank's own tensors."""
        bank = self.bank
        src = (bank.gate_up[layer][a:b], bank.down[layer][a:b], bank.gate_up_scale[layer][a:b],
               bank.down_scale[layer][a:b])
        if self.stage is None:
            return src
        staged = tuple(st[:b - a] for st in self.stage)
        for st, x in zip(staged, src):
            st.copy_(x, non_blocking=True)
        return staged

    def _copy_experts(self, buf: int, layer: int, experts: Sequence[int]) -> None:
        """Copy ``experts`` (sorted, distinct) of ``layer`` into buffer ``buf`` at their expert index, on the
        current stream: from the slot cache (device-to-device) when allowed, else from the host in runs."""
        if buf == 0:
            self.drop_prime()  # whatever is about to be written over it
        self._buffers_written()
        self._staged[buf] = None
        bank, gu, dn = self.bank, self.buf_gate_up[buf], self.buf_down[buf]
        # (buffers of FP8 values take a slot's only where the slots hold them too)
        from_slots = self.d2d_from_slot_cache and self.slots and (self.slots.fp8 or not self.fp8_gemm_math)
        cached = self.slots.layer_slots(layer) if from_slots else {}
        if len(experts) == bank.cfg.num_experts and not cached:  # the whole layer: two large transfers
            self._h2d(gu, dn, layer, 0, len(experts))
            return
        run: list[int] = []
        for e in list(experts) + [-1]:  # -1 flushes the last run
            if e >= 0 and e not in cached and (not run or e == run[-1] + 1):
                run.append(e)
                continue
            if run:  # one copy per run of consecutive host experts
                a, b = run[0], run[-1] + 1
                self._h2d(gu[a:b], dn[a:b], layer, a, b)
                run = []
            if e >= 0 and e in cached:
                s, c = cached[e], self.slots
                if isinstance(gu, Fp8Experts):  # as they are
                    gu[e:e + 1].copy_(Fp8Experts(c.gate_up[layer][s:s + 1], c.gate_up_scale[layer][s:s + 1]),
                                      non_blocking=True)
                    dn[e:e + 1].copy_(Fp8Experts(c.down[layer][s:s + 1], c.down_scale[layer][s:s + 1]),
                                      non_blocking=True)
                    self._count(d2d=bank.expert_bytes, experts=1)
                elif c.fp8:  # dequantized on the way, as a copy from the FP8 bank is
                    self._dequant(gu[e:e + 1], c.gate_up[layer][s:s + 1], c.gate_up_scale[layer][s:s + 1], None)
                    self._dequant(dn[e:e + 1], c.down[layer][s:s + 1], c.down_scale[layer][s:s + 1], None)
                    self._count(d2d=bank.expert_bytes, experts=1)
                else:
                    gu[e].copy_(c.gate_up[layer][s], non_blocking=True)
                    dn[e].copy_(c.down[layer][s], non_blocking=True)
                    self._count(d2d=bank.device_expert_bytes, experts=1)
            elif e >= 0:
                run = [e]

    def _buffers_written(self) -> None:
        """A prefill buffer is about to be written (on the current stream or the copy stream, after the compute
        queued so far): where the slots share the buffers' memory (``share_buffers``), the slot cache forgets
        what it holds, on the host and, at the next device-side step, on the device (``SlotCache.flush``)."""
        c = self.slots
        if self.share_buffers and c is not None and (c.loaded or (c.table is not None and c.table.ahead)):
            c.flush()
            self.slot_flushes += 1

    # -- the first layer ahead of its prefill ---------------------------------------------------------------
    def prime(self, layer: int) -> bool:
        """Start copying ``layer`` into buffer 0, for the next ``stream_layers`` to take (module docstring);
        False (nothing done) with resident experts or a prime already there. Its traffic is held back from the
        counters until the prime is taken or dropped."""
        if self.resident is not None or self._prime is not None:
            return False
        before = self.lifetime.snapshot()
        self._issue_layer(0, layer)
        moved = self.lifetime.minus(before)
        self._count(-moved.h2d_bytes, -moved.d2d_bytes, -moved.expert_copies)
        self._prime = (layer, moved)
        return True

    def _end_prime(self) -> None:
        """The prime's copy happened: its traffic counts now, and no prime is held."""
        _, moved = self._prime
        self._prime = None
        self._count(moved.h2d_bytes, moved.d2d_bytes, moved.expert_copies)

    def drop_prime(self) -> None:
        """Forget the prime, if any (its traffic counts, for nothing)."""
        if self._prime is not None:
            self._end_prime()
            self._staged[0] = None
            self.primes_dropped += 1

    def _take_prime(self, layer: int) -> bool:
        """Whether buffer 0 holds (or is receiving) ``layer`` from a prime; if so it is taken and counted now."""
        if self._prime is None or self._prime[0] != layer:
            self.drop_prime()
            return False
        self._end_prime()
        self.primes_taken += 1
        return True

    def _issue_layer(self, buf: int, layer: int) -> None:
        """Start copying a whole layer into ``buf``; on CUDA on the copy stream, after the compute enqueued so
        far (which includes the last reader of ``buf``, and of the stage). With ``dequant_on_compute`` a layer
        that comes whole from the host goes into the stage only, as it is; ``_dequantize_staged`` writes it into
        ``buf`` on the compute stream when its turn comes."""
        everything = range(self.bank.cfg.num_experts)
        staged = self.dequant_on_compute and not (self.d2d_from_slot_cache and self.slots
                                                  and self.slots.layer_slots(layer))
        if buf == 0:
            self.drop_prime()
        self._buffers_written()
        self._staged[buf] = layer if staged else None

        def copy() -> None:
            if staged:
                self._stage_layer(layer)
            else:
                self._copy_experts(buf, layer, everything)

        if not self.cuda:
            copy()
            return
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_event(compute.record_event())
        with torch.cuda.stream(self.copy_stream):
            copy()
            self.ready[buf].record(self.copy_stream)

    def _stage_layer(self, layer: int) -> None:
        """A whole FP8 layer's values and scales from the host into the stage, on the current stream, counted."""
        n = self.bank.cfg.num_experts
        self._stage(layer, 0, n)
        self._count(h2d=n * self.bank.expert_bytes, experts=n)

    def _dequantize_staged(self, buf: int) -> None:
        """The staged layer for ``buf`` into it, on the current (compute) stream; nothing if none waits."""
        if self._staged[buf] is None:
            return
        self._staged[buf] = None
        self._buffers_written()
        stage, block = self.stage, self.bank.block
        self._dequant(self.buf_gate_up[buf], stage[0], stage[2], block)
        self._dequant(self.buf_down[buf], stage[1], stage[3], block)

    def stream_layers(self, order: Sequence[int], before_next: Callable[[int], None] | None = None,
                      ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield (layer, gate_up [E, 2I, H], down [E, H, I]) for each layer in ``order``, each a full copy of
        that layer's bank, double-buffered: item i+1's copy is issued before item i is yielded, so it
        overlaps item i's compute. The consumer must enqueue its compute before asking for the next item.
        ``before_next(i)`` runs when item i's copy is queued and item i+1's is not yet: what it enqueues on
        the compute stream (host-to-device uploads item i's compute needs) reaches the link ahead of item
        i+1's copy, which orders after it. A staged item (``dequant_on_compute``) is dequantized on the compute
        stream once its copy has landed, and item i+1's copy into the stage is issued after that."""
        order = list(order)
        if not order:
            return
        if not self._take_prime(order[0]):
            self._issue_layer(0, order[0])
        for i, layer in enumerate(order):
            buf = i % 2
            if before_next is not None:
                before_next(i)
            # a layer waiting in the stage holds it until it is dequantized: the next copy is issued after that
            early = self._staged[buf] is None
            if early and i + 1 < len(order):
                self._issue_layer(1 - buf, order[i + 1])
            if self.cuda:  # the compute stream waits for the copy; timing events either side measure the stall
                cur = torch.cuda.current_stream(self.device)
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record(cur)
                cur.wait_event(self.ready[buf])
                after.record(cur)
                self._stalls.append((before, after))
            self._dequantize_staged(buf)
            if not early and i + 1 < len(order):
                self._issue_layer(1 - buf, order[i + 1])
            yield layer, self.buf_gate_up[buf], self.buf_down[buf]

    def load_experts(self, layer: int, experts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Demand loading: copy only ``experts`` of ``layer`` into buffer 0 at their expert index, on the
        compute stream (the caller has just synchronised on the routing anyway). Other experts' entries
        hold stale data and must not be routed to."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)  # no prefetch still writing
        self._copy_experts(0, layer, sorted(set(experts)))
        return self.buf_gate_up[0], self.buf_down[0]

    def decode_weights(self, layer: int, reads_fp8: bool = False,
                       ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """What decode's experts read for ``layer``: (gate_up, down, scales). The weights are the resident experts
        [E, 2I, H], [E, H, I] or the layer's slot block [S, 2I, H], [S, H, I]; ``scales`` are FP8 slots' row
        scales (gate_up [S, 2I], down [S, H] float32: ``decode_kernels.moe_tokens``' ``slot_scales``), None where
        the weights are in the compute dtype. Resident FP8 experts (``fp8_gemm_math``) go to a decoder whose
        Triton experts read FP8 (``reads_fp8``, the decoder's choice) as their values and scales, as FP8 slots
        do; to any other decoder as weight-only ``Fp8Experts`` (a decode step reads its experts in the compute
        dtype, W8A8 prefill or not)."""
        if self.resident is not None:
            gu, dn = self.resident[layer]
            if isinstance(gu, Fp8Experts) and reads_fp8:
                return gu.values, dn.values, (gu.scales, dn.scales)
            if isinstance(gu, Fp8Experts):  # decode is weight-only whatever prefill's math, as from its slots
                return Fp8Experts(gu.values, gu.scales, "bf16"), Fp8Experts(dn.values, dn.scales, "bf16"), None
            return gu, dn, None
        c = self.slots
        assert c is not None
        scales = (c.gate_up_scale[layer], c.down_scale[layer]) if c.fp8 else None
        return c.gate_up[layer], c.down[layer], scales

    def decode_experts(self, layer: int, ids: Sequence[int]) -> list[int]:
        """Make ``ids`` (the routed expert ids of ``layer``, any order, repeats allowed) resident in the layer's
        slots, copying misses from the host bank on the current stream; returns the slot of each id, in order.
        Hits are touched first so a miss never evicts an expert this step needs."""
        cache = self.slots
        assert cache is not None, "decode_experts needs a slot cache (not in resident mode)"
        cache.sync_host()
        needed = sorted(set(ids))
        if len(needed) > cache.slots_per_layer:
            raise RuntimeError(f"{len(needed)} experts needed at once > {cache.slots_per_layer} slots per layer")
        lru, free = cache.lru[layer], cache.free[layer]
        slot_of: dict[int, int] = {}
        for e in needed:
            s = lru.get(e)
            if s is not None:
                lru.move_to_end(e)
                slot_of[e] = s
        hits = len(slot_of)
        for e in needed:
            if e in slot_of:
                continue
            if cache.identity:
                s = e
            elif free:
                s = free.pop()
            else:
                s = lru.popitem(last=False)[1]
                cache.loaded -= 1
            self._to_slot(layer, s, e)
            lru[e] = s
            cache.loaded += 1
            slot_of[e] = s
        self._count_lookups(hits, len(needed) - hits)
        cache.changed()
        return [slot_of[e] for e in ids]

    def _to_slot(self, layer: int, slot: int, e: int) -> None:
        """Expert ``e`` of ``layer`` from the host bank into ``slot`` on the current stream, counted: FP8 slots
        take the bank's float8 values and row scales as they are, other slots the compute dtype (``_h2d``)."""
        c = self.slots
        if not c.fp8:
            self._h2d(c.gate_up[layer][slot:slot + 1], c.down[layer][slot:slot + 1], layer, e, e + 1)
            return
        bank = self.bank
        c.gate_up[layer][slot].copy_(bank.gate_up[layer][e], non_blocking=True)
        c.down[layer][slot].copy_(bank.down[layer][e], non_blocking=True)
        c.gate_up_scale[layer][slot].copy_(bank.gate_up_scale[layer][e], non_blocking=True)
        c.down_scale[layer][slot].copy_(bank.down_scale[layer][e], non_blocking=True)
        self._count(h2d=bank.expert_bytes, experts=1)

    def _count_lookups(self, hits: int, misses: int) -> None:
        for st in (self.slot_lifetime, self.slot_request):
            st.hits += hits
            st.misses += misses

    def decode_host(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``decode_experts`` on the device, for a step that never waits for the host (the slot cache's
        ``DeviceSlotTable``): ``layer``'s host bank as ``decode_kernels.moe_tokens``' ``host`` (gate_up, down; an
        FP8 bank's float8 values and row scales), whose kernels look the routed experts up in the table
        (``DeviceSlotTable.layer``), read the misses from the registered host memory and leave them in their
        slots. Captures in a CUDA graph; the hits and misses are counted on the device until
        ``collect_decode_counts``."""
        bank = self.bank
        host = (bank.gate_up[layer], bank.down[layer])
        if bank.fp8:  # read as FP8 with the row scales, dequantized in the kernels
            host += (bank.gate_up_scale[layer], bank.down_scale[layer])
        return host

    def collect_decode_counts(self) -> None:
        """Fold the device table's hits and misses since the last call into the accounting (each miss copied
        one expert host->device), and the experts the prefetch copied in (traffic and ``prefetched``; not
        lookups); nothing without a table."""
        table = self.slots.table if self.slots is not None else None
        if table is None:
            return
        prefetched = table.take_prefetched()
        hits, misses = table.take_counts()
        self._count(h2d=(misses + prefetched) * self.bank.expert_bytes, experts=misses + prefetched)
        self._count_lookups(hits, misses)
        self.prefetched += prefetched

    def flush_slots(self) -> None:
        if self.slots is not None:
            self.slots.flush()

    def forget_traffic(self) -> None:
        """Zero the lifetime and request counters (after start-up work that is not a request's)."""
        self.drop_prime()
        self.lifetime, self.request = Traffic(), Traffic()
        self.slot_lifetime, self.slot_request = SlotStats(), SlotStats()
        if self.slots is not None and self.slots.table is not None:
            self.slots.table.take_prefetched()  # and the device-side lookups' counts not yet collected
            self.slots.table.take_counts()
        self.prefetched = 0

    # -- bandwidth ------------------------------------------------------------------------------------
    def measure_h2d_gbps(self, probe_bytes: int, trials: int = 3) -> float:
        """Host->device GB/s (1e9 bytes/s) of whole-layer bank copies into a layer buffer: the best of
        ``trials`` timed runs of at least ``probe_bytes / trials`` each, after one warm-up copy (the best,
        because a busy host only ever makes a run slower). Not counted as traffic. NaN when probe_bytes is 0."""
        if probe_bytes <= 0:
            return float("nan")
        self.drop_prime()  # the probe copies into buffer 0
        self._buffers_written()
        bank, n_layers = self.bank, self.bank.cfg.num_hidden_layers

        def copy(layer: int) -> None:
            self._h2d(self.buf_gate_up[0], self.buf_down[0], layer, 0, bank.cfg.num_experts, count=False)

        sync = torch.cuda.synchronize if self.cuda else (lambda *a: None)
        copy(0)
        sync(self.device)
        best, n = 0.0, 0
        for _ in range(max(1, trials)):
            moved, t0 = 0, time.perf_counter()
            while moved < probe_bytes / max(1, trials):
                copy(n % n_layers)
                moved += bank.layer_bytes
                n += 1
            sync(self.device)
            best = max(best, moved / max(time.perf_counter() - t0, 1e-9) / 1e9)
        return best
