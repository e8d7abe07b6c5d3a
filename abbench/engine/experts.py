"""Expert offload: the host bank, the prefill double buffer, the decode slot cache, and byte accounting.

Contract:
- ``ExpertBank`` keeps every layer's experts in host memory, two tensors a layer allocated at their exact
  size: ``gate_up[l]`` [E, 2I, H] (gate rows then up rows, nn.Linear layout) and ``down[l]`` [E, H, I].
  ``torch._grouped_mm`` takes them as transposed views (K-contiguous B operand), so a layer crosses PCIe in
  two copies and nothing is transposed in the hot loop. On CUDA the memory is page-locked with
  ``cudaHostRegister`` on an exact-size allocation: ``torch.empty(..., pin_memory=True)`` goes through the
  caching host allocator, which rounds every block up to a power of two (measured on an H200 host, torch
  2.11: a 1.21 GB Qwen3-30B-A3B layer grew the process by 2.00 GiB that way, by 1.13 GiB = 1.21 GB
  registered). Copies from registered memory run at full speed (54.7 GB/s measured, layer by layer).
  On CPU it is ordinary memory and every "transfer" is a plain synchronous copy.
- ``ExpertStore`` owns what lives on the compute device:
  * two layer buffers for prefill. ``stream_layers(order)`` yields (layer, gate_up, down) for each layer
    of ``order`` while the copy of the next one runs on a separate CUDA stream (events order copy after
    the compute that last read the buffer, and compute after its copy); on CPU the same code copies
    synchronously.
  * ``load_experts(layer, ids)``: demand loading of some experts into a layer buffer at their index.
  * a decode slot cache of ``capacity`` experts shared by all layers, LRU-evicted:
    ``decode_experts(layer, ids)`` makes the routed experts resident and returns their slot indices.
  * resident mode: every layer's experts on the device from the start (on CPU the bank itself).
  * optional ``d2d_from_slot_cache``: experts already in the slot cache reach a layer buffer by a
    device-to-device copy instead of from the host.
- Accounting: every expert copy adds to ``lifetime`` and ``request`` (``Traffic``): host->device bytes,
  device->device bytes, and the number of experts copied. ``bank_bytes`` is one full pass over all layers.
  ``measure_h2d_gbps`` times host->device copies of layer banks (not counted as traffic).
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .config import ModelConfig

_PAGE = 4096


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


def _unregister(ptrs: list[int]) -> None:
    if torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        for ptr in ptrs:
            cudart.cudaHostUnregister(ptr)


class ExpertBank:
    """All layers' experts in host memory (page-locked when the compute device is CUDA)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pin: bool):
        self.cfg, self.dtype, self.pinned = cfg, dtype, pin
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.expert_bytes = 3 * h * i * dtype.itemsize
        self.layer_bytes = e * self.expert_bytes
        self.bank_bytes = cfg.num_hidden_layers * self.layer_bytes
        self._registered: list[int] = []
        weakref.finalize(self, _unregister, self._registered)
        self.gate_up = [self._alloc((e, 2 * i, h)) for _ in range(cfg.num_hidden_layers)]  # [E, 2I, H] each
        self.down = [self._alloc((e, h, i)) for _ in range(cfg.num_hidden_layers)]  # [E, H, I] each

    def _alloc(self, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.pinned:
            return torch.empty(shape, dtype=self.dtype)
        nbytes = self.dtype.itemsize * shape[0] * shape[1] * shape[2]  # exact: no power-of-two rounding
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)  # exact size plus alignment slack
        off = (-raw.data_ptr()) % _PAGE
        t = raw[off:off + nbytes].view(self.dtype).view(shape)
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")
        self._registered.append(t.data_ptr())
        return t


