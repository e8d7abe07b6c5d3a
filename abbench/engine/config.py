"""Configuration of the vendored engine: the model's shape and the engine's knobs.

Contract:
- ``ModelConfig`` is the shape of a Qwen3-MoE decoder (field names as in transformers' ``Qwen3MoeConfig``).
  ``ModelConfig.from_hf_config(path)`` reads a local ``config.json`` and rejects what this all-MoE engine
  cannot run (another model_type, dense-MLP layers, sliding-window attention, scaled RoPE) with a clear
  ``ValueError``.
- ``HybridConfig`` (a ``ModelConfig``) adds the shape of a Qwen3.5/3.6-MoE text decoder (transformers'
  ``Qwen3_5MoeTextConfig``): per-layer ``layer_types`` (Gated DeltaNet "linear_attention" or gated
  "full_attention"), the DeltaNet head shapes, the shared expert and partial RoPE. ``from_hf_config`` reads
  model_type ``qwen3_5_moe`` (its ``text_config``) or ``qwen3_5_moe_text``. ``ModelConfig.is_hybrid`` tells them
  apart. The routed experts (``bank_bytes``) are the same [E, 2I, H] / [E, H, I] bank as for Qwen3-MoE; the
  shared expert is a dense weight.
- ``PRESETS`` names the shapes the harness uses: ``tiny`` (seconds on 2 CPU cores, Qwen3 vocabulary),
  ``qwen3-30b-a3b`` (the real model's shape), ``qwen3-30b-a3b-half`` (its first 24 layers),
  ``qwen3-30b-a3b-2507`` (the same shape with the 262,144-token context and RoPE theta 1e7 of the 2507 release),
  ``qwen3.5-tiny`` (a hybrid in seconds on CPU, Qwen3.5/3.6 vocabulary) and ``qwen3.5-35b-a3b``
  (Qwen3.5/3.6-35B-A3B's text shape).
- ``EngineConfig`` holds the engine's knobs; ``EngineConfig.resolved()`` fills the device-independent
  defaults (dtype, max_context) and validates everything before any tensor exists; for a hybrid model
  ``chunk_tokens`` must be a multiple of ``GDN_BLOCK`` (64), so that the delta rule's internal 64-token blocks
  fall the same way whatever the chunking.
- ``Qwen4Config`` (a ``HybridConfig``) adds Qwen4-Exp's hyper-connections, per-layer n-gram embeddings and
  indexed attention (transformers' ``Qwen4ExpTextConfig``, model_type ``qwen4_exp`` (its ``text_config``) or
  ``qwen4_exp_text``); ``is_qwen4`` tells it apart, ``stream_width`` is the width of the activations between
  layers (hc_count x hidden). Presets ``qwen4-exp-tiny``, ``qwen4-exp`` and ``qwen4-exp-half``.
- The device-memory plan (``plan_device_memory``, sizing the decode slot cache from a budget) is in
  :mod:`abbench.engine.runtime.memory`.
- ``MAX_GROUPED_MM_GROUPS``: CUDA's bf16 ``torch._grouped_mm`` accepts at most 1,023 groups (1,024 fails on
  an H200 with torch 2.11). Every grouped call passes one layer's experts or one layer's slots, so both must
  stay at or under it; ``resolved()`` refuses a model with more experts per layer.

The three shapes are defined in :mod:`abbench.engine.shapes` and importable from here. This module imports no
torch, so the harness can read presets on a machine without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from abbench.engine.shapes import (
    HYBRID_MODEL_TYPES, LAYER_TYPES, QWEN4_MODEL_TYPES, HybridConfig, ModelConfig, Qwen4Config,
)

__all__ = [
    "ATTENTION_BATCH_MAX_CONTEXT", "DECODE_ATTENTION", "DECODE_EXPERTS", "DECODE_MISSES", "DTYPES", "EXPERT_DTYPES", "FP8_DEQUANT", "FP8_GEMM_MATH",
    "SLOT_DTYPES",
    "SLOTS_SHARE_BUFFERS", "CHUNK_AUTO", "AUTO_CHUNK_TOKENS",
    "GDN_BLOCK",
    "HYBRID_MODEL_TYPES", "ITEMSIZE", "LAYER_TYPES", "MAX_ATTENTION_BATCH", "MAX_GROUPED_MM_GROUPS", "PREFILL_MODES", "PREFILL_PATHS", "PRESETS",
    "QWEN4_MODEL_TYPES", "EngineConfig", "HybridConfig", "ModelConfig", "Qwen4Config", "check_hybrid_chunk",
]

PREFILL_PATHS = ("chunked", "layer-major", "demand", "resident")  # what a prefill runs
DECODE_EXPERTS = ("auto", "grouped", "triton")  # decode's routed experts (EngineConfig.decode_experts)
DECODE_ATTENTION = ("auto", "torch", "triton")  # decode's attention (EngineConfig.decode_attention)
PREFILL_KERNELS = ("torch", "triton")  # the prefill attention half's small ops (EngineConfig.prefill_kernels)
DECODE_MISSES = ("auto", "host", "device")  # who copies decode's slot-cache misses (EngineConfig.decode_misses)
PREFILL_MODES = PREFILL_PATHS + ("auto",)  # what a request may ask for: auto picks a path (abbench.engine.runtime.policy)
DTYPES = ("float32", "bfloat16", "float16")
# how the host expert bank stores the routed experts (EngineConfig.expert_dtype): "model" in the compute dtype,
# "fp8" in float8 e4m3 with per-row scales (abbench.engine.models.bank), dequantized on the device
EXPERT_DTYPES = ("model", "fp8")
# what decode's expert slots hold (EngineConfig.slot_dtype): "model" the compute dtype, "fp8" an FP8 bank's float8
# values and row scales (half the bytes: about twice the slots), dequantized by decode's Triton kernels as read;
# "auto": fp8 where the bank is FP8 with row scales and decode's experts are Triton's (abbench.engine.runtime.memory)
SLOT_DTYPES = ("auto", "model", "fp8")
SLOTS_SHARE_BUFFERS = ("auto", "on", "off")
CHUNK_AUTO = "auto"
AUTO_CHUNK_TOKENS = (4096, 2048)
"""``chunk_tokens`` "auto": the first of these whose device-memory plan fits (the engine's start, with a plan: a GPU
or a budget); the last without a plan or when none fits (then the plan's own refusal). On an H100 the hybrid's
4096-token chunks made its resident and layer-major prefills 9-13% faster at 32K-128K and halved layer-major's
distance to its floor at 32K (results/20261206h, 20261206k; "auto" itself in a service: 20261206p); at 256K under
16 GiB they leave no decode slot."""
# where an FP8 bank's streamed layers are dequantized (EngineConfig.fp8_dequant): "compute" on the compute stream
# at the layer's turn, "copy" on the copy stream right after the copy, beside the compute (runtime.experts);
# "gemm": never as a pass, the prefill's grouped GEMM reads the FP8 values and row scales (ops.moe.Fp8Experts);
# "w8a8": likewise, and the activations are quantized per row too, the GEMM multiplying FP8 by FP8
FP8_DEQUANT = ("compute", "copy", "gemm", "w8a8")
# the prefill GEMM's arithmetic (ops.kernels.GROUPED_FP8_MATHS) where it reads an FP8 bank as it is
FP8_GEMM_MATH = {"gemm": "bf16", "w8a8": "fp8"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_GROUPED_MM_GROUPS = 1023
GDN_BLOCK = 64  # the gated delta rule's internal block length (fla's chunk size)


def _hybrid_types(n_layers: int, every: int = 4) -> tuple[str, ...]:
    """Qwen3.5's layout: every ``every``-th layer full attention, the others Gated DeltaNet."""
    return tuple("linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers))


_QWEN3_30B_A3B = ModelConfig(
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, 128 experts top-8 (normalised), hidden 2048, expert FFN 768,
    # 32 query / 4 KV heads of 128, vocabulary 151936, RoPE theta 1e6, RMS eps 1e-6, untied, 40960 positions.
    vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
    eos_token_id=151645, name="qwen3-30b-a3b",
)

# Qwen4-Exp's text shape (transformers' Qwen4ExpTextConfig defaults): 40 layers (30 Gated DeltaNet, every 4th
# indexed attention), hidden 2048, 512 experts top-10 of FFN 512 plus a 512 shared expert, 16 query / 2 KV heads
# of 256 with RoPE on 64 dims, DeltaNet 16/32 heads of 128, 4 hyper-connection streams of rank 320, vocabulary
# 248320, 262144 positions. One bf16 bank: 40 x 512 x 3 x 2048 x 512 x 2 B = 128.8 GB, more than the single-GPU
# machine's 128 GiB of host memory: run it on the two-GPU kind (256 GiB host; one GPU used) or use
# ``qwen4-exp-half``. Not in transformers' defaults, so assumed here (no public config.json was at hand): the
# indexer (16 heads of 128, a 2,048-token budget in blocks of 64) and PLE on layers 1 and 2. The real PLE tables
# (2 x 8 heads x ~20M rows x 128 per PLE layer, ~76 GiB each in bf16) are reduced for random weights to
# ngram_vocab_size_base 524,288: 16 x ~524K x 128 x 2 B = 2.1 GB per PLE layer in host memory. A checkpoint's
# config.json brings its own values.
_QWEN4_EXP = Qwen4Config(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, moe_intermediate_size=512, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
    rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=262144, tie_word_embeddings=False,
    eos_token_id=248044, name="qwen4-exp", layer_types=_hybrid_types(40), linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    shared_expert_intermediate_size=512, partial_rotary_factor=0.25, hc_count=4, hc_lowrank=320,
    ple_layer_ids=(1, 2), ple_embed_dim=2048, ngram_vocab_size_base=524_288, indexer_n_heads=16,
    indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=64,
)

PRESETS: dict[str, ModelConfig] = {
    # Small enough for CI (2 cores), same vocabulary and eos as Qwen3 so real tokenizers apply.
    "tiny": ModelConfig(
        vocab_size=151936, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        eos_token_id=151645, name="tiny",
    ),
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen3-30b-a3b-half": dataclasses.replace(_QWEN3_30B_A3B, num_hidden_layers=24, name="qwen3-30b-a3b-half"),
    # Qwen/Qwen3-30B-A3B-Instruct-2507 config.json: the same shape, 262,144 positions, RoPE theta 1e7.
    "qwen3-30b-a3b-2507": dataclasses.replace(_QWEN3_30B_A3B, max_position_embeddings=262_144,
                                              rope_theta=10_000_000.0, name="qwen3-30b-a3b-2507"),
    # A hybrid for CPU tests and profiles: 3 DeltaNet + 1 gated attention layer, tiny heads and experts, the
    # Qwen3.5/3.6 vocabulary (248,320 rows, the `qwen3.6` tokenizer's ids fit) and eos <|endoftext|>.
    "qwen3.5-tiny": HybridConfig(
        vocab_size=248320, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        eos_token_id=248044, name="qwen3.5-tiny", layer_types=_hybrid_types(4), linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        shared_expert_intermediate_size=64, partial_rotary_factor=0.25,
    ),
    # Qwen/Qwen3.5-35B-A3B (and Qwen3.6-35B-A3B) text_config: 40 layers (30 Gated DeltaNet, every 4th gated full
    # attention), hidden 2048, 256 experts top-8 of FFN 512 plus a 512 shared expert, 16 query / 2 KV heads of
    # 256 with RoPE on 64 dims (theta 1e7), DeltaNet 16 key / 32 value heads of 128, conv 4, vocabulary 248320,
    # 262144 positions, untied. One bf16 bank: 40 x 256 x 3 x 2048 x 512 x 2 = 64.4 GB.
    "qwen3.5-35b-a3b": HybridConfig(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=262144, tie_word_embeddings=False,
        eos_token_id=248044, name="qwen3.5-35b-a3b", layer_types=_hybrid_types(40), linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        shared_expert_intermediate_size=512, partial_rotary_factor=0.25,
    ),
    # Qwen4-Exp for CPU tests and profiles: 3 DeltaNet layers (PLE on the first and third) + 1 indexed attention
    # layer, 4 hyper-connection streams, 512 experts top-10 as in the real model (tiny FFN: a 50 MB float32
    # bank), an indexer budget of 64 tokens in blocks of 16 (prompts past 80 tokens attend sparsely), PLE tables
    # of 16 heads x ~2,000 rows; the Qwen3.5/3.6 vocabulary and eos.
    "qwen4-exp-tiny": Qwen4Config(
        vocab_size=248320, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, moe_intermediate_size=16, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        eos_token_id=248044, name="qwen4-exp-tiny", layer_types=_hybrid_types(4), linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        shared_expert_intermediate_size=64, partial_rotary_factor=0.25, hc_count=4, hc_lowrank=32,
        ple_layer_ids=(1, 3), ple_embed_dim=64, ngram_vocab_size_base=2000, indexer_n_heads=4,
        indexer_head_dim=32, indexer_budget=64, indexer_compress_ratio=16,
    ),
    "qwen4-exp": _QWEN4_EXP,
    # The first 20 layers: a 64.4 GB bf16 bank, for the single-GPU machine's 128 GiB of host memory.
    "qwen4-exp-half": dataclasses.replace(_QWEN4_EXP, num_hidden_layers=20, layer_types=_hybrid_types(20),
                                          name="qwen4-exp-half"),
}


def check_hybrid_chunk(mc: ModelConfig, chunk_tokens: int) -> None:
    """ValueError when ``chunk_tokens`` is off the delta rule's block grid on a hybrid model (the engine's chunk
    length, or one request's)."""
    if mc.is_hybrid and chunk_tokens % GDN_BLOCK:
        raise ValueError(f"chunk_tokens must be a multiple of {GDN_BLOCK} for the hybrid model {mc.name!r} "
                         f"(got {chunk_tokens}): the gated delta rule's {GDN_BLOCK}-token blocks must fall the "
                         "same way in every prefill mode")


# Attention batching (EngineConfig.attention_batch) pays only at short contexts: on the H200 (torch SDPA, flash,
# two adjacent 2048-token chunks in one call vs one call each, Qwen3.5-35B-A3B heads) the attention time was
# 0.88-0.94x below 6K tokens, 0.99-1.00x at 16K-64K and 1.05-1.06x at 128K.
ATTENTION_BATCH_MAX_CONTEXT = 16384
MAX_ATTENTION_BATCH = 8
MAX_NUM_SEQS = 64  # sequences at once: each holds a whole max_context cache
DEFAULT_NUM_SEQS = 4


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance. ``None`` fields get device-dependent defaults in ``resolved()``."""

    # Preset name, path of a local HF dir/config.json, or a ModelConfig. None: the checkpoint's own
    # config.json when ``weights`` is a directory, else the ``tiny`` preset.
    model: str | ModelConfig | None = None
    weights: str = "random:0"  # "random:SEED" or a local HF checkpoint directory (safetensors)
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str | None = None  # float32 on cpu, bfloat16 on cuda
    # the host expert bank's format: "model" (the compute dtype) or "fp8" (float8 e4m3, one float32 scale per
    # output row, quantized at load; copies move about half the bytes and are dequantized on the device)
    expert_dtype: str = "model"
    # decode's expert slots: "model" (the compute dtype), "fp8" (an FP8 bank's float8 values and row scales, read
    # and dequantized by decode's Triton experts: twice the slots in a budget), "auto": fp8 on CUDA where the bank
    # is FP8 with per-row scales and decode's experts are Triton's (runtime.memory.fp8_slots), else model
    slot_dtype: str = "auto"
    # decode's slot cache and the prefill's two layer buffers in one device allocation ("on"): a prefill overwrites
    # slots (the engine forgets them, so decode starts cold after each prefill) and the budget holds the larger of
    # the two instead of both, so a budget that leaves too few slots beside the buffers can still decode; one
    # sequence at a time (max_num_seqs 1), streamed prefill, no d2d_from_slot_cache. "auto": on where the budget
    # holds fewer than num_experts_per_tok slots beside the buffers and those hold (runtime.memory), else off
    slots_share_buffers: str = "auto"
    # an FP8 bank's streamed prefill layers: dequantized on the compute stream at their turn ("compute"), or on the
    # copy stream right after their copy ("copy": its kernels run beside the compute and slowed it on the H200), or
    # in the prefill's grouped GEMM ("gemm": the device keeps the FP8 values and row scales, buffers and resident
    # experts alike, and no pass writes a dequantized layer; other bits than "compute"/"copy", the same in every
    # prefill mode), and "w8a8" the same with the activations quantized per row to FP8 too and
    # the GEMM in FP8 math (other numbers, judged as FP8's are: a numerics verdict)
    fp8_dequant: str = "compute"
    prefill_mode: str = "chunked"  # chunked | layer-major | demand | resident (the default of requests)
    # prefill chunk length, the same in every mode; "auto" (CHUNK_AUTO): the largest of AUTO_CHUNK_TOKENS whose
    # device-memory plan fits, chosen when the engine starts (Engine.config holds the number)
    chunk_tokens: int | str = 2048
    layer_major_window_tokens: int = 65536  # parked-activation budget of one layer-major window, in tokens
    demand_max_tokens: int = 256  # chunks of at most this many tokens load only their routed experts
    # Decode slot cache: this many expert slots for every layer (LRU within the layer; each layer's slots are
    # one block, so a grouped GEMM over them has at most num_experts groups). None: sized from
    # ``gpu_memory_budget_gib`` (plan_device_memory), at most num_experts, at least num_experts_per_tok.
    expert_slots_per_layer: int | None = None
    # Device-memory budget in GiB (2^30 bytes, as cards are sized: a 16 GB card holds 16 GiB) for everything the
    # engine allocates plus RUNTIME_RESERVE_BYTES, so the process fits a card of this size;
    # None: the device's free memory at start (the Engine measures it), or all experts on CPU.
    gpu_memory_budget_gib: float | None = None
    host_memory_check: bool = True  # refuse to build a bank larger than the host's available memory
    decode_graphs: bool = True  # CUDA: replay decode steps as CUDA graphs (ignored on CPU)
    # CUDA with decode graphs: at start, run and capture every decode KV-length bucket's graphs (two throwaway
    # steps per bucket, then a reset), so no request pays a bucket's first eager step and capture
    warm_decode_graphs: bool = True
    # the decode warm-up also captures the other way of handling misses than the engine's (a server whose requests
    # may choose it: --allow-request-overrides sets this); otherwise that way's graphs are captured on first use
    warm_every_misses_way: bool = False
    # at start, one throwaway prefill of two full chunks and a short one in the engine's prefill mode (its layer
    # steps' graphs captured, its kernels compiled and set up), then a reset, so the first request is not slower;
    # None: on CUDA only (on a CPU there is nothing to compile or capture)
    warm_prefill: bool | None = None
    d2d_from_slot_cache: bool = False  # prefill takes experts already in the slot cache device-to-device
    # decode's routed experts: "grouped" (torch._grouped_mm, as prefill) or "triton" (the router's softmax/top-k
    # and a GEMV over the k routed experts, abbench.engine.ops.kernels; Qwen3-MoE and the hybrid, needs
    # Triton); "auto": triton on CUDA where it applies and Triton is installed, else grouped
    decode_experts: str = "auto"
    # decode's attention: "torch" (batched matmuls over the bucket, decode_gqa) or "triton" (split-KV flash
    # decoding up to the position; for Qwen3-MoE also fused norms, rope and cache write; Qwen3-MoE and the
    # hybrid, needs Triton); "auto": triton on CUDA where it applies and Triton is installed, else torch
    decode_attention: str = "auto"
    # prefill's attention half, Qwen3-MoE: "torch" (each norm, the rope, the cache write and the router's softmax
    # and top-k as torch ops: 55 ops a chunk and layer in bf16 on CUDA) or "triton" (the input norm, the q/k norms
    # with the rope and the cache write, the residual add with the next norm, and the router's softmax and top-k:
    # one kernel each, 10 ops in all with the projections and the attention; decode's kernels,
    # abbench.engine.ops.kernels; needs Triton). Every prefill mode runs the same kernels either way, so the modes
    # stay bitwise equal; the two settings differ in the last bits (sums in another order). A bank's copies
    # lengthen the gaps between the kernels beside them (results/20261206e), so fewer kernels leave less to
    # lengthen. The Qwen3.5/3.6 hybrid takes the norms and the router's top-k (its attention and DeltaNet mixers stay
    # torch's); Qwen4-Exp is refused. Default torch: not yet measured on a GPU
    prefill_kernels: str = "torch"
    # offloaded decode, who looks up the slot cache and copies its misses: "host" (per layer the router's choice
    # is read back, the host copies the misses, then the experts run: one host round trip a layer) or "device"
    # (the lookup and the miss copies are kernels of the step, the misses read from the registered host bank
    # over PCIe: the whole step is one graph; needs decode_experts "triton"); "auto": device with Triton's
    # experts, else host
    decode_misses: str = "auto"
    # offloaded decode with the misses on the device, Qwen3-MoE: between each layer's attention and its experts,
    # guess the next layer's experts from the residual stream (its router applied early) and bring the ones
    # its slots lack in on a side stream, beside the compute, so its lookup finds them (decode.Decoder); the
    # bits do not change, the copies include the wrong guesses. Off by default: not yet measured on a GPU
    decode_prefetch: bool = False
    # CUDA, hybrid (Qwen3.5/3.6) models: replay the fixed-shape prefill layer steps of full chunks
    # as CUDA graphs (abbench.engine.runtime.steps); every mode makes the same calls either way
    prefill_graphs: bool = True
    # Prefill modes that stream whole banks (layer-major, chunked): when a completion request arrives at an idle
    # engine, start copying the first layer's bank at once (ExpertStore.prime), so the copy overlaps the request's
    # parsing and tokenization instead of the prefill's first layer
    prime_first_layer: bool = True
    # Layer-major: chunks per attention call in full-attention layers (1: one call per chunk), where the joint
    # call is bit-identical on the device and the group ends at or below attention_batch_max_context tokens
    attention_batch: int = 1
    attention_batch_max_context: int = ATTENTION_BATCH_MAX_CONTEXT
    # Random weights: concentrate the routing as trained routers do (a per-layer Zipf-like router bias of this
    # exponent, abbench.engine.ops.moe.router_skew_bias); 0 = the random router's near-uniform routing
    router_skew: float = 0.0
    # prefill_mode "auto": demand for prompts of at most this many uncached tokens, else the best streamed path,
    # instead of the cost model (abbench.engine.runtime.policy); None: the cost model decides
    auto_demand_max_tokens: int | None = None
    # prefill_mode "auto": scale demand's expected expert copies by the median copied/expected ratio of the last
    # this many demand prefills (abbench.engine.runtime.policy.Calibration); 0: the model alone
    auto_calibration: int = 16
    max_context: int | None = None  # KV cache length; default max_position_embeddings
    # sequences the engine runs at once (continuous batching, abbench.engine.runtime.scheduler): one cache of
    # max_context positions each, all planned in device memory; 1 serves one request at a time. None: 4, or 1
    # under gpu_memory_budget_gib (a budget is planned for one sequence unless more are asked for)
    max_num_seqs: int | None = None
    # one prefill batch's uncached prompt tokens (a longer first prompt runs alone): how long decoding sequences
    # may wait behind a prefill, and how many queued layer-major prompts share one bank stream
    max_prefill_batch_tokens: int = 131072
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) (the kernels used already are)
    bandwidth_probe_bytes: int = 256 * 2**20  # H2D bytes timed at start (bounded to ~0.25 s); 0 skips it

    def __post_init__(self) -> None:
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {self.prefill_mode!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert_dtype must be one of {EXPERT_DTYPES}, got {self.expert_dtype!r}")
        if self.fp8_dequant not in FP8_DEQUANT:
            raise ValueError(f"fp8_dequant must be one of {FP8_DEQUANT}, got {self.fp8_dequant!r}")
        if self.fp8_dequant in FP8_GEMM_MATH and self.expert_dtype != "fp8":
            raise ValueError(f"fp8_dequant {self.fp8_dequant!r} multiplies an FP8 bank's values in the grouped GEMM: "
                             "it needs expert_dtype 'fp8'")
        if self.slot_dtype not in SLOT_DTYPES:
            raise ValueError(f"slot_dtype must be one of {SLOT_DTYPES}, got {self.slot_dtype!r}")
        if self.slots_share_buffers not in SLOTS_SHARE_BUFFERS:
            raise ValueError(f"slots_share_buffers must be one of {SLOTS_SHARE_BUFFERS}, got {self.slots_share_buffers!r}")
        if self.slot_dtype == "fp8" and self.expert_dtype != "fp8":
            raise ValueError("slot_dtype 'fp8' keeps an FP8 bank's values in the slots: it needs expert_dtype 'fp8'")
        dev = self.device
        if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {dev!r}")
        if not self.router_skew >= 0:
            raise ValueError(f"router_skew must be >= 0, got {self.router_skew}")
        if self.router_skew > 0 and not self.weights.startswith("random:"):
            raise ValueError("router_skew applies to random weights only (a checkpoint's router is its own)")
        if self.auto_demand_max_tokens is not None and self.auto_demand_max_tokens < 0:
            raise ValueError(f"auto_demand_max_tokens must be >= 0, got {self.auto_demand_max_tokens}")
        if self.max_num_seqs is not None and not 1 <= self.max_num_seqs <= MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs must be in [1, {MAX_NUM_SEQS}], got {self.max_num_seqs}")
        if self.max_prefill_batch_tokens < 1:
            raise ValueError(f"max_prefill_batch_tokens must be >= 1, got {self.max_prefill_batch_tokens}")
        if self.decode_experts not in DECODE_EXPERTS:
            raise ValueError(f"decode_experts must be one of {DECODE_EXPERTS}, got {self.decode_experts!r}")
        if self.decode_misses not in DECODE_MISSES:
            raise ValueError(f"decode_misses must be one of {DECODE_MISSES}, got {self.decode_misses!r}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {self.decode_attention!r}")
        if self.prefill_kernels not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernels must be one of {PREFILL_KERNELS}, got {self.prefill_kernels!r}")
        if int(self.auto_calibration) < 0:
            raise ValueError(f"auto_calibration must be >= 0, got {self.auto_calibration}")
        if not 1 <= int(self.attention_batch) <= MAX_ATTENTION_BATCH:
            raise ValueError(f"attention_batch must be in [1, {MAX_ATTENTION_BATCH}], got {self.attention_batch}")
        if isinstance(self.chunk_tokens, str) and self.chunk_tokens != CHUNK_AUTO:
            raise ValueError(f"chunk_tokens must be a positive number of tokens or {CHUNK_AUTO!r}, got "
                             f"{self.chunk_tokens!r}")
        for name in ("chunk_tokens", "layer_major_window_tokens", "demand_max_tokens", "attention_batch_max_context"):
            if getattr(self, name) != CHUNK_AUTO and int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.expert_slots_per_layer is not None and self.expert_slots_per_layer <= 0:
            raise ValueError(f"expert_slots_per_layer must be positive, got {self.expert_slots_per_layer}")
        if self.gpu_memory_budget_gib is not None and not self.gpu_memory_budget_gib > 0:
            raise ValueError(f"gpu_memory_budget_gib must be positive, got {self.gpu_memory_budget_gib}")
        if self.max_context is not None and self.max_context <= 1:
            raise ValueError(f"max_context must be > 1, got {self.max_context}")
        if not (self.weights.startswith("random:") or Path(self.weights).is_dir()):
            raise ValueError(f"weights must be 'random:SEED' or a local checkpoint directory, got {self.weights!r}")
        if self.weights.startswith("random:"):
            try:
                int(self.weights.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"weights 'random:SEED' needs an integer seed, got {self.weights!r}") from None

    def model_config(self) -> ModelConfig:
        """The ModelConfig named by ``model`` (see the field's comment)."""
        if isinstance(self.model, ModelConfig):
            return self.model
        if self.model is None:
            if self.weights.startswith("random:"):
                return PRESETS["tiny"]
            return ModelConfig.from_hf_config(self.weights)
        if self.model in PRESETS:
            return PRESETS[self.model]
        if Path(self.model).exists():
            return ModelConfig.from_hf_config(self.model)
        raise ValueError(f"model {self.model!r} is neither a preset ({', '.join(PRESETS)}) nor a local path")

    def resolved(self) -> EngineConfig:
        """A copy with every default filled in and the combination validated against the model."""
        mc = self.model_config()
        dtype = self.dtype or ("float32" if self.device == "cpu" else "bfloat16")
        max_context = self.max_context or mc.max_position_embeddings
        if max_context > mc.max_position_embeddings:
            raise ValueError(f"max_context {max_context} > the model's max_position_embeddings "
                             f"{mc.max_position_embeddings}")
        if mc.num_experts > MAX_GROUPED_MM_GROUPS:
            raise ValueError(f"num_experts {mc.num_experts} per layer > {MAX_GROUPED_MM_GROUPS}: CUDA's grouped GEMM "
                             "takes at most that many groups and every expert call passes one layer's experts")
        slots = self.expert_slots_per_layer
        if slots is not None:
            if slots > mc.num_experts:
                raise ValueError(f"expert_slots_per_layer ({slots}) > num_experts ({mc.num_experts}): a layer "
                                 "never needs more slots than it has experts")
            if slots < mc.num_experts_per_tok:
                raise ValueError(f"expert_slots_per_layer ({slots}) must hold at least one token's experts "
                                 f"(num_experts_per_tok={mc.num_experts_per_tok})")
        if self.chunk_tokens != CHUNK_AUTO:  # "auto" chooses among multiples of the delta rule's block
            check_hybrid_chunk(mc, int(self.chunk_tokens))
        seqs = self.max_num_seqs or (1 if self.gpu_memory_budget_gib is not None else DEFAULT_NUM_SEQS)
        if self.slots_share_buffers == "on":
            if seqs != 1:
                raise ValueError(f"slots_share_buffers 'on' needs max_num_seqs 1, got {seqs}: another sequence's "
                                 "decode would write the slots while a prefill's buffers hold a layer")
            if self.prefill_mode == "resident":
                raise ValueError("slots_share_buffers 'on' needs a streamed prefill mode: resident experts have no "
                                 "slots and no buffers")
            if self.d2d_from_slot_cache:
                raise ValueError("slots_share_buffers 'on' and d2d_from_slot_cache: a copy from a slot into a "
                                 "buffer would write over slots")
        return dataclasses.replace(self, model=mc, dtype=dtype, max_context=max_context, max_num_seqs=seqs)
