"""Configuration of the vendored engine: the model's shape and the engine's knobs.

Contract:
- ``ModelConfig`` is the shape of a Qwen3-MoE decoder (field names as in transformers' ``Qwen3MoeConfig``).
  ``ModelConfig.from_hf_config(path)`` reads a local ``config.json`` and rejects what this all-MoE engine
  cannot run (another model_type, dense-MLP layers, sliding-window attention, scaled RoPE) with a clear
  ``ValueError``.
- ``PRESETS`` names the shapes the harness uses: ``tiny`` (seconds on 2 CPU cores, Qwen3 vocabulary),
  ``qwen3-30b-a3b`` (the real model's shape), ``qwen3-30b-a3b-half`` (its first 24 layers) and
  ``qwen3-30b-a3b-2507`` (the same shape with the 262,144-token context and RoPE theta 1e7 of the 2507 release).
- ``EngineConfig`` holds the engine's knobs; ``EngineConfig.resolved()`` fills the device-independent
  defaults (dtype, max_context) and validates everything before any tensor exists.
- ``plan_device_memory`` sizes the decode slot cache from a device-memory budget: it adds up what the engine
  keeps on the device (dense weights, KV cache, the prefill double buffer, a workspace bound for one chunk
  and the parked layer-major activations, resident experts) and gives the rest to expert slots, the same
  number for every layer. A budget that cannot hold one token's experts in every layer is refused with
  every term named.
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

PREFILL_MODES = ("chunked", "layer-major", "demand", "resident")
DTYPES = ("float32", "bfloat16", "float16")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_GROUPED_MM_GROUPS = 1023
GIB = 2**30
# What the budget sets aside beyond the engine's own tensors: the CUDA context, cuBLAS/CUTLASS workspaces,
# decode graphs and allocator slack (the context alone is ~0.5 GiB on an H200 with torch 2.11).
RUNTIME_RESERVE_BYTES = GIB


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
        if model_type != "qwen3_moe":
            raise ValueError(f"{source}: model_type is {model_type!r}; this engine runs only 'qwen3_moe' "
                             "(Qwen3MoeForCausalLM) checkpoints")
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


_QWEN3_30B_A3B = ModelConfig(
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, 128 experts top-8 (normalised), hidden 2048, expert FFN 768,
    # 32 query / 4 KV heads of 128, vocabulary 151936, RoPE theta 1e6, RMS eps 1e-6, untied, 40960 positions.
    vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
    eos_token_id=151645, name="qwen3-30b-a3b",
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
}


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
    d2d_from_slot_cache: bool = False  # prefill takes experts already in the slot cache device-to-device
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
        for name in ("chunk_tokens", "layer_major_window_tokens", "demand_max_tokens"):
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
        return dataclasses.replace(self, model=mc, dtype=dtype, max_context=max_context)


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine keeps on the compute device, in bytes, and the slots per layer that fit the budget."""

    budget_bytes: int
    dense_bytes: int  # embeddings, lm_head, attention and router weights, norms
    kv_bytes: int  # the KV cache for max_context positions
    prefill_buffer_bytes: int  # the double buffer of two layer banks (0 when resident)
    resident_bytes: int  # every expert on the device (resident mode only)
    workspace_bytes: int  # one chunk's activations and MoE intermediates, parked layer-major activations
    reserve_bytes: int  # RUNTIME_RESERVE_BYTES
    slot_bytes: int  # one expert slot in every layer (num_hidden_layers x one expert)
    slots_per_layer: int  # 0 when resident

    @property
    def fixed_bytes(self) -> int:
        return (self.dense_bytes + self.kv_bytes + self.prefill_buffer_bytes + self.resident_bytes
                + self.workspace_bytes + self.reserve_bytes)

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.slots_per_layer * self.slot_bytes

    def describe(self) -> str:
        gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
        return (f"budget {gb(self.budget_bytes)}: dense {gb(self.dense_bytes)} + KV {gb(self.kv_bytes)} + prefill "
                f"buffers {gb(self.prefill_buffer_bytes)} + resident experts {gb(self.resident_bytes)} + "
                f"workspace {gb(self.workspace_bytes)} + runtime reserve {gb(self.reserve_bytes)} = "
                f"{gb(self.fixed_bytes)} fixed; {self.slots_per_layer} expert slots per layer x "
                f"{gb(self.slot_bytes)} = {gb(self.slots_per_layer * self.slot_bytes)}")


