"""The model shapes the vendored engine runs (no torch): ``ModelConfig`` (a Qwen3-MoE decoder), ``HybridConfig``
(a Qwen3.5/3.6-MoE Gated DeltaNet hybrid) and ``Qwen4Config`` (Qwen4-Exp), each with ``from_hf_config``.
Their contracts are described in :mod:`abbench.engine.config`, which re-exports every name here beside the
presets and the engine's knobs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

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

    def first_layers(self, n: int, name: str | None = None) -> ModelConfig:
        """The same shape cut to its first ``n`` layers (at most all of them), for checks that run part of a
        model at full width: a hybrid's layer kinds and Qwen4-Exp's (one-indexed) PLE layers are cut with it."""
        n = min(n, self.num_hidden_layers)
        cut: dict = {"num_hidden_layers": n, "name": name or f"{self.name}[:{n}]"}
        if self.is_hybrid:
            cut["layer_types"] = self.layer_types[:n]
        if self.is_qwen4:
            cut["ple_layer_ids"] = tuple(i for i in self.ple_layer_ids if i <= n)
        return dataclasses.replace(self, **cut)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (a ``HybridConfig``)."""
        return False

    @property
    def is_qwen4(self) -> bool:
        """Whether this is a Qwen4-Exp text decoder (a ``Qwen4Config``)."""
        return False

    @property
    def prefill_graph_moe(self) -> bool:
        """Whether prefill replays every full chunk's MoE half from CUDA graphs (``runtime.steps``): the Qwen3.5/3.6
        hybrids. Not Qwen4-Exp (its steps read per-chunk uploads). Not Qwen3-MoE: on the H200 its graphed MoE halves
        left a 16 GiB service's prefill where it was and cost a decode slot a layer (results/20261205k). The model
        and the memory plan both read it."""
        return self.is_hybrid and not self.is_qwen4

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
