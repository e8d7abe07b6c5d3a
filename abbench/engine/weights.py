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
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ModelConfig
from .experts import ExpertBank
from .model import DenseWeights, LayerWeights


# Tensor kinds for seeding (stable numbers: changing them changes every random model).
_EMBED, _LM_HEAD, _Q, _K, _V, _O, _ROUTER, _GATE_UP, _DOWN = range(9)


def _seed(seed: int, layer: int, kind: int) -> int:
    return (seed * 1_000_003 + (layer + 2) * 1_009 + kind) % (2**63 - 1)


def random_weights(cfg: ModelConfig, seed: int, bank: ExpertBank, device: torch.device,
                   dtype: torch.dtype) -> DenseWeights:
    gen = torch.Generator(device=device)

    def normal(shape: tuple[int, ...], layer: int, kind: int, std: float | None = None) -> torch.Tensor:
        gen.manual_seed(_seed(seed, layer, kind))
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        return t.mul_(shape[-1] ** -0.5 if std is None else std).to(dtype)  # std 1/sqrt(fan_in) by default

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    h, d, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = []
    for l in range(cfg.num_hidden_layers):
        layers.append(LayerWeights(
            input_norm=ones(h), q_proj=normal((hq * d, h), l, _Q), k_proj=normal((hkv * d, h), l, _K),
            v_proj=normal((hkv * d, h), l, _V), o_proj=normal((h, hq * d), l, _O), q_norm=ones(d),
            k_norm=ones(d), post_norm=ones(h), router=normal((e, h), l, _ROUTER)))
        bank.gate_up[l].copy_(normal((e, 2 * i, h), l, _GATE_UP))  # one layer at a time through the device
        bank.down[l].copy_(normal((e, h, i), l, _DOWN))
    embed = normal((cfg.vocab_size, h), -1, _EMBED, std=1.0)
    lm_head = embed if cfg.tie_word_embeddings else normal((cfg.vocab_size, h), -1, _LM_HEAD)
    return DenseWeights(embed=embed, layers=layers, norm=ones(h), lm_head=lm_head)


class _Checkpoint:
    """Key -> tensor access over the safetensors files of a directory."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {path}")
        self.path = path
        self.handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.where = {k: hd for hd in self.handles for k in hd.keys()}
        index = path / "model.safetensors.index.json"
        if index.is_file():
            missing = set(json.loads(index.read_text()).get("weight_map", {})) - set(self.where)
            if missing:
                raise ValueError(f"{path}: index names {len(missing)} tensors not found, e.g. {sorted(missing)[0]}")

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in self.where:
            raise ValueError(f"{self.path}: tensor {key!r} is missing")
        t = self.where[key].get_tensor(key)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.path}: tensor {key!r} has shape {tuple(t.shape)}, the config says {shape}")
        return t


def load_checkpoint(path: str | Path, cfg: ModelConfig, bank: ExpertBank, device: torch.device,
                    dtype: torch.dtype) -> DenseWeights:
    ck = _Checkpoint(Path(path))
    h, d, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
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
        fused = p + "mlp.experts.gate_up_proj"
        if fused in ck:
            bank.gate_up[l].copy_(ck.get(fused, (e, 2 * i, h)))
            bank.down[l].copy_(ck.get(p + "mlp.experts.down_proj", (e, h, i)))
        else:
            for x in range(e):
                q = f"{p}mlp.experts.{x}."
                bank.gate_up[l][x, :i].copy_(ck.get(q + "gate_proj.weight", (i, h)))
                bank.gate_up[l][x, i:].copy_(ck.get(q + "up_proj.weight", (i, h)))
                bank.down[l][x].copy_(ck.get(q + "down_proj.weight", (h, i)))
    embed = dev("model.embed_tokens.weight", (cfg.vocab_size, h))
    if "lm_head.weight" in ck and not cfg.tie_word_embeddings:
        lm_head = dev("lm_head.weight", (cfg.vocab_size, h))
    elif cfg.tie_word_embeddings:
        lm_head = embed
    else:
        raise ValueError(f"{path}: lm_head.weight is missing and tie_word_embeddings is false")
    return DenseWeights(embed=embed, layers=layers, norm=dev("model.norm.weight", (h,)), lm_head=lm_head)
