"""Weights: seeded random initialisation, or a local Hugging Face checkpoint directory (safetensors).

Contract:
- ``random_weights(cfg, seed, bank, device, dtype) -> DenseWeights`` draws every tensor with a
  ``torch.Generator`` on the compute device, seeded per (seed, layer, tensor), so values depend only on
  (seed, device type) and not on the order of generation; the expert bank is generated one layer at a time
  on the device and copied into the host bank (never the whole bank at once, never 60 GB on the CPU).
  Every matrix is N(0, 1/fan_in) (0.022 for Qwen3-30B-A3B's hidden 2048, 0.088 for ``tiny``), the
  embedding N(0, 1), RMSNorm weights ones: each block's input is normed, so every projection's output is
  O(1), every layer adds an O(1) update to the residual stream, routing is neither uniform nor one-hot and
  the logits are O(1). (A flat 0.02 makes the layers' updates vanish next to the embeddings at hidden 128,
  and the tiny model then repeats one token whatever the prompt.)
- ``load_checkpoint(path, cfg, bank, device, dtype) -> DenseWeights`` reads ``*.safetensors`` of a
  ``Qwen3MoeForCausalLM`` checkpoint tensor by tensor, casting to ``dtype``. Expert weights are accepted
  in both layouts:
  * per expert (the hub's files, and what transformers 5.x ``save_pretrained`` writes: it converts its
    fused in-memory experts back on save): ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``;
  * fused (transformers 5.x in-memory ``state_dict``): ``model.layers.{l}.mlp.experts.gate_up_proj``
    [E, 2I, H] (gate rows first) and ``model.layers.{l}.mlp.experts.down_proj`` [E, H, I].
  Shapes are checked against the ModelConfig with errors that name the key.
- Hybrid models (``HybridConfig``, Qwen3.5/3.6-MoE): ``random_hybrid_weights`` and ``load_hybrid_checkpoint``
  have the same contracts and fill the same expert bank (routed experts only; the shared expert is a dense
  weight). Random: matrices N(0, 1/fan_in), the conv N(0, 1/K), zero-centred norm weights zeros (scale 1),
  the gated norm ones, dt_bias ones, A_log = log(U(1, 16)) (so g is O(-1..-16) per token: the state forgets
  within a few tokens to a few hundred). Checkpoints: the keys of ``Qwen3_5MoeForCausalLM``
  (``model.layers.{l}.linear_attn.*`` / ``self_attn.*`` / ``mlp.shared_expert*``) or of the multimodal
  ``Qwen3_5MoeForConditionalGeneration`` (``model.language_model.`` prefix; vision and MTP tensors ignored),
  routed experts per expert or fused as above.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from abbench.engine.config import ModelConfig
from abbench.engine.models.bank import FP8, ExpertBank, dequantize
from abbench.engine.config import HybridConfig
from abbench.engine.models.hybrid import AttnWeights, HybridLayerWeights, HybridWeights, LinearWeights
from abbench.engine.models.qwen3_moe import DenseWeights, LayerWeights


# Tensor kinds for seeding (stable numbers: changing them changes every random model).
_EMBED, _LM_HEAD, _Q, _K, _V, _O, _ROUTER, _GATE_UP, _DOWN = range(9)
_QKV, _Z, _B, _A, _CONV, _ALOG, _OUT, _SH_GATE_UP, _SH_DOWN, _SH_GATE = range(9, 19)  # hybrid models


def layer_seed(seed: int, layer: int, kind: int) -> int:
    """The seed of one tensor kind of one layer under the weights' ``seed`` (every family draws with it)."""
    return (seed * 1_000_003 + (layer + 2) * 1_009 + kind) % (2**63 - 1)


