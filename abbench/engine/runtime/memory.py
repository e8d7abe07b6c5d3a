"""The device-memory plan: what the engine keeps on the compute device, and the decode slot cache a budget leaves.

Contract:
- ``plan_device_memory`` sizes the decode slot cache from a device-memory budget: it adds up what the engine
  keeps on the device (dense weights, one KV cache per sequence it may run at once, the prefill double buffer, a workspace bound for one chunk
  (twice with prefill CUDA graphs) and the parked layer-major activations, resident experts; Qwen4-Exp's PLE tables stay in host memory) and
  gives the rest to expert slots, the same number for every layer. A budget that cannot hold one token's experts in every layer is refused with
  every term named.
- An FP8 bank (``EngineConfig.expert_dtype`` "fp8") keeps experts in the compute dtype on the device (buffers,
  resident experts) and adds a staging area of one layer's FP8 values and scales plus the dequantization's
  float32 temporary (``staging_bytes``); with ``fp8_dequant`` "gemm" or "w8a8" the buffers and resident
  experts hold its FP8 values and row scales instead, and there is no stage. Its decode slots hold its float8
  values and row scales where decode's Triton experts read them (``fp8_slots``: ``EngineConfig.slot_dtype``), about half a slot's bytes, so about
  twice the slots fit a budget; otherwise the compute dtype.
- Slots sharing the buffers (``EngineConfig.slots_share_buffers``): the slot cache and the two prefill buffers in one
  allocation of the larger of the two, so the buffers' bytes count once (``MemoryPlan.pool_bytes``). "auto" takes it
  where the budget holds fewer slots than decode needs beside the buffers, for one sequence at a time (a prefill
  overwrites the slots: decode starts cold after each prefill), a streamed prefill, no ``d2d_from_slot_cache``;
  Qwen3.5/3.6 at 262,144 tokens under 16 GiB holds 1 bf16 slot a layer beside the buffers and 14 in their memory.
- ``RUNTIME_RESERVE_BYTES``: what a budget sets aside beyond the engine's own tensors (CUDA context,
  cuBLAS/CUTLASS workspaces, Triton's and the graphs' pools, allocator slack), so that the process as the driver
  sees it fits the budget: a budget is in GiB, as cards are sized, and ``--gpu-memory-budget 16`` means "the
  process fits a 16 GB card". Measured on the H200 (torch 2.11): NVML's process peak was ~1.6 GB above torch's own
  peak in run 20261130-h200-qwen3-30b-a3b, and 1.19 GiB above it (22.23 against 21.04 GiB) in
  20261204b-h200-decode-offload-4k, so the reserve is 2 GiB (it was 1 GiB, which left NVML's peak over the budget
  by up to half a GiB).

Like :mod:`abbench.engine.config`, it imports no torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

from abbench.engine.config import (
    AUTO_CHUNK_TOKENS, FP8_GEMM_MATH, ITEMSIZE, EngineConfig, HybridConfig, ModelConfig, Qwen4Config,
)

GIB = 2**30
RUNTIME_RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine keeps on the compute device, in bytes, and the slots per layer that fit the budget."""

    budget_bytes: int
    dense_bytes: int  # embeddings, lm_head, attention and router weights, norms
    kv_bytes: int  # the KV caches: max_context positions for each of seqs sequences
    prefill_buffer_bytes: int  # the double buffer of two layer banks (0 when resident)
    resident_bytes: int  # every expert on the device (resident mode only)
    workspace_bytes: int  # one chunk's activations and MoE intermediates, parked layer-major activations
    reserve_bytes: int  # RUNTIME_RESERVE_BYTES
    slot_bytes: int  # one expert slot in every layer (num_hidden_layers x one expert)
    slots_per_layer: int  # 0 when resident
    seqs: int = 1  # sequences at once (EngineConfig.max_num_seqs), one cache each
    staging_bytes: int = 0  # FP8 bank: one layer's FP8 values and scales, and the dequantization's temporary
    slot_dtype: str = ""  # what a slot holds: the compute dtype, or "fp8" (an FP8 bank's values and row scales)
    slots_share_buffers: bool = False  # the slot cache and the prefill buffers in one allocation (``pool_bytes``)

    @property
    def fixed_bytes(self) -> int:
        """Everything but the slot cache (and, where they share it, the buffers: ``pool_bytes``)."""
        buffers = 0 if self.slots_share_buffers else self.prefill_buffer_bytes
        return (self.dense_bytes + self.kv_bytes + buffers + self.resident_bytes
                + self.workspace_bytes + self.reserve_bytes + self.staging_bytes)

    def pool_bytes(self, slots: int) -> int:
        """The slot cache of ``slots`` per layer, or where the buffers share its memory the larger of the two."""
        if self.slots_share_buffers:
            return max(slots * self.slot_bytes, self.prefill_buffer_bytes)
        return slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.pool_bytes(self.slots_per_layer)

    def describe(self) -> str:
        gb = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        kv = f"KV {gb(self.kv_bytes)}" + (f" ({self.seqs} sequences)" if self.seqs > 1 else "")
        staging = f"FP8 staging {gb(self.staging_bytes)} + " if self.staging_bytes else ""
        buffers = ("" if self.slots_share_buffers else f"prefill buffers {gb(self.prefill_buffer_bytes)} + ")
        shared = (f", in one allocation of {gb(self.pool_bytes(self.slots_per_layer))} with the prefill buffers "
                  f"({gb(self.prefill_buffer_bytes)})" if self.slots_share_buffers else "")
        return (f"budget {gb(self.budget_bytes)}: dense {gb(self.dense_bytes)} + {kv} + {buffers}"
                f"resident experts {gb(self.resident_bytes)} + {staging}"
                f"workspace {gb(self.workspace_bytes)} + runtime reserve {gb(self.reserve_bytes)} = "
                f"{gb(self.fixed_bytes)} fixed; {self.slots_per_layer} expert slots per layer"
                f"{' (FP8)' if self.slot_dtype == 'fp8' else ''} x "
                f"{gb(self.slot_bytes)} = {gb(self.slots_per_layer * self.slot_bytes)}{shared}")