def dense_params(mc: ModelConfig) -> int:
    """Parameters of everything but the routed experts."""
    h, d = mc.hidden_size, mc.head_dim
    attn = h * d * (2 * mc.num_attention_heads + 2 * mc.num_key_value_heads) + 2 * d  # q, o, k, v, q/k norms
    per_layer = attn + mc.num_experts * h + 2 * h  # + router + the two norms
    embeds = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    return mc.num_hidden_layers * per_layer + embeds + h


def plan_device_memory(config: EngineConfig, budget_bytes: int) -> MemoryPlan:
    """Size the decode slot cache of a resolved ``config`` from ``budget_bytes``; ``expert_slots_per_layer``,
    when set, is taken as given and checked against the budget. Raises ValueError naming every term when the
    budget cannot hold the fixed part plus one token's experts in every layer (or, resident, every expert)."""
    mc = config.model
    assert isinstance(mc, ModelConfig) and config.dtype and config.max_context, "plan needs a resolved config"
    item = ITEMSIZE[config.dtype]
    resident = config.prefill_mode == "resident"
    expert = mc.expert_params * item
    layer_bank = mc.num_experts * expert
    chunk = min(config.chunk_tokens, config.max_context)
    k, i, h = mc.num_experts_per_tok, mc.moe_intermediate_size, mc.hidden_size
    # one chunk: hidden states, q/k/v/attention output, and the MoE's [T*k, H] rows, [T*k, 2I] and [T*k, I]
    # intermediates as they overlap between consecutive ops; plus the parked layer-major activations of one
    # window and the float32 logits.
    chunk_ws = chunk * (8 * h + 4 * mc.num_attention_heads * mc.head_dim + k * (3 * h + 3 * i)) * item
    parked = min(config.layer_major_window_tokens, config.max_context) * h * item
    plan = dict(
        budget_bytes=int(budget_bytes), dense_bytes=dense_params(mc) * item,
        kv_bytes=2 * mc.num_hidden_layers * mc.num_key_value_heads * config.max_context * mc.head_dim * item,
        prefill_buffer_bytes=2 * layer_bank, resident_bytes=mc.num_hidden_layers * layer_bank if resident else 0,
        workspace_bytes=chunk_ws + parked + 2 * mc.vocab_size * 4, reserve_bytes=RUNTIME_RESERVE_BYTES,
        slot_bytes=mc.num_hidden_layers * expert, slots_per_layer=0)
    fixed = MemoryPlan(**plan).fixed_bytes
    if resident:
        p = MemoryPlan(**plan)
        if fixed > budget_bytes:
            raise ValueError(f"resident experts do not fit the device-memory budget: {p.describe()}")
        return p
    fit = max(0, (int(budget_bytes) - fixed) // plan["slot_bytes"])
    slots = config.expert_slots_per_layer or min(mc.num_experts, fit)
    p = MemoryPlan(**{**plan, "slots_per_layer": slots})
    if slots < k or slots > fit:
        need = max(slots, k)
        raise ValueError(
            f"the device-memory budget holds {fit} expert slots per layer but decode needs "
            f"{need} (num_experts_per_tok={k}{'' if slots <= k else ', as requested'}); {p.describe()}. Raise "
            f"--gpu-memory-budget to at least {(fixed + need * plan['slot_bytes']) / 1e9:.2f} GB, lower "
            "--max-context, or set fewer --expert-slots-per-layer")
    return p
