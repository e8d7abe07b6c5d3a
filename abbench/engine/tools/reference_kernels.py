"""Reference kernels that no request runs: what the tests and the gpuchecks compare the live kernels with.

- ``assign_slots`` / ``lookup(table, layer, top_ids)``: the decode slot cache's device-side lookup as a kernel of
  its own. Decode runs the same lookup inside the router's kernel (``ops.kernels.route_topk`` with ``lookup``:
  ``slot_assign``, one program); the tests check both against the host's LRU step by step.
- ``fetch_misses``: the copy kernel of a step's slot-cache misses, reading the registered host bank over PCIe
  (zero-copy). Decode makes the same copy inside the experts' kernels (``ops.kernels.moe_one_token``'s ``fetch``);
  this is that copy's reference in the tests and gpucheck's measure of zero-copy bandwidth.
- ``attention_sdpa(q, keys, values, pos, scale)``: one token's grouped-query attention through
  ``F.scaled_dot_product_attention``, the G query heads of a KV head taken as G queries of one sequence
  (q [1, Hkv, G, D] against [1, Hkv, L, D]: no expansion of K and V), the positions after ``pos`` masked by an
  additive bias (static shapes: it captures); ``attention_sdpa_exact`` attends over exactly pos + 1 keys with
  no mask (the flash kernel; one shape per position, so no graph). ``gpucheck_decode_kernels`` times them
  against ``ops.dense.decode_gqa`` and the split-KV kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from abbench.engine.ops.kernels import STAMP_NEVER, STAMP_STEP, HostMapped, check_slot_table, next_pow2, triton
from abbench.engine.runtime.experts import DeviceSlotTable

__all__ = ["assign_slots", "attention_sdpa", "attention_sdpa_exact", "fetch_misses", "lookup"]


if triton is not None:  # (the CPU build of torch ships no Triton: the functions below say so when called)
    import triton.language as tl

    from abbench.engine.ops.kernels import slot_assign

    @triton.jit
    def _assign_slots(ids_ptr, slot_of_ptr, expert_of_ptr, stamp_ptr, tick_ptr, counts_ptr, slots_ptr, src_ptr,
                      K: tl.constexpr, KP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                      IDENTITY: tl.constexpr, STEP: tl.constexpr, NEVER: tl.constexpr):
        j = tl.arange(0, KP)
        jm = j < K
        ids = tl.load(ids_ptr + j, mask=jm, other=0).to(tl.int32)
        slot_assign(ids, jm, slot_of_ptr, expert_of_ptr, stamp_ptr, tick_ptr, counts_ptr, slots_ptr, src_ptr, K, KP,
                S, SP, IDENTITY, STEP, NEVER)

    @triton.jit
    def _fetch_misses(src_ptr, slots_ptr, host_gu, host_dn, dev_gu, dev_dn, N_GU: tl.constexpr,
                      N_DN: tl.constexpr, PER_GU: tl.constexpr, PER_DN: tl.constexpr, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        c = tl.program_id(1)
        e = tl.load(src_ptr + j).to(tl.int64)
        if e >= 0:  # a miss: copy chunk c of its rows from the host bank into its slot
            s = tl.load(slots_ptr + j).to(tl.int64)
            lo = c * PER_GU
            for off in range(0, PER_GU, BLOCK):
                i = lo + off + tl.arange(0, BLOCK)
                m = i < N_GU
                tl.store(dev_gu + s * N_GU + i, tl.load(host_gu + e * N_GU + i, mask=m), mask=m)
            lo = c * PER_DN
            for off in range(0, PER_DN, BLOCK):
                i = lo + off + tl.arange(0, BLOCK)
                m = i < N_DN
                tl.store(dev_dn + s * N_DN + i, tl.load(host_dn + e * N_DN + i, mask=m), mask=m)


def assign_slots(top_ids: torch.Tensor, slot_of: torch.Tensor, expert_of: torch.Tensor, stamp: torch.Tensor,
                 tick: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor, src: torch.Tensor,
                 identity: bool) -> None:
    """One layer's decode slot-cache lookup on the device, one program (module docstring of
    ``experts.DeviceSlotTable``): top_ids [1, k] routed expert ids; the layer's table slot_of [E] int32 (slot
    or -1), expert_of [S] int32 (expert or -1), stamp [S] int64 (recency), updated in place; tick [1] int64 the
    step; counts [2] int64 (hits, misses) added to. Writes slots [k] int64 (each routed expert's slot) and src
    [k] int32 (the expert to copy into that slot, -1 for a hit). Hits are touched first, then each miss takes
    the least recently used slot (a free one first, lowest slot first), misses in ascending expert order: the
    host cache's order (``ExpertStore.decode_experts``). ``identity``: expert e lives in slot e."""
    if triton is None:
        raise RuntimeError("assign_slots needs Triton")
    k, s = top_ids.shape[-1], check_slot_table(top_ids.shape[-1], stamp.shape[0])
    _assign_slots[(1,)](top_ids.reshape(-1), slot_of, expert_of, stamp, tick, counts, slots, src, K=k,
                        KP=next_pow2(k), S=s, SP=next_pow2(s), IDENTITY=identity, STEP=STAMP_STEP,
                        NEVER=STAMP_NEVER, num_warps=1)  # one warp: its reductions need no shared memory


def lookup(table: DeviceSlotTable, layer: int, top_ids: torch.Tensor) -> None:
    """:func:`assign_slots` on ``layer`` of ``table``: the result in ``table.slots[layer]`` / ``table.src[layer]``,
    as the router kernel's lookup (``DeviceSlotTable.layer``) leaves it."""
    table.uncounted = True
    assign_slots(top_ids, table.slot_of[layer], table.expert_of[layer], table.stamp[layer], table.tick,
                 table.counts, table.slots[layer], table.src[layer], table.identity)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element size: a copy that moves bits, never converts them."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def fetch_misses(src: torch.Tensor, slots: torch.Tensor, host_gate_up: torch.Tensor, host_down: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, chunks: int = 32, block: int = 4096,
                 warps: int = 4) -> None:
    """Copy the missed experts (``src`` [k] int32, -1 for a hit) of one layer from the host bank (host_gate_up
    [E, 2I, H], host_down [E, H, I], page-locked and registered when the slots are on CUDA) into their slots
    (``slots`` [k]) of gate_up [S, 2I, H] / down [S, H, I]: one kernel of k x ``chunks`` programs whose loads
    read host memory directly over PCIe (zero-copy), so the host never learns which experts missed. Bitwise
    copies. A hit's programs return at once. ``block`` elements per load, ``warps`` warps per program. Decode
    no longer calls it (``moe_one_token``'s ``fetch`` makes the same copy inside the experts' kernels); it is
    that copy's reference in the tests and gpucheck's measure of zero-copy bandwidth."""
    if triton is None:
        raise RuntimeError("fetch_misses needs Triton")
    if not all(t.is_contiguous() for t in (host_gate_up, host_down, gate_up, down)):
        raise ValueError("fetch_misses: contiguous expert blocks")
    n_gu, n_dn = host_gate_up[0].numel(), host_down[0].numel()
    chunks = max(1, min(chunks, triton.cdiv(n_gu, block)))  # no programs with nothing to copy
    per_gu = triton.cdiv(triton.cdiv(n_gu, chunks), block) * block
    per_dn = triton.cdiv(triton.cdiv(n_dn, chunks), block) * block
    hg, hd = _as_bits(host_gate_up), _as_bits(host_down)
    if gate_up.is_cuda and not host_gate_up.is_cuda:
        hg, hd = HostMapped(hg), HostMapped(hd)
    _fetch_misses[(src.shape[0], chunks)](src, slots, hg, hd, _as_bits(gate_up), _as_bits(down), N_GU=n_gu,
                                          N_DN=n_dn, PER_GU=per_gu, PER_DN=per_dn, BLOCK=block,
                                          num_warps=warps)