class SlotCache:
    """Decode-time expert slots on the device, shared by all layers, least-recently-used eviction."""

    def __init__(self, cfg: ModelConfig, capacity: int, device: torch.device, dtype: torch.dtype):
        e_i, h = cfg.moe_intermediate_size, cfg.hidden_size
        self.capacity = capacity
        self.gate_up = torch.zeros((capacity, 2 * e_i, h), device=device, dtype=dtype)  # [N, 2I, H]
        self.down = torch.zeros((capacity, h, e_i), device=device, dtype=dtype)  # [N, H, I]
        self.flush()

    def flush(self) -> None:
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest first
        self.free = list(range(self.capacity - 1, -1, -1))

    def layer_slots(self, layer: int) -> dict[int, int]:
        """{expert: slot} of this layer's experts in the cache."""
        return {e: s for (lay, e), s in self.lru.items() if lay == layer}


class ExpertStore:
    """Device side of the expert offload; see the module docstring."""

    def __init__(self, bank: ExpertBank, device: torch.device, slot_capacity: int, resident: bool,
                 d2d_from_slot_cache: bool):
        cfg = bank.cfg
        self.bank, self.device, self.d2d_from_slot_cache = bank, device, d2d_from_slot_cache
        self.cuda = device.type == "cuda"
        self.lifetime, self.request = Traffic(), Traffic()
        self.startup_h2d_bytes = 0
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.buf_gate_up = [torch.zeros((e, 2 * i, h), device=device, dtype=bank.dtype) for _ in range(2)]
        self.buf_down = [torch.zeros((e, h, i), device=device, dtype=bank.dtype) for _ in range(2)]
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        self.resident: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.slots: SlotCache | None = None
        if resident:
            if self.cuda:  # all experts on the device, copied once at start
                self.resident = [(bank.gate_up[l].to(device), bank.down[l].to(device))
                                 for l in range(cfg.num_hidden_layers)]
                self.startup_h2d_bytes = bank.bank_bytes
            else:  # the compute device is the host: the bank itself is resident
                self.resident = list(zip(bank.gate_up, bank.down))
        else:
            self.slots = SlotCache(cfg, slot_capacity, device, bank.dtype)

    # -- accounting -----------------------------------------------------------------------------------
    def _count(self, h2d: int = 0, d2d: int = 0, experts: int = 0) -> None:
        for t in (self.lifetime, self.request):
            t.h2d_bytes += h2d
            t.d2d_bytes += d2d
            t.expert_copies += experts

    def begin_request(self) -> None:
        self.request = Traffic()

    # -- copies ---------------------------------------------------------------------------------------
    def _copy_experts(self, buf: int, layer: int, experts: Sequence[int]) -> None:
        """Copy ``experts`` (sorted, distinct) of ``layer`` into buffer ``buf`` at their expert index, on the
        current stream: from the slot cache (device-to-device) when allowed, else from the host in runs."""
        bank, gu, dn = self.bank, self.buf_gate_up[buf], self.buf_down[buf]
        cached = self.slots.layer_slots(layer) if (self.d2d_from_slot_cache and self.slots) else {}
        if len(experts) == bank.cfg.num_experts and not cached:  # the whole layer: two large transfers
            gu.copy_(bank.gate_up[layer], non_blocking=True)
            dn.copy_(bank.down[layer], non_blocking=True)
            self._count(h2d=bank.layer_bytes, experts=len(experts))
            return
        run: list[int] = []
        for e in list(experts) + [-1]:  # -1 flushes the last run
            if e >= 0 and e not in cached and (not run or e == run[-1] + 1):
                run.append(e)
                continue
            if run:  # one copy per run of consecutive host experts
                a, b = run[0], run[-1] + 1
                gu[a:b].copy_(bank.gate_up[layer][a:b], non_blocking=True)
                dn[a:b].copy_(bank.down[layer][a:b], non_blocking=True)
                self._count(h2d=(b - a) * bank.expert_bytes, experts=b - a)
                run = []
            if e >= 0 and e in cached:
                s = cached[e]
                gu[e].copy_(self.slots.gate_up[s], non_blocking=True)
                dn[e].copy_(self.slots.down[s], non_blocking=True)
                self._count(d2d=bank.expert_bytes, experts=1)
            elif e >= 0:
                run = [e]

    def _issue_layer(self, buf: int, layer: int) -> None:
        """Start copying a whole layer into ``buf``; on CUDA on the copy stream, after the compute enqueued so
        far (which includes the last reader of ``buf``)."""
        everything = range(self.bank.cfg.num_experts)
        if not self.cuda:
            self._copy_experts(buf, layer, everything)
            return
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_event(compute.record_event())
        with torch.cuda.stream(self.copy_stream):
            self._copy_experts(buf, layer, everything)
            self.ready[buf].record(self.copy_stream)

    def stream_layers(self, order: Sequence[int]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield (layer, gate_up [E, 2I, H], down [E, H, I]) for each layer in ``order``, each a full copy of
        that layer's bank, double-buffered: item i+1's copy is issued before item i is yielded, so it
        overlaps item i's compute. The consumer must enqueue its compute before asking for the next item."""
        order = list(order)
        if not order:
            return
        self._issue_layer(0, order[0])
        for i, layer in enumerate(order):
            buf = i % 2
            if i + 1 < len(order):
                self._issue_layer(1 - buf, order[i + 1])
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self.ready[buf])
            yield layer, self.buf_gate_up[buf], self.buf_down[buf]

    def load_experts(self, layer: int, experts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Demand loading: copy only ``experts`` of ``layer`` into buffer 0 at their expert index, on the
        compute stream (the caller has just synchronised on the routing anyway). Other experts' entries
        hold stale data and must not be routed to."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)  # no prefetch still writing
        self._copy_experts(0, layer, sorted(set(experts)))
        return self.buf_gate_up[0], self.buf_down[0]

    def decode_experts(self, layer: int, ids: list[list[int]]) -> tuple[list[list[int]], torch.Tensor,
                                                                            torch.Tensor]:
        """Make ``ids`` (expert ids [T][k]) of ``layer`` resident in the slot cache, copying misses from the
        host; returns the slot ids [T][k] and the slot tensors [N, 2I, H], [N, H, I]."""
        cache, bank = self.slots, self.bank
        assert cache is not None, "decode_experts needs a slot cache (not in resident mode)"
        needed = sorted({e for row in ids for e in row})
        if len(needed) > cache.capacity:
            raise RuntimeError(f"{len(needed)} experts needed at once > gpu_expert_slots={cache.capacity}")
        slot_of: dict[int, int] = {}
        for e in needed:  # hits first, so they are the most recent and cannot be evicted below
            s = cache.lru.get((layer, e))
            if s is not None:
                cache.lru.move_to_end((layer, e))
                slot_of[e] = s
        for e in needed:
            if e in slot_of:
                continue
            s = cache.free.pop() if cache.free else cache.lru.popitem(last=False)[1]
            cache.gate_up[s].copy_(bank.gate_up[layer][e], non_blocking=True)
            cache.down[s].copy_(bank.down[layer][e], non_blocking=True)
            self._count(h2d=bank.expert_bytes, experts=1)
            cache.lru[(layer, e)] = s
            slot_of[e] = s
        return [[slot_of[e] for e in row] for row in ids], cache.gate_up, cache.down

    def flush_slots(self) -> None:
        if self.slots is not None:
            self.slots.flush()

    # -- bandwidth ------------------------------------------------------------------------------------
    def measure_h2d_gbps(self, probe_bytes: int, trials: int = 3) -> float:
        """Host->device GB/s (1e9 bytes/s) of whole-layer bank copies into a layer buffer: the best of
        ``trials`` timed runs of at least ``probe_bytes / trials`` each, after one warm-up copy (the best,
        because a busy host only ever makes a run slower). Not counted as traffic. NaN when probe_bytes is 0."""
        if probe_bytes <= 0:
            return float("nan")
        bank, n_layers = self.bank, self.bank.cfg.num_hidden_layers

        def copy(layer: int) -> None:
            self.buf_gate_up[0].copy_(bank.gate_up[layer], non_blocking=True)
            self.buf_down[0].copy_(bank.down[layer], non_blocking=True)

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