def dense_params(mc: ModelConfig) -> int:
    """Parameters of everything but the routed experts (for a hybrid: DeltaNet and gated attention layers and
    the shared experts too)."""
    h, d = mc.hidden_size, mc.head_dim
    attn = h * d * (2 * mc.num_attention_heads + 2 * mc.num_key_value_heads) + 2 * d  # q, o, k, v, q/k norms
    per_layer = mc.num_experts * h + 2 * h  # router + the two norms
    embeds = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    if not mc.is_hybrid:
        return mc.num_hidden_layers * (per_layer + attn) + embeds + h
    assert isinstance(mc, HybridConfig)
    gated_attn = attn + h * d * mc.num_attention_heads  # q_proj also gives the output gate
    vd = mc.linear_num_value_heads * mc.linear_value_head_dim
    gdn = (h * mc.conv_dim + h * vd + 2 * h * mc.linear_num_value_heads + mc.conv_dim * mc.linear_conv_kernel_dim
           + 2 * mc.linear_num_value_heads + mc.linear_value_head_dim + vd * h)  # qkv, z, b, a, conv, A, dt, norm, out
    shared = 3 * h * mc.shared_expert_intermediate_size + h
    n_attn = len(mc.attention_layers)
    if mc.is_qwen4:  # hyper-connection mixers instead of the norms, the indexer, PLE projections (tables: host)
        assert isinstance(mc, Qwen4Config)
        w, r = mc.stream_width, mc.hc_lowrank
        mixer = w + 2 * r * w + mc.hc_count * w
        indexer = (mc.indexer_n_heads + 1) * mc.indexer_head_dim * h + 2 * mc.indexer_head_dim
        ple = w * mc.ple_embed_dim + h * mc.ple_embed_dim + 3 * w + w * mc.ple_conv_kernel_size
        return (n_attn * (gated_attn + indexer) + (mc.num_hidden_layers - n_attn) * gdn
                + mc.num_hidden_layers * (per_layer - 2 * h + shared + 2 * mixer) + len(mc.ple_layers) * ple
                + embeds + w + 2 * r * w)
    return (n_attn * gated_attn + (mc.num_hidden_layers - n_attn) * gdn
            + mc.num_hidden_layers * (per_layer + shared) + embeds + h)