def attention_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``model.decode_gqa``'s contract through SDPA: q [Hq, 1, D] over keys, values [Hkv, L, D] (L: the static
    bucket), positions after ``pos`` (int64 [1] on the device) masked -> [Hq, 1, D]."""
    hq, _, d = q.shape
    hkv, length, _ = keys.shape
    qg = q.reshape(1, hkv, hq // hkv, d)  # [1, Hkv, G, D]: a KV head's query heads as queries of one sequence
    bias = torch.zeros(length, dtype=q.dtype, device=q.device).masked_fill(
        torch.arange(length, device=q.device) > pos, float("-inf"))  # [L]
    out = F.scaled_dot_product_attention(qg, keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=bias.view(1, 1, 1, length), scale=scale)  # [1, Hkv, G, D]
    return out.reshape(hq, 1, d)


def attention_sdpa_exact(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int,
                         scale: float) -> torch.Tensor:
    """One token's attention over exactly the first ``n`` cache positions, no mask (SDPA picks flash where it
    can): q [Hq, 1, D], keys, values [Hkv, >=n, D] -> [Hq, 1, D]. The shape changes with n: no CUDA graph."""
    hq, _, d = q.shape
    hkv = keys.shape[0]
    qg = q.reshape(1, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(qg, keys[:, :n].unsqueeze(0), values[:, :n].unsqueeze(0), scale=scale)
    return out.reshape(hq, 1, d)
