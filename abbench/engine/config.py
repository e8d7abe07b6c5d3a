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
  :mod:`abbench.engine.memory`.
- ``MAX_GROUPED_MM_GROUPS``: CUDA's bf16 ``torch._grouped_mm`` accepts at most 1,023 groups (1,024 fails on
  an H200 with torch 2.11). Every grouped call passes one layer's experts or one layer's slots, so both must
  stay at or under it; ``resolved()`` refuses a model with more experts per layer.

This module imports no torch, so the harness can read presets on a machine without it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

PREFILL_PATHS = ("chunked", "layer-major", "demand", "resident")  # what a prefill runs
PREFILL_MODES = PREFILL_PATHS + ("auto",)  # what a request may ask for: auto picks a path (abbench.engine.policy)
DTYPES = ("float32", "bfloat16", "float16")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_GROUPED_MM_GROUPS = 1023
GDN_BLOCK = 64  # the gated delta rule's internal block length (fla's chunk size)
LAYER_TYPES = ("linear_attention", "full_attention")
HYBRID_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
QWEN4_MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen3-MoE decoder where every layer is a sparse MoE layer."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    eos_token_id: int | tuple[int, ...] | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                    "num_experts_per_tok", "max_position_embeddings")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) > num_experts ({self.num_experts})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (a ``HybridConfig``)."""
        return False

    @property
    def is_qwen4(self) -> bool:
        """Whether this is a Qwen4-Exp text decoder (a ``Qwen4Config``)."""
        return False

    @property
    def stream_width(self) -> int:
        """Width of the activations carried between layers (hc_count x hidden for Qwen4-Exp's residual streams)."""
        return self.hidden_size

    @property
    def eos_ids(self) -> frozenset[int]:
        """The stop token ids (empty when the config names none)."""
        if self.eos_token_id is None:
            return frozenset()
        if isinstance(self.eos_token_id, int):
            return frozenset({self.eos_token_id})
        return frozenset(self.eos_token_id)

    @property
    def expert_params(self) -> int:
        """Parameters of one expert: gate, up [I, H] and down [H, I]."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def bank_bytes(self, itemsize: int) -> int:
        """Bytes of all layers' experts at ``itemsize`` bytes per element (one full pass over the bank)."""
        return self.num_hidden_layers * self.num_experts * self.expert_params * itemsize

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelConfig:
        """Read a local HF ``config.json`` (a file or the directory holding it) of a ``qwen3_moe`` model."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ValueError(f"no config.json at {p}")
        raw = json.loads(p.read_text())
        config = cls.from_hf_dict(raw, source=str(p))
        if not raw.get("_name_or_path"):  # name it after its directory (e.g. "Qwen3-30B-A3B")
            config = dataclasses.replace(config, name=p.parent.resolve().name or str(p.parent))
        return config

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type in HYBRID_MODEL_TYPES:
            return HybridConfig.from_hf_text_dict(raw, source)
        if model_type in QWEN4_MODEL_TYPES:
            return Qwen4Config.from_hf_qwen4_dict(raw, source)
        if model_type != "qwen3_moe":
            raise ValueError(f"{source}: model_type is {model_type!r}; this engine runs 'qwen3_moe' "
                             "(Qwen3MoeForCausalLM), 'qwen3_5_moe' / 'qwen3_5_moe_text' and 'qwen4_exp' / "
                             "'qwen4_exp_text' checkpoints")
        n_layers = int(raw["num_hidden_layers"])
        n_experts = raw.get("num_experts", raw.get("num_local_experts"))  # transformers 5 writes the latter
        if not n_experts:
            raise ValueError(f"{source}: num_experts is {n_experts!r}; a model without experts is dense")
        mlp_only = list(raw.get("mlp_only_layers") or [])
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense = sorted({i for i in range(n_layers) if i in mlp_only or (i + 1) % step != 0})
        if dense:
            raise ValueError(f"{source}: layers {dense} are dense MLP layers (mlp_only_layers={mlp_only}, "
                             f"decoder_sparse_step={step}); this engine supports only all-MoE models")
        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported (full attention only)")
        if raw.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias=true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
        rope = raw.get("rope_parameters") or {}  # transformers 5
        scaling = raw.get("rope_scaling") or {}  # transformers 4 / hub files
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (default RoPE only)")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            num_experts=int(n_experts),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),  # transformers' default
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            name=str(raw.get("_name_or_path") or source),
        )


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """Shape of a Qwen3.5/3.6-MoE text decoder: Gated DeltaNet and gated full-attention layers, every layer a
    sparse MoE (softmax top-k, always renormalised) plus a gated shared expert. Field names as in
    transformers' ``Qwen3_5MoeTextConfig``; ``head_dim`` etc. describe the full-attention layers."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    shared_expert_intermediate_size: int = 512
    partial_rotary_factor: float = 0.25

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types {bad} are not supported (known: {LAYER_TYPES})")
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "shared_expert_intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"HybridConfig.{name} must be positive, got {getattr(self, name)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} "
                             f"= {self.rotary_dim} rotary dims; must be positive and even")
        if not self.norm_topk_prob:
            raise ValueError("Qwen3.5-MoE always renormalises the top-k router weights (norm_topk_prob=True)")

    @property
    def is_hybrid(self) -> bool:
        return True

    @property
    def rotary_dim(self) -> int:
        """The rotated leading part of each attention head (the rest passes through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: q and k (key heads) then v (value heads)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @classmethod
    def from_hf_text_dict(cls, raw: dict, source: str = "config") -> HybridConfig:
        """A ``qwen3_5_moe`` (multimodal: its ``text_config``) or ``qwen3_5_moe_text`` config dict."""
        top = raw
        if raw.get("model_type") == "qwen3_5_moe":
            if not isinstance(raw.get("text_config"), dict):
                raise ValueError(f"{source}: model_type 'qwen3_5_moe' without a text_config")
            raw = raw["text_config"]
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
        if raw.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias=true is not supported")
        if raw.get("attn_output_gate", True) is False:
            raise ValueError(f"{source}: attn_output_gate=false is not supported (gated attention only)")
        n_layers = int(raw.get("num_hidden_layers", 40))
        types = raw.get("layer_types")
        if not types:
            every = int(raw.get("full_attention_interval", 4))
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "mrope"):  # text-only positions make M-RoPE plain RoPE
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (default RoPE only)")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
        eos = raw.get("eos_token_id", top.get("eos_token_id"))
        heads = int(raw.get("num_attention_heads", 16))
        return cls(
            vocab_size=int(raw.get("vocab_size", 248320)),
            hidden_size=int(raw.get("hidden_size", 2048)),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", 2)),
            head_dim=int(raw.get("head_dim") or 256),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 512)),
            num_experts=int(raw.get("num_experts", raw.get("num_local_experts", 256))),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 8)),
            norm_topk_prob=True,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", top.get("tie_word_embeddings", False))),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            name=str(top.get("_name_or_path") or source),
            layer_types=tuple(types),
            linear_num_key_heads=int(raw.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(raw.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(raw.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(raw.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim", 4)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 512)),
            partial_rotary_factor=float(partial),
        )


@dataclass(frozen=True)
class Qwen4Config(HybridConfig):
    """Shape of a Qwen4-Exp text decoder (transformers' ``Qwen4ExpTextConfig``, field names as there): the
    Qwen3.5 hybrid plus ``hc_count`` hyper-connection residual streams with rank-``hc_lowrank`` mixers,
    per-layer n-gram embeddings (PLE) on the one-indexed ``ple_layer_ids`` (linear layers only) and indexed
    (QSA) attention on every attention layer. transformers calls those layers "indexed_attention"; here
    they keep the type "full_attention" (so ``attention_layers`` lists them) and every one of them is
    indexed. ``ngram_vocab_size_base`` sets the PLE table size: 2 x ``heads_per_ngram`` hashed heads of
    about that many rows of ``ple_embed_dim / (2 x heads_per_ngram)`` each per PLE layer (20M in the real
    model: ~76 GiB per PLE layer in bf16; presets for random weights use a smaller base)."""

    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int = 0  # 0: hidden_size
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    indexer_n_heads: int = 16
    indexer_head_dim: int = 128
    indexer_budget: int = 2048
    indexer_compress_ratio: int = 64
    output_gate_type: str = "silu"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "ple_layer_ids", tuple(sorted(set(self.ple_layer_ids))))
        if not self.ple_embed_dim:
            object.__setattr__(self, "ple_embed_dim", self.hidden_size)
        if self.hc_count <= 1:
            raise ValueError(f"Qwen4-Exp needs hc_count > 1, got {self.hc_count}")
        for name in ("hc_lowrank", "ple_conv_kernel_size", "ngram_size", "heads_per_ngram", "ngram_vocab_size_base",
                     "make_ngram_vocab_size_divisible_by", "indexer_n_heads", "indexer_head_dim", "indexer_budget",
                     "indexer_compress_ratio"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Qwen4Config.{name} must be positive, got {getattr(self, name)}")
        if self.output_gate_type not in ("silu", "sigmoid"):
            raise ValueError(f"output_gate_type {self.output_gate_type!r} is not supported (silu, sigmoid)")
        if self.indexer_budget % self.indexer_compress_ratio:
            raise ValueError(f"indexer_budget ({self.indexer_budget}) must be a multiple of indexer_compress_ratio "
                             f"({self.indexer_compress_ratio})")
        if self.rotary_dim > self.indexer_head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} > indexer_head_dim {self.indexer_head_dim}")
        bad = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_hidden_layers
               or self.layer_types[i - 1] != "linear_attention"]
        if bad:
            raise ValueError(f"ple_layer_ids {bad}: PLE layers are one-indexed linear_attention layers")
        if self.ple_layer_ids:
            if self.ngram_size < 2 or self.ple_embed_dim % self.ngram_heads:
                raise ValueError(f"ple_embed_dim {self.ple_embed_dim} must be a multiple of the "
                                 f"{self.ngram_heads} n-gram heads (ngram_size {self.ngram_size} >= 2)")
            if not self.eos_ids:
                raise ValueError("Qwen4-Exp PLE needs eos_token_id (the n-grams reset at EOS)")

    @property
    def is_qwen4(self) -> bool:
        return True

    @property
    def stream_width(self) -> int:
        return self.hc_count * self.hidden_size

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """Zero-indexed PLE layers."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_eos(self) -> int:
        """The EOS id the n-grams reset at (the first one when the config lists several, as transformers)."""
        eos = self.eos_token_id
        return int(eos[0] if isinstance(eos, tuple) else eos)

    @property
    def block_topk(self) -> int:
        """Compressed blocks each query selects (besides its unfinished tail)."""
        return self.indexer_budget // self.indexer_compress_ratio

    @classmethod
    def from_hf_qwen4_dict(cls, raw: dict, source: str = "config") -> Qwen4Config:
        """A ``qwen4_exp`` (multimodal: its ``text_config``) or ``qwen4_exp_text`` config dict."""
        top = raw
        if raw.get("model_type") == "qwen4_exp":
            if not isinstance(raw.get("text_config"), dict):
                raise ValueError(f"{source}: model_type 'qwen4_exp' without a text_config")
            raw = raw["text_config"]
        n_layers = int(raw.get("num_hidden_layers", 40))
        types = raw.get("layer_types")
        if not types:
            every = int(raw.get("full_attention_interval", 4))
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
        # transformers 5.24 names these layers "indexed_attention", 5.17 "qwen_sparse_attention"
        types = ["full_attention" if t in ("indexed_attention", "qwen_sparse_attention") else t for t in types]
        if raw.get("indexer_n_heads") is None:
            raise ValueError(f"{source}: no indexer_n_heads; this engine runs Qwen4-Exp with indexed attention only")
        if int(raw.get("indexer_kv_heads") or 1) != 1:
            raise ValueError(f"{source}: indexer_kv_heads must be 1")
        base = HybridConfig.from_hf_text_dict({**raw, "model_type": "qwen3_5_moe_text", "layer_types": types,
                                               "num_experts": raw.get("num_experts", 512),
                                               "num_experts_per_tok": raw.get("num_experts_per_tok", 10)}, source)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(HybridConfig)}
        fields["name"] = str(top.get("_name_or_path") or source)
        if base.eos_token_id is None and top.get("eos_token_id") is not None:
            eos = top["eos_token_id"]
            fields["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos
        return cls(
            **fields,
            hc_count=int(raw.get("hc_count", 4)), hc_lowrank=int(raw.get("hc_lowrank", 320)),
            ple_layer_ids=tuple(raw.get("ple_layer_ids") or ()), ple_embed_dim=int(raw.get("ple_embed_dim") or 0),
            ple_conv_kernel_size=int(raw.get("ple_conv_kernel_size", 4)), ngram_size=int(raw.get("ngram_size", 3)),
            heads_per_ngram=int(raw.get("heads_per_ngram", 8)),
            ngram_vocab_size_base=int(raw.get("ngram_vocab_size_base", 20_000_000)),
            make_ngram_vocab_size_divisible_by=int(raw.get("make_ngram_vocab_size_divisible_by", 128)),
            seed=int(raw.get("seed", 1234)), indexer_n_heads=int(raw["indexer_n_heads"]),
            indexer_head_dim=int(raw["indexer_head_dim"]), indexer_budget=int(raw["indexer_budget"]),
            indexer_compress_ratio=int(raw["indexer_compress_ratio"]),
            output_gate_type=str(raw.get("output_gate_type") or raw.get("hidden_act", "silu")),
        )


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


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance. ``None`` fields get device-dependent defaults in ``resolved()``."""

    # Preset name, path of a local HF dir/config.json, or a ModelConfig. None: the checkpoint's own
    # config.json when ``weights`` is a directory, else the ``tiny`` preset.
    model: str | ModelConfig | None = None
    weights: str = "random:0"  # "random:SEED" or a local HF checkpoint directory (safetensors)
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str | None = None  # float32 on cpu, bfloat16 on cuda
    prefill_mode: str = "chunked"  # chunked | layer-major | demand | resident (the default of requests)
    chunk_tokens: int = 2048  # prefill chunk length, the same in every mode
    layer_major_window_tokens: int = 65536  # parked-activation budget of one layer-major window, in tokens
    demand_max_tokens: int = 256  # chunks of at most this many tokens load only their routed experts
    # Decode slot cache: this many expert slots for every layer (LRU within the layer; each layer's slots are
    # one block, so a grouped GEMM over them has at most num_experts groups). None: sized from
    # ``gpu_memory_budget_gb`` (plan_device_memory), at most num_experts, at least num_experts_per_tok.
    expert_slots_per_layer: int | None = None
    # Device-memory budget in GB (1e9 bytes) for everything the engine allocates plus RUNTIME_RESERVE_BYTES;
    # None: the device's free memory at start (the Engine measures it), or all experts on CPU.
    gpu_memory_budget_gb: float | None = None
    host_memory_check: bool = True  # refuse to build a bank larger than the host's available memory
    decode_graphs: bool = True  # CUDA: replay decode steps as CUDA graphs (ignored on CPU)
    # CUDA with decode graphs: at start, run and capture every decode KV-length bucket's graphs (two throwaway
    # steps per bucket, then a reset), so no request pays a bucket's first eager step and capture
    warm_decode_graphs: bool = True
    d2d_from_slot_cache: bool = False  # prefill takes experts already in the slot cache device-to-device
    # CUDA, hybrid (Qwen3.5/3.6) models: replay the fixed-shape prefill layer steps of full chunks as CUDA
    # graphs (abbench.engine.steps); every mode makes the same calls either way
    prefill_graphs: bool = True
    # Layer-major: chunks per attention call in full-attention layers (1: one call per chunk), where the joint
    # call is bit-identical on the device and the group ends at or below attention_batch_max_context tokens
    attention_batch: int = 1
    attention_batch_max_context: int = ATTENTION_BATCH_MAX_CONTEXT
    # Random weights: concentrate the routing as trained routers do (a per-layer Zipf-like router bias of this
    # exponent, abbench.engine.model.router_skew_bias); 0 = the random router's near-uniform routing
    router_skew: float = 0.0
    # prefill_mode "auto": demand for prompts of at most this many uncached tokens, else the best streamed path,
    # instead of the cost model (abbench.engine.policy); None: the cost model decides
    auto_demand_max_tokens: int | None = None
    max_context: int | None = None  # KV cache length; default max_position_embeddings
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) (the kernels used already are)
    bandwidth_probe_bytes: int = 256 * 2**20  # H2D bytes timed at start (bounded to ~0.25 s); 0 skips it

    def __post_init__(self) -> None:
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {self.prefill_mode!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        dev = self.device
        if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {dev!r}")
        if not self.router_skew >= 0:
            raise ValueError(f"router_skew must be >= 0, got {self.router_skew}")
        if self.router_skew > 0 and not self.weights.startswith("random:"):
            raise ValueError("router_skew applies to random weights only (a checkpoint's router is its own)")
        if self.auto_demand_max_tokens is not None and self.auto_demand_max_tokens < 0:
            raise ValueError(f"auto_demand_max_tokens must be >= 0, got {self.auto_demand_max_tokens}")
        if not 1 <= int(self.attention_batch) <= MAX_ATTENTION_BATCH:
            raise ValueError(f"attention_batch must be in [1, {MAX_ATTENTION_BATCH}], got {self.attention_batch}")
        for name in ("chunk_tokens", "layer_major_window_tokens", "demand_max_tokens", "attention_batch_max_context"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.expert_slots_per_layer is not None and self.expert_slots_per_layer <= 0:
            raise ValueError(f"expert_slots_per_layer must be positive, got {self.expert_slots_per_layer}")
        if self.gpu_memory_budget_gb is not None and not self.gpu_memory_budget_gb > 0:
            raise ValueError(f"gpu_memory_budget_gb must be positive, got {self.gpu_memory_budget_gb}")
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
        check_hybrid_chunk(mc, self.chunk_tokens)
        return dataclasses.replace(self, model=mc, dtype=dtype, max_context=max_context)