def kv_cache_bytes(mc: ModelConfig, max_context: int, item: int) -> int:
    """Bytes of the KV cache (attention layers only, for a hybrid) plus the DeltaNet conv and float32 recurrent
    states."""
    per_layer = 2 * mc.num_key_value_heads * max_context * mc.head_dim * item
    if not mc.is_hybrid:
        return mc.num_hidden_layers * per_layer
    assert isinstance(mc, HybridConfig)
    n_lin = len(mc.linear_layers)
    states = n_lin * (mc.conv_dim * (mc.linear_conv_kernel_dim - 1) * item
                      + mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4)
    if mc.is_qwen4:  # indexer keys (raw and compressed), token ids, PLE conv states
        assert isinstance(mc, Qwen4Config)
        per_layer += (max_context + max_context // mc.indexer_compress_ratio + 1) * mc.indexer_head_dim * item
        states += len(mc.ple_layers) * mc.stream_width * (mc.ple_conv_kernel_size - 1) * mc.ngram_size * item
        return len(mc.attention_layers) * per_layer + 2 * states + 8 * max_context
    return len(mc.attention_layers) * per_layer + 2 * states  # states and their prefix-cache snapshot


def fp8_expert_bytes(mc: ModelConfig) -> int:
    """One expert of an FP8 bank: its float8 values and float32 row scales (gate and up: 2I rows, down: H)."""
    return mc.expert_params + 4 * (2 * mc.moe_intermediate_size + mc.hidden_size)


def fp8_staging_bytes(mc: ModelConfig) -> int:
    """Device bytes an FP8 bank adds: one layer's FP8 values (1 byte each) and float32 scales (one per output row),
    where copies land before their dequantization, and the dequantization's float32 temporary (at most
    ``bank.DEQUANT_PIECE`` elements, or one expert's matrix if larger)."""
    e, i, h = mc.num_experts, mc.moe_intermediate_size, mc.hidden_size
    piece = max(2**24, 2 * i * h)  # abbench.engine.models.bank.DEQUANT_PIECE (this module imports no torch)
    return e * (3 * h * i + 4 * (2 * i + h)) + 4 * piece


def fp8_slots(config: EngineConfig, block: tuple[int, int] | None = None, triton: bool | None = None) -> bool:
    """Whether decode's slots hold an FP8 bank's float8 values and row scales (``EngineConfig.slot_dtype``):
    "fp8" asks for it (ValueError where it cannot be: a bank with an FP8 checkpoint's ``block`` scales, decode's
    experts not Triton's, no Triton); "auto" takes it on CUDA for an FP8 bank with per-row scales whose decode
    runs Triton's experts (``decode_experts`` "triton", or "auto" for a family they serve: not Qwen4-Exp), with
    Triton installed (``triton``; None: on CUDA, yes, else look for it). Resident experts have no slots."""
    mc = config.model
    if config.slot_dtype == "model" or config.prefill_mode == "resident" or config.expert_dtype != "fp8":
        return False
    if triton is None:  # (a CUDA build of torch ships Triton)
        triton = config.device.startswith("cuda") or importlib.util.find_spec("triton") is not None
    family = not (isinstance(mc, ModelConfig) and mc.is_qwen4)
    usable = (block is None and config.decode_experts != "grouped" and triton and family
              and (config.decode_experts == "triton" or config.device.startswith("cuda")))
    if config.slot_dtype == "fp8" and not usable:
        raise ValueError("slot_dtype 'fp8' needs an FP8 bank with per-row scales (not an FP8 checkpoint's block "
                         "scales) decoded by Triton's experts (decode_experts 'triton', Triton installed; not "
                         "Qwen4-Exp)")
    return usable


def plan_device_memory(config: EngineConfig, budget_bytes: int, slots_fp8: bool | None = None) -> MemoryPlan:
    """Size the decode slot cache of a resolved ``config`` from ``budget_bytes``; ``expert_slots_per_layer``,
    when set, is taken as given and checked against the budget. ``slots_fp8``: the slots hold FP8 values and row
    scales (None: ``fp8_slots(config)``). Raises ValueError naming every term when the budget cannot hold the
    fixed part plus one token's experts in every layer (or, resident, every expert)."""
    mc = config.model
    assert isinstance(mc, ModelConfig) and config.dtype and config.max_context, "plan needs a resolved config"
    item = ITEMSIZE[config.dtype]
    resident = config.prefill_mode == "resident"
    slots_fp8 = fp8_slots(config) if slots_fp8 is None else slots_fp8
    expert = mc.expert_params * item
    layer_bank = mc.num_experts * expert
    # an FP8 bank multiplied in the grouped GEMM (fp8_dequant 'gemm'): buffers and resident experts hold its values
    # and row scales as they are, and nothing is staged
    in_gemm = config.expert_dtype == "fp8" and config.fp8_dequant in FP8_GEMM_MATH
    device_layer = mc.num_experts * fp8_expert_bytes(mc) if in_gemm else layer_bank
    chunk = min(config.chunk_tokens, config.max_context)
    k, i, h = mc.num_experts_per_tok, mc.moe_intermediate_size, mc.hidden_size
    # one chunk: hidden states, q/k/v/attention output, and the MoE's [T*k, H] rows, [T*k, 2I] and [T*k, I]
    # intermediates as they overlap between consecutive ops; plus the parked layer-major activations of one
    # window and the float32 logits.
    # (Qwen4-Exp: the hyper-connection streams are hc_count x wider; indexed attention below)
    w = mc.stream_width
    chunk_ws = chunk * (8 * w + 4 * mc.num_attention_heads * mc.head_dim + k * (3 * h + 3 * i)) * item
    if mc.is_qwen4:  # indexed attention: the [T, S] mask (bool temporaries, then as a bias in the model
        # dtype, maybe padded), one key/value head's keys and values copied out to its query heads, the
        # float32 block scores [T, Hi, S/c]
        s = config.max_context
        chunk_ws += (chunk * s * (3 + 2 * item)
                     + 2 * (mc.num_attention_heads // mc.num_key_value_heads) * s * mc.head_dim * item
                     + chunk * mc.indexer_n_heads * (s // mc.indexer_compress_ratio) * 4)
    if config.prefill_graphs and config.device.startswith("cuda") and mc.prefill_graph_moe:
        # prefill CUDA graphs (abbench.engine.runtime.steps): their private pool holds one chunk's temporaries beside
        # the eager ones, plus the static input, output and mid-layer buffers
        chunk_ws += chunk_ws + chunk * (3 * w + h + 2 * k) * item
    if config.attention_batch > 1:  # the joint call's queries and output beyond one chunk's
        chunk_ws += 2 * (config.attention_batch - 1) * chunk * mc.num_attention_heads * mc.head_dim * item
    parked = min(config.layer_major_window_tokens, config.max_context) * w * item
    if mc.is_qwen4 and mc.ple_layers:  # layer-major uploads one PLE layer's rows for a window ahead
        parked += min(config.layer_major_window_tokens, config.max_context) * mc.ple_embed_dim * item
    plan = dict(
        budget_bytes=int(budget_bytes), dense_bytes=dense_params(mc) * item,
        kv_bytes=config.max_num_seqs * kv_cache_bytes(mc, config.max_context, item), seqs=config.max_num_seqs,
        prefill_buffer_bytes=2 * device_layer, resident_bytes=mc.num_hidden_layers * device_layer if resident else 0,
        workspace_bytes=chunk_ws + parked + 2 * mc.vocab_size * 4, reserve_bytes=RUNTIME_RESERVE_BYTES,
        slot_bytes=mc.num_hidden_layers * (fp8_expert_bytes(mc) if slots_fp8 else expert), slots_per_layer=0,
        slot_dtype="fp8" if slots_fp8 else config.dtype,
        staging_bytes=fp8_staging_bytes(mc) if config.expert_dtype == "fp8" and not in_gemm else 0)
    fixed = MemoryPlan(**plan).fixed_bytes
    if resident:
        p = MemoryPlan(**plan)
        if fixed > budget_bytes:
            raise ValueError(f"resident experts do not fit the device-memory budget: {p.describe()}")
        return p

    def sized(shared: bool) -> tuple[MemoryPlan, int]:  # the plan, and the slots per layer its budget holds
        p = MemoryPlan(**{**plan, "slots_share_buffers": shared})
        room = int(budget_bytes) - p.fixed_bytes
        fit = max(0, room // p.slot_bytes) if room >= p.pool_bytes(0) else 0
        return MemoryPlan(**{**plan, "slots_share_buffers": shared,
                             "slots_per_layer": config.expert_slots_per_layer or min(mc.num_experts, fit)}), fit

    share = config.slots_share_buffers
    p, fit = sized(share == "on")
    if share == "auto" and fit < k and may_share_buffers(config):
        shared, shared_fit = sized(True)
        if k <= shared.slots_per_layer <= shared_fit:
            return shared
    slots = p.slots_per_layer
    if slots < k or slots > fit:
        need = max(slots, k)
        least, in_buffers = least_budget(config, need, slots_fp8)
        how = " (the slots in the prefill buffers' memory)" if in_buffers else ""
        raise ValueError(
            f"the device-memory budget holds {fit} expert slots per layer but decode needs "
            f"{need} (num_experts_per_tok={k}{'' if slots <= k else ', as requested'}); {p.describe()}. Raise "
            f"--gpu-memory-budget to at least {least / GIB:.2f} GiB{how}, lower "
            "--max-context or --max-num-seqs, or set fewer --expert-slots-per-layer")
    return p


def auto_chunk_tokens(config: EngineConfig, budget_bytes: int, slots_fp8: bool | None = None) -> int:
    """The chunk length ``chunk_tokens`` "auto" takes for a resolved ``config`` under ``budget_bytes``: the first
    of AUTO_CHUNK_TOKENS whose plan fits (holds decode's slots), the last when none does (its plan then refuses
    with the reason)."""
    for chunk in AUTO_CHUNK_TOKENS[:-1]:
        try:
            plan_device_memory(dataclasses.replace(config, chunk_tokens=chunk), budget_bytes, slots_fp8)
        except ValueError:  # too little room beside this chunk's workspace: a smaller one
            continue
        return chunk
    return AUTO_CHUNK_TOKENS[-1]


def may_share_buffers(config: EngineConfig) -> bool:
    """Whether "auto" may put the slots in the prefill buffers' memory (the config refuses "on" elsewhere): one
    sequence at a time, a streamed prefill, no ``d2d_from_slot_cache``."""
    return config.max_num_seqs == 1 and config.prefill_mode != "resident" and not config.d2d_from_slot_cache


def least_budget(config: EngineConfig, slots: int, slots_fp8: bool | None = None) -> tuple[int, bool]:
    """The smallest budget, in bytes, whose plan of a resolved ``config`` holds ``slots`` expert slots per layer
    (resident: 0, every expert on the device), and whether the slots are then in the prefill buffers' memory:
    with "auto", the smaller of the two layouts where the slots may share it (``may_share_buffers``)."""
    apart = plan_device_memory(config, 1 << 62, slots_fp8)
    least = (apart.fixed_bytes + apart.pool_bytes(slots), apart.slots_share_buffers)
    if config.slots_share_buffers == "auto" and may_share_buffers(config):
        shared = plan_device_memory(dataclasses.replace(config, slots_share_buffers="on"), 1 << 62, slots_fp8)
        least = min(least, (shared.fixed_bytes + shared.pool_bytes(slots), True))
    return least