class Draw:
    """Seeded draws on the compute device: each tensor from a generator seeded by (seed, layer, kind), so its
    values depend on those alone, not on the order of generation."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype):
        self.seed, self.device, self.dtype = seed, device, dtype
        self.gen = torch.Generator(device=device)

    def normal(self, shape: tuple[int, ...], layer: int, kind: int, std: float | None = None) -> torch.Tensor:
        """N(0, std^2), std 1/sqrt(fan_in) (the last dimension) by default, cast to the model dtype."""
        self.gen.manual_seed(layer_seed(self.seed, layer, kind))
        t = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return t.mul_(shape[-1] ** -0.5 if std is None else std).to(self.dtype)

    def const(self, n: int, value: float) -> torch.Tensor:
        return torch.full((n,), value, device=self.device, dtype=self.dtype)


def random_layer(cfg: ModelConfig, draw: Draw, l: int) -> tuple[LayerWeights, torch.Tensor, torch.Tensor]:
    """Layer ``l`` of a random Qwen3-MoE model: its dense weights and its experts (gate_up [E, 2I, H], down
    [E, H, I]) on ``draw``'s device. ``random_weights`` builds every layer with this, and so does the GGUF
    exporter (:mod:`abbench.peers.gguf_export`), so both hold the same values."""
    normal = draw.normal

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=draw.device, dtype=draw.dtype)

    h, d, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    lw = LayerWeights(
        input_norm=ones(h), q_proj=normal((hq * d, h), l, _Q), k_proj=normal((hkv * d, h), l, _K),
        v_proj=normal((hkv * d, h), l, _V), o_proj=normal((h, hq * d), l, _O), q_norm=ones(d),
        k_norm=ones(d), post_norm=ones(h), router=normal((e, h), l, _ROUTER))
    return lw, normal((e, 2 * i, h), l, _GATE_UP), normal((e, h, i), l, _DOWN)


def random_embed(cfg: ModelConfig, draw: Draw) -> torch.Tensor:
    """The random embedding [V, H] (N(0, 1))."""
    return draw.normal((cfg.vocab_size, cfg.hidden_size), -1, _EMBED, std=1.0)


def random_lm_head(cfg: ModelConfig, draw: Draw) -> torch.Tensor:
    """The random untied lm_head [V, H] (callers use the embedding itself when the embeddings are tied)."""
    return draw.normal((cfg.vocab_size, cfg.hidden_size), -1, _LM_HEAD)


def random_weights(cfg: ModelConfig, seed: int, bank: ExpertBank, device: torch.device,
                   dtype: torch.dtype) -> DenseWeights:
    draw = Draw(seed, device, dtype)
    layers = []
    for l in range(cfg.num_hidden_layers):
        lw, gate_up, down = random_layer(cfg, draw, l)
        layers.append(lw)
        bank.put_layer(l, gate_up, down)  # one layer at a time through the device
        del gate_up, down
    embed = random_embed(cfg, draw)
    lm_head = embed if cfg.tie_word_embeddings else random_lm_head(cfg, draw)
    return DenseWeights(embed=embed, layers=layers, norm=torch.ones(cfg.hidden_size, device=device, dtype=dtype),
                        lm_head=lm_head)


def fp8_block_size(path: str | Path) -> tuple[int, int] | None:
    """The ``weight_block_size`` of a block-wise FP8 checkpoint (``config.json``'s ``quantization_config``:
    ``quant_method`` "fp8", float8 e4m3 weights with ``weight_scale_inv`` [ceil(rows / br), ceil(cols / bc)]
    float32 scales beside them: the format of Qwen's -FP8 checkpoints); None for an unquantized checkpoint or a
    path with no ``config.json``. ValueError for a quantization this engine cannot read."""
    p = Path(path)
    cfg = p / "config.json" if p.is_dir() else p
    if not cfg.is_file():
        return None
    raw = json.loads(cfg.read_text())
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not block or len(block) != 2:
        raise ValueError(f"{cfg}: quantization_config {q} is not supported; the engine reads block-wise FP8 "
                         "checkpoints (quant_method 'fp8', fmt 'e4m3', weight_block_size [br, bc])")
    return int(block[0]), int(block[1])


class Checkpoint:
    """Key -> tensor access over the safetensors files of a directory. A block-wise FP8 checkpoint's weights
    (:func:`fp8_block_size`) come back dequantized to float32 from ``get``, or as they are from ``get_fp8``."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {path}")
        self.path = path
        self.fp8_block = fp8_block_size(path)
        self.handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.where = {k: hd for hd in self.handles for k in hd.keys()}
        index = path / "model.safetensors.index.json"
        if index.is_file():
            missing = set(json.loads(index.read_text()).get("weight_map", {})) - set(self.where)
            if missing:
                raise ValueError(f"{path}: index names {len(missing)} tensors not found, e.g. {sorted(missing)[0]}")

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def _raw(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in self.where:
            raise ValueError(f"{self.path}: tensor {key!r} is missing")
        t = self.where[key].get_tensor(key)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.path}: tensor {key!r} has shape {tuple(t.shape)}, the config says {shape}")
        return t

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``key`` of ``shape``; an FP8 weight dequantized with its block scales (float32)."""
        t = self._raw(key, shape)
        if t.dtype != FP8:
            return t
        return dequantize(t[None], self._scale(key, shape)[None], torch.float32, self.fp8_block)[0]

    def get_fp8(self, key: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 weight [rows, cols] as it is stored: (float8 e4m3 values, float32 block scales [ceil(rows / br),
        ceil(cols / bc)], the ``weight_scale_inv`` beside it)."""
        t = self._raw(key, shape)
        if t.dtype != FP8:
            raise ValueError(f"{self.path}: tensor {key!r} is {t.dtype}, not float8_e4m3fn")
        return t, self._scale(key, shape)

    def _scale(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The block scales of the FP8 weight ``key`` (its ``weight_scale_inv``) as float32."""
        if self.fp8_block is None:
            raise ValueError(f"{self.path}: {key!r} is stored in FP8 but config.json has no FP8 "
                             "quantization_config (weight_block_size) to read its scales by")
        br, bc = self.fp8_block
        scale_key = key.removesuffix("weight") + "weight_scale_inv"
        return self._raw(scale_key, (-(-shape[0] // br), -(-shape[1] // bc))).to(torch.float32)


def load_checkpoint(path: str | Path, cfg: ModelConfig, bank: ExpertBank, device: torch.device,
                    dtype: torch.dtype) -> DenseWeights:
    ck = Checkpoint(Path(path))
    h, d, e = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def dev(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        return ck.get(key, shape).to(device=device, dtype=dtype)

    layers = []
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        layers.append(LayerWeights(
            input_norm=dev(p + "input_layernorm.weight", (h,)),
            q_proj=dev(p + "self_attn.q_proj.weight", (hq * d, h)),
            k_proj=dev(p + "self_attn.k_proj.weight", (hkv * d, h)),
            v_proj=dev(p + "self_attn.v_proj.weight", (hkv * d, h)),
            o_proj=dev(p + "self_attn.o_proj.weight", (h, hq * d)),
            q_norm=dev(p + "self_attn.q_norm.weight", (d,)),
            k_norm=dev(p + "self_attn.k_norm.weight", (d,)),
            post_norm=dev(p + "post_attention_layernorm.weight", (h,)),
            router=dev(p + "mlp.gate.weight", (e, h))))
        load_experts(ck, p, l, cfg, bank)
    embed, lm_head = load_embed_and_head(ck, dev, "model.", cfg, path)
    return DenseWeights(embed=embed, layers=layers, norm=dev("model.norm.weight", (h,)), lm_head=lm_head)


def load_embed_and_head(ck: Checkpoint, dev, root: str, cfg, path) -> tuple[torch.Tensor, torch.Tensor]:
    """The token embedding (``{root}embed_tokens.weight``) and lm_head of a checkpoint, through ``dev`` (the
    loader's key, shape -> device tensor); a tied lm_head is the embedding itself."""
    embed = dev(root + "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    if cfg.tie_word_embeddings:
        return embed, embed
    if "lm_head.weight" not in ck:
        raise ValueError(f"{path}: lm_head.weight is missing and tie_word_embeddings is false")
    return embed, dev("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))


def random_linear_mixer(cfg: HybridConfig, draw: Draw, l: int) -> LinearWeights:
    """The Gated DeltaNet mixer of linear layer ``l`` (the Qwen3.5 hybrid's and Qwen4-Exp's): A = U(1, 16) as
    transformers initialises it, dt_bias 1, the output norm's weight 1, matrices N(0, 1/fan_in)."""
    normal, const = draw.normal, draw.const
    h, hv, dv, c = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim
    draw.gen.manual_seed(layer_seed(draw.seed, l, _ALOG))
    a = torch.rand(hv, generator=draw.gen, device=draw.device, dtype=torch.float32) * 15 + 1  # [Hv] U(1, 16)
    return LinearWeights(
        in_proj_qkv=normal((c, h), l, _QKV), in_proj_z=normal((hv * dv, h), l, _Z),
        in_proj_b=normal((hv, h), l, _B), in_proj_a=normal((hv, h), l, _A),
        conv=normal((c, cfg.linear_conv_kernel_dim), l, _CONV), dt_bias=const(hv, 1.0),
        A_log=a.log().to(draw.dtype), norm=const(dv, 1.0), out_proj=normal((h, hv * dv), l, _OUT))


def random_hybrid_weights(cfg: HybridConfig, seed: int, bank: ExpertBank, device: torch.device,
                          dtype: torch.dtype) -> HybridWeights:
    draw = Draw(seed, device, dtype)
    normal, const = draw.normal, draw.const

    h, d, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    hq, hkv, i_s = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.shared_expert_intermediate_size
    layers = []
    for l in range(cfg.num_hidden_layers):
        if cfg.layer_types[l] == "full_attention":
            mixer = AttnWeights(q_proj=normal((hq * 2 * d, h), l, _Q), k_proj=normal((hkv * d, h), l, _K),
                                v_proj=normal((hkv * d, h), l, _V), o_proj=normal((h, hq * d), l, _O),
                                q_norm=const(d, 0.0), k_norm=const(d, 0.0))
        else:
            mixer = random_linear_mixer(cfg, draw, l)
        layers.append(HybridLayerWeights(
            input_norm=const(h, 0.0), mixer=mixer, post_norm=const(h, 0.0), router=normal((e, h), l, _ROUTER),
            shared_gate_up=normal((2 * i_s, h), l, _SH_GATE_UP), shared_down=normal((h, i_s), l, _SH_DOWN),
            shared_gate=normal((1, h), l, _SH_GATE)))
        bank.put_layer(l, normal((e, 2 * i, h), l, _GATE_UP), normal((e, h, i), l, _DOWN))  # a layer at a time
    embed = normal((cfg.vocab_size, h), -1, _EMBED, std=1.0)
    lm_head = embed if cfg.tie_word_embeddings else normal((cfg.vocab_size, h), -1, _LM_HEAD)
    return HybridWeights(embed=embed, layers=layers, norm=const(h, 0.0), lm_head=lm_head)


def load_experts(ck: Checkpoint, p: str, l: int, cfg: ModelConfig, bank: ExpertBank) -> None:
    """Layer ``l``'s routed experts (key prefix ``p``), fused or per expert, into the bank."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    fused = p + "mlp.experts.gate_up_proj"
    if fused in ck:
        bank.put_layer(l, ck.get(fused, (e, 2 * i, h)), ck.get(p + "mlp.experts.down_proj", (e, h, i)))
        return
    if bank.block is not None:  # an FP8 checkpoint into an FP8 bank with its block scales: kept as they are
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            bank.put_expert_fp8(l, x, ck.get_fp8(q + "gate_proj.weight", (i, h)),
                                ck.get_fp8(q + "up_proj.weight", (i, h)), ck.get_fp8(q + "down_proj.weight", (h, i)))
        return
    if not bank.fp8:  # straight into the bank
        gate_up, down = bank.gate_up[l], bank.down[l]
    else:  # the layer in the checkpoint's precision first, then quantized as a whole
        t = ck.get(f"{p}mlp.experts.0.down_proj.weight", (h, i))
        gate_up, down = torch.empty((e, 2 * i, h), dtype=t.dtype), torch.empty((e, h, i), dtype=t.dtype)
    for x in range(e):
        q = f"{p}mlp.experts.{x}."
        gate_up[x, :i].copy_(ck.get(q + "gate_proj.weight", (i, h)))
        gate_up[x, i:].copy_(ck.get(q + "up_proj.weight", (i, h)))
        down[x].copy_(ck.get(q + "down_proj.weight", (h, i)))
    if bank.fp8:
        bank.put_layer(l, gate_up, down)


def load_linear_mixer(cfg: HybridConfig, dev: Callable[[str, tuple[int, ...]], torch.Tensor],
                      a: str) -> LinearWeights:
    """A Gated DeltaNet mixer from checkpoint keys under ``a`` (``...layers.{l}.linear_attn.``); ``dev(key,
    shape)`` reads one tensor onto the device. The depthwise conv is stored [C, 1, K] and kept as [C, K]."""
    h, hv, dv, c = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim
    return LinearWeights(
        in_proj_qkv=dev(a + "in_proj_qkv.weight", (c, h)), in_proj_z=dev(a + "in_proj_z.weight", (hv * dv, h)),
        in_proj_b=dev(a + "in_proj_b.weight", (hv, h)), in_proj_a=dev(a + "in_proj_a.weight", (hv, h)),
        conv=dev(a + "conv1d.weight", (c, 1, cfg.linear_conv_kernel_dim))[:, 0].contiguous(),
        dt_bias=dev(a + "dt_bias", (hv,)), A_log=dev(a + "A_log", (hv,)),
        norm=dev(a + "norm.weight", (dv,)), out_proj=dev(a + "out_proj.weight", (h, hv * dv)))


def load_hybrid_checkpoint(path: str | Path, cfg: HybridConfig, bank: ExpertBank, device: torch.device,
                           dtype: torch.dtype) -> HybridWeights:
    ck = Checkpoint(Path(path))
    root = "model.language_model." if "model.language_model.embed_tokens.weight" in ck else "model."
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv, i_s = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.shared_expert_intermediate_size

    def dev(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        return ck.get(key, shape).to(device=device, dtype=dtype)

    layers = []
    for l in range(cfg.num_hidden_layers):
        p = f"{root}layers.{l}."
        if cfg.layer_types[l] == "full_attention":
            a = p + "self_attn."
            mixer = AttnWeights(q_proj=dev(a + "q_proj.weight", (hq * 2 * d, h)),
                                k_proj=dev(a + "k_proj.weight", (hkv * d, h)),
                                v_proj=dev(a + "v_proj.weight", (hkv * d, h)),
                                o_proj=dev(a + "o_proj.weight", (h, hq * d)),
                                q_norm=dev(a + "q_norm.weight", (d,)), k_norm=dev(a + "k_norm.weight", (d,)))
        else:
            mixer = load_linear_mixer(cfg, dev, p + "linear_attn.")
        s = p + "mlp.shared_expert."
        layers.append(HybridLayerWeights(
            input_norm=dev(p + "input_layernorm.weight", (h,)), mixer=mixer,
            post_norm=dev(p + "post_attention_layernorm.weight", (h,)),
            router=dev(p + "mlp.gate.weight", (cfg.num_experts, h)),
            shared_gate_up=torch.cat([dev(s + "gate_proj.weight", (i_s, h)), dev(s + "up_proj.weight", (i_s, h))]),
            shared_down=dev(s + "down_proj.weight", (h, i_s)),
            shared_gate=dev(p + "mlp.shared_expert_gate.weight", (1, h))))
        load_experts(ck, p, l, cfg, bank)
    embed, lm_head = load_embed_and_head(ck, dev, root, cfg, path)
    return HybridWeights(embed=embed, layers=layers, norm=dev(root + "norm.weight", (h,)), lm_head=lm_head)
